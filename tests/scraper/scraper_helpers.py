"""Shared pieces of the scraper tests: the test config, a collector of endpoint/pool events,
and a generator of long-running requests that keeps an engine busy."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from llmgw.clock import SYSTEM, Clock
from llmgw.config import Config
from llmgw.events import EndpointEvent, PoolMeasured, parse_event
from llmgw.load import EndpointReport, PoolReport
from llmgw.services.scraper.main import serve
from llmgw.services.scraper.metrics import ScraperMetrics
from llmgw.serving import RunningServer

WAIT = 10.0  # bound on one awaited condition, never a sleep
MODEL = "m1"

Connect = Callable[[], Awaitable[NatsClient]]
StartEngine = Callable[..., Awaitable[RunningServer]]


def config_data(
    nats_url: str, bucket: str, provider: str, endpoints: dict[str, str], **router: Any
) -> dict[str, Any]:
    """A config scraping `endpoints` (id -> url) of the managed `provider`, all in pool
    "gpu/a", every 100 ms; plus one endpoint of an unlimited provider that must never be
    scraped (its URL answers nothing)."""
    return {
        "nats": {"url": nats_url},
        "router": {
            "scrape_interval": "100ms",
            "scrape_timeout": "500ms",
            "stale_after": "1s",
            "load_bucket": bucket,
            **router,
        },
        "models": [{"name": MODEL}],
        "providers": [
            {"id": provider, "kind": "managed", "models": [{"name": MODEL}]},
            {"id": f"{provider}-third", "kind": "unlimited", "models": [{"name": MODEL}]},
        ],
        "endpoints": [
            *(
                {
                    "id": endpoint,
                    "url": url,
                    "provider": provider,
                    "models": [MODEL],
                    "pool": "gpu/a",
                    # The least batch capacity there is: what the scraper learns shows above it.
                    "capacity": 1,
                }
                for endpoint, url in endpoints.items()
            ),
            {
                "id": "third-party",
                "url": "http://127.0.0.1:9",
                "provider": f"{provider}-third",
                "models": [MODEL],
            },
        ],
    }


@dataclass(frozen=True)
class Received:
    subject: str
    verb: str  # "scraped", "healthy", "unhealthy", "measured"
    payload: bytes

    @property
    def report(self) -> EndpointReport:
        event = parse_event(self.payload)  # one events union for every llmgw.v1.events subject
        assert isinstance(event, EndpointEvent) and event.subject == self.subject
        return event.report

    @property
    def pool(self) -> PoolReport:
        event = parse_event(self.payload)
        assert isinstance(event, PoolMeasured) and event.subject == self.subject
        return event.report


class EventLog:
    """Every message on `llmgw.v1.events.*.*.<provider>`, in arrival order."""

    def __init__(self, nc: NatsClient, provider: str) -> None:
        self._nc = nc
        self.provider = provider
        self.received: list[Received] = []
        self._changed = asyncio.Condition()

    async def start(self) -> EventLog:
        await self._nc.subscribe(f"llmgw.v1.events.*.*.{self.provider}", cb=self._on_message)
        await self._nc.flush()
        return self

    async def _on_message(self, msg: Msg) -> None:
        verb = msg.subject.split(".")[-2]
        async with self._changed:
            self.received.append(Received(msg.subject, verb, msg.data))
            self._changed.notify_all()

    def reports(self, endpoint: str, verb: str = "scraped") -> list[EndpointReport]:
        return [
            r.report
            for r in self.received
            if r.verb == verb
            and r.subject.split(".")[3] == "endpoint"
            and r.report.endpoint == endpoint
        ]

    def transitions(self, endpoint: str) -> list[str]:
        """Health event verbs for `endpoint`, in arrival order."""
        return [
            r.verb
            for r in self.received
            if r.verb in ("healthy", "unhealthy") and r.report.endpoint == endpoint
        ]

    def pools(self) -> list[PoolReport]:
        return [r.pool for r in self.received if r.verb == "measured"]

    async def wait_until(
        self, predicate: Callable[[EventLog], bool], timeout: float = WAIT
    ) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def wait_for_report(
        self, endpoint: str, predicate: Callable[[EndpointReport], bool], timeout: float = WAIT
    ) -> EndpointReport:
        """The first scraped report of `endpoint` satisfying `predicate` (waits for it)."""

        def found(log: EventLog) -> bool:
            return any(predicate(r) for r in log.reports(endpoint))

        await self.wait_until(found, timeout)
        return next(r for r in self.reports(endpoint) if predicate(r))


class LoadGenerator:
    """Streamed chat completions that run until stopped (the engine aborts them then)."""

    def __init__(self) -> None:
        self._client = httpx.AsyncClient(timeout=None)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, url: str, count: int) -> None:
        for _ in range(count):
            self._tasks.append(asyncio.create_task(self._hold(url)))

    async def _hold(self, url: str) -> None:
        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": 500,
            "ignore_eos": True,  # all 500: runs until stopped
            "messages": [{"role": "user", "content": "keep going"}],
        }
        async with self._client.stream(
            "POST", f"{url}/v1/chat/completions", content=json.dumps(body)
        ) as response:
            async for _ in response.aiter_bytes():
                pass

    async def stop(self) -> None:
        """Cancel every request started so far (the generator stays usable)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
        self._tasks.clear()

    async def close(self) -> None:
        await self.stop()
        await self._client.aclose()


@contextlib.asynccontextmanager
async def running_scraper(
    config: Config,
    *,
    instance: str,
    metrics: ScraperMetrics | None = None,
    clock: Clock = SYSTEM,
) -> AsyncIterator[None]:
    """`serve(config)` in a task, ready when entered; stopped (and awaited) on exit. `clock`
    stamps its reports and paces its rounds (a test may step it)."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        serve(config, stop=stop, ready=ready, instance=instance, metrics=metrics, clock=clock)
    )
    ready_wait = asyncio.create_task(ready.wait())
    try:
        async with asyncio.timeout(WAIT):
            await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises what stopped it
            raise AssertionError("the scraper returned before it was ready")
        yield
    finally:
        ready_wait.cancel()
        stop.set()
        async with asyncio.timeout(WAIT):
            await task
