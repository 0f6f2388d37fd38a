"""Drives the load: a closed loop (fixed concurrency) or an open loop (fixed request rate).

- Closed loop: ``concurrency`` workers, each sending its next request as soon as its previous
  one ended. With sessions, at most ``min(concurrency, sessions)`` workers run, since a
  conversation has one request in flight at a time (so a worker always finds one ready).
- Open loop: requests start at `arrival_times` (Poisson or evenly spaced), however many are in
  flight. With sessions, an arrival that finds every conversation waiting for its reply waits
  for the first one to be ready (the achieved rate then falls below the asked one; the results
  show it).
- Budget: ``requests`` requests, or sending stops after ``duration`` seconds; requests in flight
  then still finish and count. Setting the `stop` event stops sending the same way (Ctrl-C).

The clock is injected (``time.perf_counter`` by default); records carry its readings.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp

from llmgw.services.bench.client import RequestOptions, send
from llmgw.services.bench.report import progress_line
from llmgw.services.bench.stats import RequestRecord
from llmgw.services.bench.workload import (
    Conversations,
    RequestPlan,
    WorkloadSpec,
    arrival_times,
)

__all__ = ["LoadSpec", "Progress", "open_session", "run_load"]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Exactly one of ``concurrency`` and ``rate``; ``requests`` or ``duration`` (or both)."""

    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    requests: int | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency and rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.requests is None and self.duration is None:
            raise ValueError("give requests or duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")


class Progress:
    """Counts what the run did and repaints one status line on `stream` every `interval` s.

    On a terminal the line is rewritten in place (``\\r``); otherwise each repaint is a line.
    """

    def __init__(self, stream: TextIO, *, interval: float = 0.5, clock: Clock = time.perf_counter):
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.label = ""
        self.total: int | None = None
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.started = clock()
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._task: asyncio.Task[None] | None = None

    def begin(self, label: str, total: int | None) -> None:
        self.label, self.total, self.records, self.in_flight = label, total, [], 0
        self.started = self.clock()
        self._task = asyncio.create_task(self._repaint(), name="bench-progress")

    async def end(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._paint(final=True)

    def _paint(self, final: bool = False) -> None:
        line = progress_line(
            self.label, self.records, self.in_flight, self.total, self.clock() - self.started
        )
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    async def _repaint(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._paint()


def open_session(timeout: float) -> aiohttp.ClientSession:
    """An aiohttp session without a connection limit (the load shape is the only limit)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout),
    )


class _Budget:
    def __init__(self, load: LoadSpec, clock: Clock, stop: asyncio.Event | None) -> None:
        self.left = load.requests
        self.deadline = None if load.duration is None else clock() + load.duration
        self.clock = clock
        self.stop = stop

    def take(self) -> bool:
        if self.stop is not None and self.stop.is_set():
            return False
        if self.deadline is not None and self.clock() >= self.deadline:
            return False
        if self.left is not None:
            if self.left <= 0:
                return False
            self.left -= 1
        return True


async def run_load(
    session: aiohttp.ClientSession,
    options: RequestOptions,
    workload: WorkloadSpec,
    load: LoadSpec,
    *,
    rng: random.Random,
    clock: Clock = time.perf_counter,
    progress: Progress | None = None,
    stop: asyncio.Event | None = None,
    label: str = "bench",
) -> list[RequestRecord]:
    """Run one load shape to the end of its budget; the records in the order requests ended."""
    conversations = Conversations(workload, rng)
    arrival_rng = random.Random(rng.getrandbits(64))
    budget = _Budget(load, clock, stop)
    records: list[RequestRecord] = []
    ready = asyncio.Event()

    async def one(plan: RequestPlan) -> None:
        if progress is not None:
            progress.in_flight += 1
        try:
            record, reply = await send(session, plan, options, clock)
        finally:
            if progress is not None:
                progress.in_flight -= 1
        conversations.complete(plan, reply)
        records.append(record)
        if progress is not None:
            progress.records.append(record)
        ready.set()

    if progress is not None:
        progress.begin(label, load.requests)
    try:
        if load.concurrency is not None:
            workers = load.concurrency
            if workload.sessions is not None:
                workers = min(workers, workload.sessions)

            async def worker() -> None:
                while budget.take():
                    plan = conversations.next_request()
                    assert plan is not None  # workers <= sessions: one is always ready
                    await one(plan)

            await asyncio.gather(*(worker() for _ in range(workers)))
        else:
            await _open_loop(load, arrival_rng, budget, conversations, one, ready, clock, stop)
    finally:
        if progress is not None:
            await progress.end()
    return records


async def _open_loop(
    load: LoadSpec,
    rng: random.Random,
    budget: _Budget,
    conversations: Conversations,
    one: Callable[[RequestPlan], Coroutine[Any, Any, None]],
    ready: asyncio.Event,
    clock: Clock,
    stop: asyncio.Event | None,
) -> None:
    assert load.rate is not None
    tasks: set[asyncio.Task[None]] = set()
    started = clock()
    try:
        for at in arrival_times(load.rate, load.arrival, rng):
            delay = started + at - clock()
            if delay > 0:
                if stop is None:
                    await asyncio.sleep(delay)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
            if not budget.take():
                break
            plan = conversations.next_request()
            while plan is None:  # every conversation awaits its reply
                ready.clear()
                await ready.wait()
                plan = conversations.next_request()
            task = asyncio.create_task(one(plan))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
