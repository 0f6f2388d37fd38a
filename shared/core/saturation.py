"""Saturation detector: one number per pool, the worse of queue depth and KV occupancy.

Pure: the caller passes scraped `EngineSample`s, the router's inflight counts and ``now`` (seconds
on any monotonic clock, the same one for every call). Admission compares the pool's number with
each band's ceiling; 1.0 means "at the healthy limit".

Per endpoint:

- batch capacity is not in the engine metric contract, so it is *learned* as the high-water mark
  of observed ``running``; it only grows;
- queue = max(engine ``waiting``, inflight - capacity). Engine metrics lag a scrape interval while
  router inflight does not, but inflight also counts running requests; only what exceeds the
  batch capacity is queued. The caller's inflight must include its own outstanding grants that no
  engine or router has seen yet, or a simultaneous burst passes the check en masse;
- saturation = max(queue / target_waiting, kv_usage / kv_ceiling), since either alone misleads.

Staleness: an endpoint never sampled, or sampled more than ``stale_after`` ago, is scored down,
never dropped (if the whole pool went stale there would be nowhere left to send anything). It
counts as saturated: max(`STALE_SATURATION`, what its last sample and current inflight give).
With 1.0 the bands whose ceiling is below 1 wait, a band with a ceiling above 1 still flows, and
staleness never makes an endpoint look better than its last reading.

Pool saturation is the mean over the pool's endpoints (as the Gateway API Inference Extension
does): the scheduler routes around a single hot endpoint, so one busy endpoint should not hold
back the whole pool, while a pool that is busy on average should.

Cold start: until an endpoint has been seen running anything, its capacity is 0 and all of its
inflight counts as queued. That is deliberately conservative and lasts one scrape interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.core.engine_metrics import EngineSample

__all__ = [
    "STALE_SATURATION",
    "EndpointLoad",
    "SaturationSettings",
    "endpoint_saturation",
    "is_stale",
    "pool_saturation",
    "update",
]

STALE_SATURATION = 1.0
"""The least saturation a stale endpoint scores: exactly at the healthy limit."""


@dataclass(frozen=True, slots=True)
class SaturationSettings:
    """What saturation is normalised against (config ``router.scoring`` / ``router.stale_after``).

    ``target_waiting`` > 0 requests; ``0 < kv_ceiling <= 1`` (a fraction of the KV cache);
    ``stale_after`` > 0 seconds. All finite; violations raise ValueError naming the field.
    """

    target_waiting: float
    kv_ceiling: float
    stale_after: float

    def __post_init__(self) -> None:
        for field_name in ("target_waiting", "kv_ceiling", "stale_after"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field_name} must be a finite number > 0, got {value}")
        if self.kv_ceiling > 1:
            raise ValueError(
                f"kv_ceiling must be <= 1 (a fraction of the cache), got {self.kv_ceiling}"
            )


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """What is known about one endpoint's load. A fresh `EndpointLoad()` has never been sampled.

    Invariants: ``capacity`` >= every ``running`` ever passed to `update` (and >= 0);
    ``sample`` and ``sampled_at`` are both None or both set.
    """

    capacity: int = 0
    sample: EngineSample | None = None
    sampled_at: float | None = None


def update(load: EndpointLoad, sample: EngineSample, now: float) -> EndpointLoad:
    """The load after a scrape taken at ``now``.

    A sample older than the one held (a late scrape reply) still teaches capacity, since the
    running count it saw was real, but does not replace the newer sample.
    """
    capacity = max(load.capacity, sample.running)
    if load.sampled_at is not None and now < load.sampled_at:
        return EndpointLoad(capacity, load.sample, load.sampled_at)
    return EndpointLoad(capacity, sample, now)


def is_stale(load: EndpointLoad, now: float, settings: SaturationSettings) -> bool:
    """Never sampled, or the last sample is more than ``stale_after`` old."""
    return load.sampled_at is None or now - load.sampled_at > settings.stale_after


def endpoint_saturation(
    load: EndpointLoad, now: float, settings: SaturationSettings, inflight: int = 0
) -> float:
    """max(queue / target_waiting, kv / kv_ceiling); at least `STALE_SATURATION` when stale.

    ``inflight``: requests the router has dispatched to this endpoint and not seen finish, plus
    grants admission has issued for it that are not dispatched yet.
    """
    if inflight < 0:
        raise ValueError(f"inflight must be >= 0, got {inflight}")
    waiting = load.sample.waiting if load.sample is not None else 0
    kv_usage = load.sample.kv_usage if load.sample is not None else 0.0
    queue = max(waiting, inflight - load.capacity)
    saturation = max(queue / settings.target_waiting, kv_usage / settings.kv_ceiling)
    if is_stale(load, now, settings):
        return max(STALE_SATURATION, saturation)
    return saturation


def pool_saturation(
    loads: Mapping[str, EndpointLoad],
    now: float,
    settings: SaturationSettings,
    inflight: Mapping[str, int] | None = None,
) -> float:
    """Mean `endpoint_saturation` over the pool's endpoints, keyed by endpoint id.

    ``inflight`` maps endpoint id to its inflight count (see `endpoint_saturation`); an absent id
    counts 0. Raises ValueError for an empty pool: it has no capacity at all, and what to do then
    is the caller's decision, not a number.
    """
    if not loads:
        raise ValueError("pool has no endpoints")
    inflight = inflight or {}
    total = math.fsum(
        endpoint_saturation(load, now, settings, inflight.get(endpoint_id, 0))
        for endpoint_id, load in loads.items()
    )
    return total / len(loads)
