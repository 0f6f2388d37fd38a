"""An OpenAI-compatible upstream that holds every request until its gate opens: the ground
truth of how many requests the gateway runs at once on an engine (`running`, `peak`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from misbehaving import chat_completion_body


@dataclass
class GatedEngine:
    """An OpenAI-compatible upstream that holds every request until `gate` opens, counting how
    many it holds at once (`running`, `peak`)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = 0
    peak: int = 0
    served: int = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET":  # the scraper: healthy, and no load metrics at all
            status = 200 if scope["path"] == "/health" else 404
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        self.served += 1
        body = chat_completion_body(model="m1")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
