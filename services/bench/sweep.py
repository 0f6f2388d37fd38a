"""Saturation sweep analysis (pure): the knee, and what to configure from it.

A sweep measures one engine at increasing fixed concurrencies c_0 < c_1 < ... and records, per
level, the throughput X (output tokens/s) and the median latency L.

**Knee.** Level k is the knee when going to the next level does not pay: throughput grows by
less than ``threshold`` times the relative concurrency increase,
``X[k+1] < X[k] * (1 + threshold * (c[k+1] / c[k] - 1))`` (with doubling levels and the default
0.1: less than 10% more throughput for twice the load), while latency still rises,
``L[k+1] > L[k]``. The first such level is the knee: the least load that gets (nearly) the
plateau's throughput.

**Running at the knee, R.** With engine metrics, the engine's observed batch capacity (the
high-water mark of ``vllm:num_requests_running`` over the sweep) capped at the knee's
concurrency; without, the knee's concurrency (client-side only: all of it is assumed running,
none queued). When the observed capacity exceeds the knee's concurrency the engine batched the
extra load past the knee rather than queueing it (a note says so).

**target_waiting.** Beyond the knee, the extra concurrency c - R queues at the engine. Latency
relative to the knee's, L / L[k], is interpolated linearly against that queue depth q = c - R
(starting at the knee itself, ratio 1); ``target_waiting`` is the depth where the ratio reaches
``latency_factor``, rounded, at least 1. That is the queue the saturation detector may consider
"full" (saturation 1.0) while requests still finish within that factor of the best latency.
When the ratio never reaches the factor, the deepest measured queue is a lower bound.

**weight.** ``round(100 * X[k] / reference)``, at least 1, with ``reference`` the operator's
reference throughput (the knee throughput of the endpoint that should weigh 100), or X[k]
itself (then 100).

Invariants: `find_knee` returns an index of a level that has a successor, or None; the
recommended ``target_waiting`` is >= 1 and ``weight`` >= 1 whenever a knee exists.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_LATENCY_FACTOR",
    "DEFAULT_THRESHOLD",
    "LevelPoint",
    "Recommendation",
    "doubling_levels",
    "find_knee",
    "latency_ratio_reached",
    "recommend",
]

DEFAULT_THRESHOLD = 0.1
DEFAULT_LATENCY_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class LevelPoint:
    """One sweep level: its concurrency, throughput (output tokens/s), median latency (s).

    ``running_max``: the engine's ``num_requests_running`` high-water mark during the level
    (None without engine metrics).
    """

    concurrency: int
    throughput: float
    latency: float
    running_max: int | None = None


@dataclass(frozen=True, slots=True)
class Recommendation:
    """What the sweep suggests. Fields are None when no knee was found (see `notes`).

    ``knee_running`` is R (``capacity_source`` says whether from metrics or the client);
    ``batch_capacity`` the running high-water mark over the sweep (None without metrics).
    """

    knee_index: int | None
    knee_concurrency: int | None
    knee_running: int | None
    batch_capacity: int | None
    capacity_source: str
    target_waiting: int | None
    weight: int | None
    knee_throughput: float | None
    reference_throughput: float | None
    latency_factor: float
    notes: list[str] = field(default_factory=list)


def doubling_levels(low: int, high: int) -> list[int]:
    """low, 2*low, 4*low, ... up to and including high (high is always the last level)."""
    if low < 1 or high < low:
        raise ValueError(f"need 1 <= low <= high, got {low}..{high}")
    levels = []
    level = low
    while level < high:
        levels.append(level)
        level *= 2
    levels.append(high)
    return levels


def find_knee(points: Sequence[LevelPoint], threshold: float = DEFAULT_THRESHOLD) -> int | None:
    """Index of the knee level (see the module docstring), or None if the curve never flattens."""
    for k in range(len(points) - 1):
        a, b = points[k], points[k + 1]
        if b.concurrency <= a.concurrency:
            raise ValueError("levels must have increasing concurrency")
        needed = a.throughput * (1 + threshold * (b.concurrency / a.concurrency - 1))
        if b.throughput < needed and b.latency > a.latency:
            return k
    return None


def knee_running(points: Sequence[LevelPoint], knee: int) -> tuple[int, str]:
    """(R, its source): min(running high-water mark, knee concurrency), else the concurrency."""
    capacity = observed_capacity(points)
    if capacity is not None:
        return min(capacity, points[knee].concurrency), "metrics"
    return points[knee].concurrency, "client"


def observed_capacity(points: Sequence[LevelPoint]) -> int | None:
    """The most requests the engine was seen running at once, None without metrics."""
    seen = [p.running_max for p in points if p.running_max is not None and p.running_max > 0]
    return max(seen) if seen else None


def _queue_curve(
    points: Sequence[LevelPoint], knee: int, running: int
) -> list[tuple[float, float]]:
    """(queue depth, latency / knee latency) from the knee on; depths strictly increase."""
    base = points[knee].latency
    curve = [(float(max(0, points[knee].concurrency - running)), 1.0)]
    for point in points[knee + 1 :]:
        depth = float(point.concurrency - running)
        if depth > curve[-1][0] and base > 0:
            curve.append((depth, point.latency / base))
    return curve


def latency_ratio_reached(
    points: Sequence[LevelPoint], knee: int | None, factor: float = DEFAULT_LATENCY_FACTOR
) -> bool:
    """Whether some level beyond the knee has latency >= factor x the knee's (a sweep may stop)."""
    if knee is None or points[knee].latency <= 0:
        return False
    return any(p.latency >= factor * points[knee].latency for p in points[knee + 1 :])


def recommend(
    points: Sequence[LevelPoint],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    latency_factor: float = DEFAULT_LATENCY_FACTOR,
    reference_throughput: float | None = None,
) -> Recommendation:
    """The knee, the batch capacity, ``target_waiting`` and ``weight`` (module docstring)."""
    if latency_factor <= 1:
        raise ValueError(f"latency_factor must be > 1, got {latency_factor}")
    if reference_throughput is not None and not reference_throughput > 0:
        raise ValueError(f"reference throughput must be > 0, got {reference_throughput}")
    knee = find_knee(points, threshold)
    if knee is None:
        last = points[-1].concurrency if points else 0
        capacity = observed_capacity(points)
        return Recommendation(
            knee_index=None,
            knee_concurrency=None,
            knee_running=None,
            batch_capacity=capacity,
            capacity_source="metrics" if capacity is not None else "none",
            target_waiting=None,
            weight=None,
            knee_throughput=None,
            reference_throughput=reference_throughput,
            latency_factor=latency_factor,
            notes=[
                f"no knee: throughput still grew at every level up to concurrency {last}; "
                "sweep higher (--max-concurrency)"
            ],
        )
    running, source = knee_running(points, knee)
    capacity = observed_capacity(points)
    notes = []
    if capacity is not None and capacity > points[knee].concurrency:
        notes.append(
            f"the engine ran up to {capacity} requests at once, more than the knee's "
            f"concurrency {points[knee].concurrency}: past the knee it batched extra load instead of queueing it, so its waiting "
            "count stays low and llmgw sees that load as in flight; scoring.target_inflight "
            f"near {points[knee].concurrency} describes this endpoint better than target_waiting"
        )
    curve = _queue_curve(points, knee, running)
    target = None
    for (d0, r0), (d1, r1) in itertools.pairwise(curve):
        if r1 >= latency_factor:
            depth = d0 + (d1 - d0) * (latency_factor - r0) / (r1 - r0) if r1 > r0 else d1
            target = max(1, round(depth))
            break
    if target is None:
        deepest = curve[-1][0]
        target = max(1, round(deepest))
        notes.append(
            f"latency stayed below {latency_factor:g}x the knee's up to a queue of "
            f"{deepest:g}; target_waiting is at least {target} (sweep higher to pin it down)"
        )
    knee_throughput = points[knee].throughput
    reference = reference_throughput if reference_throughput is not None else knee_throughput
    weight = max(1, round(100 * knee_throughput / reference)) if reference > 0 else None
    return Recommendation(
        knee_index=knee,
        knee_concurrency=points[knee].concurrency,
        knee_running=running,
        batch_capacity=capacity,
        capacity_source=source,
        target_waiting=target,
        weight=weight,
        knee_throughput=knee_throughput,
        reference_throughput=reference_throughput,
        latency_factor=latency_factor,
        notes=notes,
    )
