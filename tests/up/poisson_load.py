"""Open-loop Poisson load on a gateway, every request recorded (for the live-fleet tests).

Arrivals are a Poisson process of `rate` per second (seeded), each request independent of the
others' answers (open loop: a slow gateway does not slow the arrivals down), each a one-shot
chat request of its own session that writes exactly `max_tokens` tokens (vLLM's ``ignore_eos``:
a fixed service time). Every request ends in one `Sent` record: when it was sent and answered,
its status and the endpoint that served it.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class Sent:
    sent_at: float  # time.monotonic()
    ended_at: float
    status: int  # 0: no HTTP answer at all
    endpoint: str | None
    detail: str = ""


class PoissonLoad:
    def __init__(self, api: str, key: str, *, rate: float, max_tokens: int, seed: int) -> None:
        self.api = api
        self.rate = rate
        self.max_tokens = max_tokens
        self.records: list[Sent] = []
        self._rng = random.Random(seed)
        self._client = httpx.AsyncClient(
            timeout=60,
            headers={"authorization": f"Bearer {key}"},
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200),
        )
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None

    async def one(self) -> Sent:
        """One request, now (also the probe that measures service time)."""
        sent_at = time.monotonic()
        body = {
            "model": "llama",
            "messages": [{"role": "user", "content": f"load {uuid.uuid4().hex}"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }
        try:
            response = await self._client.post(
                f"{self.api}/chat/completions",
                json=body,
                headers={"x-session-id": uuid.uuid4().hex},
            )
        except httpx.HTTPError as exc:
            return Sent(sent_at, time.monotonic(), 0, None, repr(exc))
        return Sent(
            sent_at,
            time.monotonic(),
            response.status_code,
            response.headers.get("x-llmgw-endpoint"),
            "" if response.status_code == 200 else response.text[:300],
        )

    def start(self) -> None:
        self._runner = asyncio.create_task(self._arrivals())

    async def stop(self) -> list[Sent]:
        """No more arrivals; wait for every request sent to end."""
        self._stop.set()
        if self._runner is not None:
            await self._runner
        if self._tasks:
            await asyncio.wait(self._tasks)
        await self._client.aclose()
        return sorted(self.records, key=lambda r: r.sent_at)

    async def _arrivals(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self._rng.expovariate(self.rate)
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._record())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _record(self) -> None:
        self.records.append(await self.one())
