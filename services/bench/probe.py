"""Watches an engine's ``/metrics`` while a sweep level runs: how many requests it ran at once.

Parsing is llmgw's own (`llmgw.core.engine_metrics`: vLLM's ``vllm:num_requests_running`` /
``waiting``, or SGLang's names). A target without engine metrics (404, not Prometheus text, no
engine series, unreachable) is *unavailable*: the sweep then relies on client-side
measurements only, and says why.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp

from llmgw.core.engine_metrics import MetricsFormatError, parse_engine_metrics

__all__ = ["EngineObservation", "MetricsProbe"]


@dataclass(frozen=True, slots=True)
class EngineObservation:
    """Engine load seen during one level: high-water marks and the number of scrapes."""

    samples: int
    running_max: int
    waiting_max: int
    running_mean: float

    def to_json(self) -> dict[str, float | int]:
        return {
            "samples": self.samples,
            "running_max": self.running_max,
            "waiting_max": self.waiting_max,
            "running_mean": self.running_mean,
        }


class MetricsProbe:
    """Scrapes `url` every `interval` seconds between `start` and `stop`."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float) -> None:
        self.session = session
        self.url = url
        self.interval = interval
        self.unavailable: str | None = None
        self._samples: list[_Load] = []
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> bool:
        """One scrape; False (and `unavailable` says why) when the target has no engine metrics."""
        try:
            await self._scrape()
        except _NoMetrics as exc:
            self.unavailable = str(exc)
            return False
        return True

    async def _scrape(self) -> _Load:
        try:
            async with self.session.get(self.url) as response:
                text = await response.text()
                if response.status != 200:
                    raise _NoMetrics(f"{self.url} answered {response.status}")
        except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError) as exc:
            raise _NoMetrics(f"{self.url}: {exc or type(exc).__name__}") from None
        try:
            sample = parse_engine_metrics(text)
        except MetricsFormatError as exc:
            raise _NoMetrics(f"{self.url}: {exc}") from None
        if sample is None or sample.running is None or sample.waiting is None:
            raise _NoMetrics(f"{self.url}: no running and waiting request gauges")
        return _Load(sample.running, sample.waiting)

    def start(self) -> None:
        self._samples = []
        self._task = asyncio.create_task(self._loop(), name="bench-metrics-probe")

    async def stop(self) -> EngineObservation | None:
        """Stop scraping; what was seen since `start`, None if no scrape succeeded."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self._samples:
            return None
        running = [s.running for s in self._samples]
        return EngineObservation(
            samples=len(self._samples),
            running_max=max(running),
            waiting_max=max(s.waiting for s in self._samples),
            running_mean=sum(running) / len(running),
        )

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(_NoMetrics):
                self._samples.append(await self._scrape())
            await asyncio.sleep(self.interval)


class _NoMetrics(Exception):
    pass


class _Load(NamedTuple):
    """One scrape's requests running and waiting at the engine."""

    running: int
    waiting: int
