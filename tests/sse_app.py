"""An ASGI app that answers every request with the same server-sent events: recorded or
scripted streams, served over real HTTP to the client under test."""

from __future__ import annotations

from typing import Any


class FixedStream:
    def __init__(self, events: bytes) -> None:
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.events})
