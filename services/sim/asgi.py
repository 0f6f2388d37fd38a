"""Minimal ASGI plumbing for the simulators (no framework: per-request cost matters in benchmarks).

Measured on the zero-delay engine, a bare ASGI callable answers several times more requests per
second than the same routes through a framework's router, request and response objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

__all__ = [
    "ClientGone",
    "DisconnectWatch",
    "SimulatedCrash",
    "error_body",
    "install_crash_log_filter",
    "read_body",
    "send_bytes",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_TYPE = (b"content-type", b"application/json")
MAX_BODY_BYTES = 64 * 1024 * 1024


class ClientGone(Exception):
    """The client disconnected before the request body was read."""


class BodyTooLarge(Exception):
    """The request body exceeded MAX_BODY_BYTES."""


class SimulatedCrash(Exception):
    """Raised after the response started to make the server drop the connection mid-response.

    ASGI has no "abort" message; the server closes the transport when the app raises after
    starting a response, which is exactly a crashing engine from the client's point of view.
    """


class _DropSimulatedCrashes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SimulatedCrash)


def install_crash_log_filter() -> None:
    """Keep the server's error log free of tracebacks for crashes we inject on purpose."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropSimulatedCrashes) for f in logger.filters):
        logger.addFilter(_DropSimulatedCrashes())


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: Any, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send_bytes(send, status, body, JSON_TYPE[1], headers)


def error_body(
    message: str, type: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


class DisconnectWatch:
    """Watches `receive` for ``http.disconnect`` while the app waits on something else.

    Started only by requests that actually wait, so zero-delay requests pay nothing for it.
    The task is kept here and cancelled by `stop()`; it never outlives its request.
    """

    __slots__ = ("_on_disconnect", "_task", "gone")

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self.gone = False
        self._on_disconnect = on_disconnect
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self._on_disconnect()
                return

    async def sleep(self, seconds: float) -> None:
        """Sleep, returning early if the client disconnects."""
        if seconds > 0 and not self.gone:
            await asyncio.wait({self._task}, timeout=seconds)

    def stop(self) -> None:
        self._task.cancel()
