"""``--sweep``: closed-loop levels of increasing concurrency against one engine, then the advice.

Each level runs the same workload at one concurrency (``requests_per_level(c)`` requests, or a
fixed duration) while a `MetricsProbe` watches the engine's ``/metrics`` if it has any. After
each level the knee is looked for (`llmgw.services.bench.sweep`); the sweep stops once a knee
is found and a later level's latency reached ``latency_factor`` times the knee's (enough to
place ``target_waiting``), when a level fails more than half its requests, when the levels run
out, or when `stop` is set.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from llmgw.services.bench.client import RequestOptions
from llmgw.services.bench.probe import MetricsProbe
from llmgw.services.bench.runner import LoadSpec, Progress, run_load
from llmgw.services.bench.stats import summarize
from llmgw.services.bench.sweep import (
    DEFAULT_LATENCY_FACTOR,
    DEFAULT_THRESHOLD,
    LevelPoint,
    Recommendation,
    find_knee,
    latency_ratio_reached,
    recommend,
)
from llmgw.services.bench.workload import WorkloadSpec

__all__ = ["SweepOutcome", "SweepSpec", "requests_per_level", "run_sweep"]

MAX_LEVEL_ERROR_RATE = 0.5


def requests_per_level(concurrency: int) -> int:
    """Default level size: 8 requests per concurrent slot, at least 16."""
    return max(16, 8 * concurrency)


@dataclass(frozen=True, slots=True)
class SweepSpec:
    levels: Sequence[int]
    requests: int | None = None
    """Requests per level; None: `requests_per_level` (unless `duration` is set)."""
    duration: float | None = None
    threshold: float = DEFAULT_THRESHOLD
    latency_factor: float = DEFAULT_LATENCY_FACTOR
    reference_throughput: float | None = None
    metrics_url: str | None = None
    metrics_interval: float = 0.2


@dataclass(slots=True)
class SweepOutcome:
    levels: list[dict[str, Any]]
    recommendation: Recommendation
    metrics: dict[str, Any]
    notes: list[str] = field(default_factory=list)


async def run_sweep(
    session: aiohttp.ClientSession,
    options: RequestOptions,
    workload: WorkloadSpec,
    spec: SweepSpec,
    *,
    rng: random.Random,
    clock: Callable[[], float] = time.perf_counter,
    progress: Progress | None = None,
    stop: asyncio.Event | None = None,
) -> SweepOutcome:
    probe = None
    metrics: dict[str, Any] = {"available": False, "url": spec.metrics_url, "reason": "disabled"}
    if spec.metrics_url is not None:
        candidate = MetricsProbe(session, spec.metrics_url, spec.metrics_interval)
        if await candidate.check():
            probe = candidate
            metrics = {"available": True, "url": spec.metrics_url, "reason": None}
        else:
            metrics["reason"] = candidate.unavailable
    levels: list[dict[str, Any]] = []
    points: list[LevelPoint] = []
    notes: list[str] = []
    for concurrency in spec.levels:
        if stop is not None and stop.is_set():
            notes.append("interrupted")
            break
        requests = spec.requests
        if requests is None and spec.duration is None:
            requests = requests_per_level(concurrency)
        load = LoadSpec(concurrency=concurrency, requests=requests, duration=spec.duration)
        if probe is not None:
            probe.start()
        try:
            records = await run_load(
                session,
                options,
                workload,
                load,
                rng=rng,
                clock=clock,
                progress=progress,
                stop=stop,
                label=f"sweep c={concurrency}",
            )
        finally:
            observation = await probe.stop() if probe is not None else None
        summary = summarize(records)
        levels.append(
            {
                "concurrency": concurrency,
                "summary": summary,
                "engine": observation.to_json() if observation is not None else None,
            }
        )
        if summary["ok"] == 0 or summary["error_rate"] > MAX_LEVEL_ERROR_RATE:
            notes.append(
                f"stopped at concurrency {concurrency}: {summary['error_rate'] * 100:.0f}% of "
                "its requests failed"
            )
            break
        points.append(
            LevelPoint(
                concurrency=concurrency,
                throughput=summary["throughput"]["output_tokens_per_s"],
                latency=summary["latency_s"]["p50"],
                running_max=observation.running_max if observation is not None else None,
            )
        )
        knee = find_knee(points, spec.threshold)
        if latency_ratio_reached(points, knee, spec.latency_factor):
            break
    recommendation = recommend(
        points,
        threshold=spec.threshold,
        latency_factor=spec.latency_factor,
        reference_throughput=spec.reference_throughput,
    )
    recommendation.notes[:0] = notes
    return SweepOutcome(levels, recommendation, metrics, notes)
