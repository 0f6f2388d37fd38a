"""Edge hardening: caps on request headers, and OpenAI-shaped errors from the HTTP server itself.

- `headers_refused`: more than `router.max_header_count` headers, or more than
  `router.max_header_bytes` of them (names and values), is a 431 with an OpenAI error body,
  decided from the ASGI scope before any route runs (a sum over the header list, ~1 µs);
- `OpenAIErrorsHttpTools`: uvicorn's httptools protocol, except that a request the parser refuses
  (a control character in a header, a malformed request line) gets a JSON 400
  (``invalid_request_error`` / ``malformed_request``) instead of uvicorn's plain-text page.
  `llmgw.serving.start_server` uses it for any app that names it as ``http_protocol``. It also
  sends each response's head together with its first body bytes (`HeadWithBody`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from llmgw.services.edge.errors import error_body

__all__ = ["HeadWithBody", "OpenAIErrorsHttpTools", "headers_refused"]

_STATUS_431 = 431


def headers_refused(scope: Mapping[str, Any], max_count: int, max_bytes: int) -> Response | None:
    """The 431 for a request with too many or too large headers, else None."""
    headers = scope.get("headers") or ()
    if len(headers) > max_count:
        message = f"The request has {len(headers)} headers; at most {max_count} are accepted."
    else:
        size = sum(len(name) + len(value) for name, value in headers)
        if size <= max_bytes:
            return None
        message = f"The request headers take {size} bytes; at most {max_bytes} are accepted."
    return Response(
        error_body(message, "invalid_request_error", "request_headers_too_large"),
        status_code=_STATUS_431,
        media_type="application/json",
        headers={"connection": "close"},
    )


class HeadWithBody:
    """One response's transport (uvicorn's cycle writes through it): the response head (status
    line and headers, the cycle's first write but for a ``100 Continue``) is held until the first
    body bytes and sent with them in one write, so the client gets one segment and wakes once,
    not twice; the edge makes one send call. A head whose body does not follow in the same loop
    turn (a HEAD request, a stream that has nothing yet) goes at the next turn, alone.

    Invariant: bytes reach the socket in the order written; nothing is held past one loop turn
    or past `close`."""

    __slots__ = ("_held", "_started", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._started = False  # the head was written (held or sent)

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif not self._started and not data.startswith(b"HTTP/1.1 100 "):
            self._started = True
            self._held = data
            asyncio.get_running_loop().call_soon(self._send_held)
            return
        self._transport.write(data)

    def _send_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def close(self) -> None:
        self._send_held()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OpenAIErrorsHttpTools(HttpToolsProtocol):
    """HttpToolsProtocol whose parser errors are OpenAI-shaped JSON, and whose responses go out
    head and body in one write (`HeadWithBody`; see the module docstring)."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle  # the new request's (its ASGI task has not run yet)
        if cycle is not None and not isinstance(cycle.transport, HeadWithBody):
            # uvicorn's cycle only writes through its transport, which HeadWithBody passes on.
            cycle.transport = cast(asyncio.Transport, HeadWithBody(self.transport))

    def send_400_response(self, msg: str) -> None:
        body = error_body(
            f"The HTTP request is malformed: {msg}", "invalid_request_error", "malformed_request"
        )
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()
