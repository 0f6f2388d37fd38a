"""An OpenAI-compatible upstream that holds every request until its gate opens: the ground
truth of how many requests the gateway runs at once on an engine (`running`, `peak`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from misbehaving import chat_completion_body

from llmgw.config import Config, config_from_dict


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
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
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
        if json.loads(raw or b"{}").get("stream"):  # one token, the usage, [DONE]: at once
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": _STREAM})
            return
        body = chat_completion_body(model="m1")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


_CHUNK = {"id": "x", "object": "chat.completion.chunk", "model": "m1"}
_STREAM = (
    b"data: "
    + json.dumps({**_CHUNK, "choices": [{"index": 0, "delta": {"content": "ok"}}]}).encode()
    + b"\n\ndata: "
    + json.dumps(
        {**_CHUNK, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    ).encode()
    + b"\n\ndata: [DONE]\n\n"
)


def gated_config(
    nats_url: str,
    engine_url: str,
    *,
    g: int,
    admission: dict[str, Any],
    capacity: int | None = None,
    per_session: int = 2,
    **sections: Any,
) -> Config:
    """One managed pair (iris/m1: G slots, no reserve, S=`per_session`, 64 pins) on one engine at
    `engine_url`; flow control on as shipped (a scraper finds the engine healthy and without
    load metrics, so admission runs it on its own count). `sections` replace whole sections."""
    endpoint: dict[str, Any] = {
        "id": "engine-1",
        "url": engine_url,
        "provider": "iris",
        "models": ["m1"],
    }
    if capacity is not None:
        endpoint["capacity"] = capacity
    limits = {
        "max_pinned_sessions": 64,
        "max_global_in_flight_request_slots": g,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
        "max_per_session_in_flight_request_slots": per_session,
    }
    data: dict[str, Any] = {
        "nats": {"url": nats_url, "request_timeout": "3s"},
        "pinning": {"lease_timeout": "3s"},
        "admission": admission,
        "timeouts": {"first_token": "20s", "idle": "20s", "total": "30s"},
        "models": [{"name": "m1"}],
        "providers": [
            {"id": "iris", "kind": "managed", "models": [{"name": "m1", "limits": limits}]}
        ],
        "endpoints": [endpoint],
        **sections,
    }
    return config_from_dict(data, source="<test>", env={})
