"""Saturation detector: one number per pool, the worse of queue depth and KV occupancy.

Pure: the caller passes scraped `EngineSample`s, the router's inflight counts and ``now`` (seconds
on any monotonic clock, the same one for every call). Admission compares the pool's number with
each band's ceiling; 1.0 means "at the healthy limit".

Per endpoint:

- batch capacity (how many requests run at once) is *stated* or *learned*. Stated: the operator
  configured it (``endpoints[].capacity``, a simulated engine's ``max_num_seqs``) or the engine
  says it (`state`: SGLang's, TGI's, llama.cpp's own figure, read by the scraper). Learned:
  nobody said, so it starts from a default (``scoring.target_inflight``) and is raised by
  evidence (`update`): the high-water mark of the ``running`` the engine reported, and of the
  gateway's own count of requests on it at a scrape whose reading showed none waiting (the
  engine ran all of them at once). It never starts at 0, so a cold engine with free slots does
  not look full;
- inflight is the caller's count of requests on the endpoint now: the gateway's own exact
  accounting (grants not yet ended, by every admission instance) plus the engine's foreign load
  (requests the engine reports that the gateway did not send). Only what exceeds the batch
  slots is queued: queue = max(0, inflight - slots). The engine's reading is a scrape old, so
  its ``waiting`` is not counted as such (a queue that has drained since would stay counted until
  the next scrape: phantom load); it says how many the engine runs at once: while it reported
  waiting requests, its slots are min(capacity, running) (it was holding requests back, e.g.
  for KV blocks), otherwise its capacity. Without a running gauge, queue = max(min(waiting,
  inflight), inflight - capacity);
- while the engine's fresh reading shows *no request waiting* and its capacity is only learned,
  nothing counts as queued: a learned capacity is a lower bound (requests that start and end
  between two scrapes never show in ``running``), so a count above it is no evidence of a queue,
  and the engine says there is none. The next reading tells: still none waiting (the gateway's
  count at that scrape raises the learned capacity), or some (its slots are then what it runs).
  A stated capacity is trusted: a count above it is requests the engine holds back;
- saturation = max(queue / target_waiting, kv_usage / kv_ceiling), since either alone misleads.

`batch_slots` is the number of free-slot arithmetic (a band's batch headroom): the capacity, but
for a learned capacity while the engine reports none waiting `PROBE_FACTOR` times it: a band
that keeps headroom may go past what was seen, and the next reading raises the capacity again
(it doubles per scrape while the engine keeps up, as TCP's slow start probes a path).

Engines that report only some of the gauges (no KV usage, no waiting count) or none (an
OpenAI-compatible server without engine metrics) are scored on what there is: a missing gauge
counts 0, and inflight against capacity carries the rest (without a waiting gauge there is no
evidence of "none waiting", so a learned capacity is held to). Such an endpoint is never stale
because of its metrics. Neither is one whose metrics cannot be read (a timeout, an HTTP error, a
malformed exposition) while it is reported on: a report without a sample drops the reading held
(`update`), so from that report on the endpoint is scored as one without engine metrics, on the
gateway's own accounting against its capacity (learned capacity is kept), never as saturated.

Staleness: an endpoint with no report at all for ``stale_after`` (the scraper is not reaching it,
or not running) is scored down, never dropped (if the whole pool went stale there would be
nowhere left to send anything). It counts as saturated: max(`STALE_SATURATION`, what its last
reading and current inflight give). With 1.0 the bands whose ceiling is below 1 wait, a band
with a ceiling above 1 still flows, and staleness never makes an endpoint look better than its
last reading. Staleness is about reports, not metrics: it means nobody is watching the
endpoint, not that the engine's metrics are missing.

Pool saturation is the mean over the pool's endpoints (as the Gateway API Inference Extension
does): the scheduler routes around a single hot endpoint, so one busy endpoint should not hold
back the whole pool, while a pool that is busy on average should.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.core.engine_metrics import EngineSample

__all__ = [
    "PROBE_FACTOR",
    "STALE_SATURATION",
    "EndpointLoad",
    "SaturationSettings",
    "batch_slots",
    "endpoint_saturation",
    "fresh_sample",
    "is_stale",
    "none_waiting",
    "pool_saturation",
    "state",
    "update",
]

STALE_SATURATION = 1.0
"""The least saturation a stale endpoint scores: exactly at the healthy limit."""

PROBE_FACTOR = 2
"""`batch_slots` of a learned capacity while the engine reports none waiting: this many times
it (free-slot arithmetic may go past what was seen; the next reading raises the capacity)."""


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
    """What is known about one endpoint's load. A fresh `EndpointLoad(capacity)` has never been
    reported.

    ``stated``: the capacity was stated (configured, or said by the engine: `state`), so a count
    above it is queue; otherwise it is learned, a lower bound.

    Invariants: ``capacity`` >= every ``running`` ever passed to `update` (and >= 0), and, when
    not stated, >= every gateway count passed with a sample that showed none waiting;
    ``sample`` and ``sampled_at`` are both None or both set; ``reported_at`` >= ``sampled_at``.
    """

    capacity: int = 0
    sample: EngineSample | None = None
    sampled_at: float | None = None
    reported_at: float | None = None
    stated: bool = False

    def __post_init__(self) -> None:
        if self.sampled_at is not None and (
            self.reported_at is None or self.reported_at < self.sampled_at
        ):
            object.__setattr__(self, "reported_at", self.sampled_at)  # a sample is a report


def none_waiting(sample: EngineSample | None) -> bool:
    """The engine reported its waiting count, and it was 0."""
    return sample is not None and sample.waiting == 0


def update(
    load: EndpointLoad, sample: EngineSample | None, now: float, gateway: int | None = None
) -> EndpointLoad:
    """The load after a report made at ``now`` (with the engine's sample, if it had one).

    ``gateway``: the requests the gateway itself had on the endpoint when the sample was taken
    (None: not counted, e.g. by the scraper). When the sample shows none waiting, the engine ran
    all of them at once, so a learned capacity rises to it (a stated one stays as stated).

    A report older than the latest one (a late scrape reply, another scraper's) still teaches
    capacity, since the running count it saw was real, but changes nothing else. A report
    without a sample (no load gauges, or metrics that could not be read) drops the sample held:
    the engine's last reading is no evidence of its load now, and the endpoint falls back to the
    gateway's own accounting. Capacity is kept.
    """
    if gateway is not None and gateway < 0:
        raise ValueError(f"gateway must be >= 0, got {gateway}")
    running = sample.running if sample is not None and sample.running is not None else 0
    capacity = max(load.capacity, running)
    if gateway is not None and not load.stated and none_waiting(sample):
        capacity = max(capacity, gateway)
    stated = load.stated
    if load.reported_at is not None and now < load.reported_at:
        return EndpointLoad(capacity, load.sample, load.sampled_at, load.reported_at, stated)
    if sample is None:
        return EndpointLoad(capacity, None, None, now, stated)
    return EndpointLoad(capacity, sample, now, now, stated)


def state(load: EndpointLoad, capacity: int) -> EndpointLoad:
    """The load once its batch capacity is stated as ``capacity`` (>= 1): it replaces what was
    assumed or learned (a default may be above an engine's few slots), and from then on a
    count above it is queue. Readings and their times are kept."""
    if capacity < 1:
        raise ValueError(f"a stated capacity must be >= 1, got {capacity}")
    return EndpointLoad(capacity, load.sample, load.sampled_at, load.reported_at, stated=True)


def is_stale(load: EndpointLoad, now: float, settings: SaturationSettings) -> bool:
    """Never reported, or the last report is more than ``stale_after`` old."""
    return load.reported_at is None or now - load.reported_at > settings.stale_after


def fresh_sample(
    load: EndpointLoad, now: float, settings: SaturationSettings
) -> EngineSample | None:
    """The engine's last sample if it is at most ``stale_after`` old."""
    if load.sample is None or load.sampled_at is None:
        return None
    return load.sample if now - load.sampled_at <= settings.stale_after else None


def endpoint_saturation(
    load: EndpointLoad, now: float, settings: SaturationSettings, inflight: int | None = None
) -> float:
    """max(queue / target_waiting, kv / kv_ceiling); at least `STALE_SATURATION` when stale.

    ``inflight``: requests on this endpoint now (the gateway's own accounting, including grants
    not dispatched yet, plus the engine's foreign load); the engine's ``waiting`` never counts
    for more than that (the reading lags). None: the caller has no count of its own (the
    scraper), so the engine's own running + waiting is the inflight.
    """
    if inflight is not None and inflight < 0:
        raise ValueError(f"inflight must be >= 0, got {inflight}")
    stale = is_stale(load, now, settings)
    # A stale endpoint keeps its last reading as a floor (never better than last seen); one
    # that is reported on but whose metrics stopped ignores readings older than stale_after.
    sample = load.sample if stale else fresh_sample(load, now, settings)
    waiting = sample.waiting if sample is not None and sample.waiting is not None else 0
    kv_usage = sample.kv_usage if sample is not None and sample.kv_usage is not None else 0.0
    running = sample.running if sample is not None else None
    if inflight is None:
        inflight = (running or 0) + waiting
        queue = max(waiting, inflight - load.capacity)
    elif not stale and not load.stated and none_waiting(sample):
        # A learned capacity is a lower bound and the engine says nothing waits: a count above
        # the capacity is no evidence of a queue (the next reading tells).
        queue = 0
    elif running is not None:
        # The reading is as old as the scrape, the count is now: the reading only says how many
        # the engine runs at once (fewer than its slots while it holds requests back, e.g. for
        # KV blocks), and the count says how many are there to run.
        slots = min(load.capacity, running) if waiting > 0 else load.capacity
        queue = max(0, inflight - slots)
    else:
        queue = max(min(waiting, inflight), inflight - load.capacity)
    saturation = max(queue / settings.target_waiting, kv_usage / settings.kv_ceiling)
    if stale:
        return max(STALE_SATURATION, saturation)
    return saturation


def batch_slots(load: EndpointLoad, now: float, settings: SaturationSettings) -> int:
    """How many requests the endpoint runs at once as far as free-slot arithmetic goes (>= 1):
    `PROBE_FACTOR` times a learned capacity while its fresh reading shows none waiting, else
    the capacity."""
    capacity = max(1, load.capacity)
    if not load.stated and none_waiting(fresh_sample(load, now, settings)):
        return PROBE_FACTOR * capacity
    return capacity


def pool_saturation(
    loads: Mapping[str, EndpointLoad],
    now: float,
    settings: SaturationSettings,
    inflight: Mapping[str, int] | None = None,
) -> float:
    """Mean `endpoint_saturation` over the pool's endpoints, keyed by endpoint id.

    ``inflight`` maps endpoint id to its inflight count (see `endpoint_saturation`); an absent id
    has none of the caller's (the engine's own numbers count). Raises ValueError for an empty pool: it has no capacity at all, and what to do then
    is the caller's decision, not a number.
    """
    if not loads:
        raise ValueError("pool has no endpoints")
    inflight = inflight or {}
    total = math.fsum(
        endpoint_saturation(load, now, settings, inflight.get(endpoint_id))
        for endpoint_id, load in loads.items()
    )
    return total / len(loads)
