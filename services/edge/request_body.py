"""A client's request body at the edge: read whole, bounded by ``router.max_body_bytes``, and
the answer to a body that could not be read.

The routed APIs (`llmgw.services.edge.app`) and the token count
(`llmgw.services.edge.count_tokens`) read bodies alike and answer alike: 413
``body_too_large`` for a body over the limit (by its declared length, before anything is read,
or once what arrived passes it), 499 for a client that left before its body arrived.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from llmgw.core.outcomes import Outcome
from llmgw.services.edge.errors import error_response

__all__ = ["BodyTooLarge", "ClientDisconnect", "read_request_body", "unread_answer"]


class BodyTooLarge(Exception):
    """The request's body is larger than the edge takes."""


async def read_request_body(request: Request, limit: int) -> bytes:
    """The whole body; raises `BodyTooLarge` past `limit` bytes, and starlette's
    `ClientDisconnect` when the client leaves first. Read from the ASGI messages themselves:
    a body that came in one message (most do) is returned as it came, without a copy."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    receive = request.receive
    parts: bytearray | None = None
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientDisconnect
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if parts is None and not more:
            if len(chunk) > limit:
                raise BodyTooLarge
            return chunk
        parts = bytearray() if parts is None else parts
        parts += chunk
        if len(parts) > limit:
            raise BodyTooLarge
        if not more:
            return bytes(parts)


def unread_answer(
    exc: BodyTooLarge | ClientDisconnect, limit: int, headers: dict[str, str]
) -> tuple[Response, Outcome]:
    """The answer to a body `read_request_body` could not read, and its outcome."""
    if isinstance(exc, ClientDisconnect):
        return Response(status_code=499), Outcome.CLIENT_DISCONNECTED
    return error_response(
        Outcome.BODY_TOO_LARGE,
        f"The request body exceeds the limit of {limit} bytes.",
        headers=headers,
    ), Outcome.BODY_TOO_LARGE
