"""Flow control: *when* a request may proceed. Where it goes is the pinning algorithm's.

Pure: no clock, no I/O. Callers pass ``now`` (seconds, one clock for every call) and a `PoolView`
of the managed endpoints that would serve the request.

Vocabulary:

- a *band* has a priority and a saturation ceiling; bands are served in strict priority order;
- a *waiter* is one queued request; it belongs to a model (its pool), a band and a tenant;
- within a band, tenants take turns (round robin): a tenant with 1,000 queued requests holds one
  place in the rotation, not 1,000;
- a band *flows* while its pool's saturation, counting grants already made, is at most its
  ceiling and the pool has more free batch slots than the band's *headroom* keeps for the bands
  above it; otherwise it *waits*, and every lower band of that pool waits too (strict priority).
  A ceiling of 1.0 means "up to the healthy limit"; above 1, the band waits only past it;
- an *overflow* band does not wait when its pool is saturated: it runs on an unlimited provider.

Several admission instances: each holds its own queues and learns the others' waiting counts and
grants (see ``services/admission/flow.py``). `plan_dispatch` splits the headroom of a pool among
the instances in proportion to their waiters, rounding up, so all instances together grant at
most the headroom plus one request per other instance with waiters in that band, and no instance
with waiters is left out while the pool has headroom.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.core.saturation import (
    EndpointLoad,
    SaturationSettings,
    batch_slots,
    endpoint_saturation,
)

__all__ = [
    "BandPolicy",
    "FlowQueues",
    "GateDecision",
    "PoolView",
    "Waiter",
    "gate",
    "plan_dispatch",
]


class GateDecision(enum.StrEnum):
    """What flow control decided for one request (a metrics label)."""

    GRANTED = "granted"  # may run on the managed pool now
    QUEUED = "queued"  # waits for a dispatch tick
    OVERFLOW = "overflow"  # runs on an unlimited provider instead of waiting
    QUEUE_FULL = "queue_full"  # rejected at once: the band's queue is at capacity
    EXPIRED = "expired"  # rejected after waiting queue_ttl
    CANCELLED = "cancelled"  # the client left while queued


@dataclass(frozen=True, slots=True)
class BandPolicy:
    """``headroom``: batch slots per endpoint of the pool that this band leaves free for the
    bands above it (0: none). Engines do not preempt a running request for a more urgent one
    (vLLM V1, even under priority scheduling), so a band that fills every batch slot makes the
    next interactive request wait for one to free."""

    name: str
    priority: int
    ceiling: float
    overflow: bool = False
    headroom: int = 0


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request. ``token`` is the caller's handle (e.g. a future); never inspected."""

    request_id: str
    model: str
    band: str
    tenant: str
    enqueued_at: float
    token: Any = None
    done: bool = field(default=False, repr=False)


class PoolView:
    """The managed endpoints a model's requests would use, with their load, as of ``now``.

    ``inflight[e]`` is what endpoint e holds now: the gateway's live requests on it (every
    admission instance's) plus the engine's foreign load. `assume_grant` adds one request to the
    endpoint with the lowest score (an estimate of where placement would send it) and returns
    its id. Saturation is the mean endpoint saturation (llmgw.core.saturation.pool_saturation).
    Invariant: saturation never decreases as grants are assumed.

    An endpoint's *score*, lowest first, is the larger of its saturation and inflight / its batch
    capacity (``loads[e].capacity``): between endpoints that queue nothing, the one with more
    free room per unit of capacity wins.
    """

    def __init__(
        self,
        loads: Mapping[str, EndpointLoad],
        inflight: Mapping[str, int],
        now: float,
        settings: SaturationSettings,
    ) -> None:
        if not loads:
            raise ValueError("a pool view needs at least one endpoint")
        self._loads = dict(loads)
        self._inflight = {e: inflight.get(e, 0) for e in self._loads}
        self._now = now
        self._settings = settings
        self._saturation = {e: self._endpoint(e) for e in self._loads}

    def _endpoint(self, endpoint_id: str) -> float:
        return endpoint_saturation(
            self._loads[endpoint_id], self._now, self._settings, self._inflight[endpoint_id]
        )

    def saturation(self) -> float:
        return math.fsum(self._saturation.values()) / len(self._saturation)

    def endpoint_saturation(self, endpoint_id: str) -> float:
        return self._saturation[endpoint_id]

    def inflight(self, endpoint_id: str) -> int:
        return self._inflight[endpoint_id]

    def capacity(self, endpoint_id: str) -> int:
        return max(1, self._loads[endpoint_id].capacity)

    def score(self, endpoint_id: str) -> float:
        return max(
            self._saturation[endpoint_id], self._inflight[endpoint_id] / self.capacity(endpoint_id)
        )

    def least_saturated(self, among: Iterable[str] | None = None) -> str | None:
        """The endpoint with the lowest score (ties: first in the order given or loaded)."""
        candidates = [e for e in (among if among is not None else self._loads) if e in self._loads]
        if not candidates:
            return None
        return min(candidates, key=self.score)

    def free_slots(self) -> int:
        """Batch slots free over the pool: sum of max(0, slots - inflight), an endpoint's slots
        being its `batch_slots` (its capacity; twice a learned one while its engine reports
        none waiting)."""
        return sum(
            max(0, batch_slots(self._loads[e], self._now, self._settings) - self._inflight[e])
            for e in self._loads
        )

    def holds_back(self, band: BandPolicy) -> bool:
        """Is the pool past what `band` may use: saturation above its ceiling, or no more free
        batch slots than its headroom keeps for the bands above it?"""
        if self.saturation() > band.ceiling:
            return True
        return band.headroom > 0 and self.free_slots() <= band.headroom * len(self._loads)

    def full_for(self, band: BandPolicy) -> bool:
        """Would one more grant take the pool past `band`'s ceiling (or its headroom)? What
        the dispatch tick checks before each grant, asked without assuming it."""
        if self.holds_back(band):
            return True
        endpoint_id = self.least_saturated()
        assert endpoint_id is not None  # the pool is never empty
        self._inflight[endpoint_id] += 1
        try:
            after = self._endpoint(endpoint_id)
        finally:
            self._inflight[endpoint_id] -= 1
        total = math.fsum(self._saturation.values()) - self._saturation[endpoint_id] + after
        return total / len(self._saturation) > band.ceiling

    def assume_grant(self) -> str:
        endpoint_id = self.least_saturated()
        assert endpoint_id is not None  # the pool is never empty
        self._inflight[endpoint_id] += 1
        self._saturation[endpoint_id] = self._endpoint(endpoint_id)
        return endpoint_id


def gate(band: BandPolicy, pool: PoolView | None, waiting_at_or_above: int) -> GateDecision:
    """The decision for a request that just arrived (before any queueing).

    ``waiting_at_or_above``: requests of the same pool already waiting, in any instance, in this
    band or a higher one; they go first (FIFO within the rotation, strict priority across bands).
    ``pool`` None: the model has no healthy managed endpoint, so nothing of ours to protect.
    Work conservation: with no one ahead, saturation within the ceiling and free slots beyond
    the band's headroom, it never waits.
    """
    if pool is None:
        return GateDecision.GRANTED
    saturated = pool.holds_back(band)
    if saturated and band.overflow:
        return GateDecision.OVERFLOW
    if band.overflow and waiting_at_or_above > 0 and pool.full_for(band):
        # Others wait ahead (requests that may not overflow: an overflow budget used up, or a
        # higher band) and the pool has no room for one more: an overflow band does not wait.
        return GateDecision.OVERFLOW
    if waiting_at_or_above == 0 and not saturated:
        return GateDecision.GRANTED
    return GateDecision.QUEUED


def plan_dispatch(
    bands: Sequence[BandPolicy],
    pool: PoolView | None,
    local: Mapping[str, int],
    remote: Mapping[str, int],
) -> dict[str, int]:
    """How many waiters of each band this instance dispatches now from one pool's queues.

    ``bands`` in priority order, highest first; ``local``/``remote``: waiters per band here and in
    the other instances. Walks bands in order, assuming grants on ``pool`` while its saturation is
    within the band's ceiling; this instance's quota of the band's grants is its share of the
    band's waiters, rounded up. A band that cannot dispatch all of its waiters (anywhere) stops
    every lower band. ``pool`` None: everything may go.

    Guarantees: quota[b] <= local[b]; the sum over instances of quota[b] <= grants[b] + (number
    of other instances with waiters in b); no lower band gets a quota once a band is held back.
    """
    quota: dict[str, int] = {}
    for band in bands:
        mine = local.get(band.name, 0)
        total = mine + remote.get(band.name, 0)
        if total == 0:
            continue
        if pool is None:
            quota[band.name] = mine
            continue
        grants = 0
        while grants < total and not pool.holds_back(band):
            pool.assume_grant()
            grants += 1
        if mine and grants:
            quota[band.name] = min(mine, math.ceil(grants * mine / total))
        if grants < total:
            break
    return quota


class FlowQueues:
    """Bounded per-band queues of one instance, keyed by model, with tenant round robin.

    Invariants: `depth(band)` counts live waiters of the band over all models and a new waiter
    is refused once it reaches ``capacity_per_band`` (only a waiter put back `first` may pass
    it); a waiter leaves exactly once per time it was offered (taken, cancelled or expired),
    after which its ``done`` is True; within a (model, band), tenants are served in rotation and
    each tenant's waiters in arrival order, a waiter put back `first` ahead of them.
    """

    def __init__(self, bands: Sequence[BandPolicy], capacity_per_band: int, ttl: float) -> None:
        if capacity_per_band < 1:
            raise ValueError("capacity_per_band must be >= 1")
        if not ttl > 0:
            raise ValueError("ttl must be > 0")
        self.bands = sorted(bands, key=lambda b: -b.priority)
        self._band = {b.name: b for b in self.bands}
        self.capacity_per_band = capacity_per_band
        self.ttl = ttl
        # (model, band) -> tenant -> that tenant's waiters, in rotation order.
        self._rotation: dict[tuple[str, str], OrderedDict[str, deque[Waiter]]] = {}
        self._count: dict[tuple[str, str], int] = {}
        self._depth: dict[str, int] = {b.name: 0 for b in self.bands}
        self._by_id: dict[str, Waiter] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []  # heap by enqueue time
        self._sequence = 0

    def band(self, name: str) -> BandPolicy | None:
        return self._band.get(name)

    def reband(self, bands: Sequence[BandPolicy]) -> list[Waiter]:
        """Run on a new band table (an applied config): bands kept keep their waiters in their
        places, under the new policy; new bands start empty; the waiters of a removed band
        leave the queues and are returned, oldest first, for the caller to answer. A band over
        its capacity keeps its waiters (it takes no more until it is under again)."""
        self.bands = sorted(bands, key=lambda b: -b.priority)
        self._band = {b.name: b for b in self.bands}
        gone = [w for w in self._by_id.values() if w.band not in self._band]
        gone.sort(key=lambda w: w.enqueued_at)
        for waiter in gone:
            self._leave(waiter)
        for key in [k for k in self._rotation if k[1] not in self._band]:
            del self._rotation[key]
        self._depth = {b.name: self._depth.get(b.name, 0) for b in self.bands}
        return gone

    def resize(self, capacity_per_band: int, ttl: float) -> None:
        """New bounds (an applied config): a band over its new capacity keeps its waiters and
        takes no more until it is under again; every waiter, queued before or after, expires
        `ttl` after its ``enqueued_at`` (a shorter ttl expires the overdue at the next
        `expire`)."""
        if capacity_per_band < 1:
            raise ValueError("capacity_per_band must be >= 1")
        if not ttl > 0:
            raise ValueError("ttl must be > 0")
        self.capacity_per_band = capacity_per_band
        self.ttl = ttl

    def depth(self, band: str) -> int:
        return self._depth[band]

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def waiting(self, model: str) -> dict[str, int]:
        """Live waiters of a model per band (bands with none are left out)."""
        return {b.name: n for b in self.bands if (n := self._count.get((model, b.name), 0))}

    def models(self) -> list[str]:
        """Models with waiters."""
        return sorted({model for (model, _), n in self._count.items() if n})

    def offer(self, waiter: Waiter, *, first: bool = False) -> bool:
        """Queue a waiter; False (and nothing queued) when its band is full. `first`: a waiter
        taken earlier goes back where it was taken from, at the head of its tenant's queue and
        its tenant first in the rotation, whatever the band's depth (it was counted in it); it
        still expires `ttl` after its ``enqueued_at``."""
        if waiter.band not in self._band:
            raise ValueError(f"unknown band {waiter.band!r}")
        if waiter.request_id in self._by_id:
            raise ValueError(f"request {waiter.request_id!r} is already queued")
        if not first and self._depth[waiter.band] >= self.capacity_per_band:
            return False
        waiter.done = False
        key = (waiter.model, waiter.band)
        tenants = self._rotation.setdefault(key, OrderedDict())
        if first:
            tenants.setdefault(waiter.tenant, deque()).appendleft(waiter)
            tenants.move_to_end(waiter.tenant, last=False)
        else:
            tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self._count[key] = self._count.get(key, 0) + 1
        self._depth[waiter.band] += 1
        self._by_id[waiter.request_id] = waiter
        self._sequence += 1
        heapq.heappush(self._deadlines, (waiter.enqueued_at, self._sequence, waiter))
        return True

    def _leave(self, waiter: Waiter) -> None:
        waiter.done = True
        key = (waiter.model, waiter.band)
        self._count[key] -= 1
        if not self._count[key]:
            del self._count[key]
        self._depth[waiter.band] -= 1
        del self._by_id[waiter.request_id]

    def take(self, model: str, band: str) -> Waiter | None:
        """The next waiter of (model, band) in tenant rotation, or None."""
        key = (model, band)
        tenants = self._rotation.get(key)
        while tenants:
            tenant, queue = next(iter(tenants.items()))
            while queue and queue[0].done:
                queue.popleft()
            if not queue:
                del tenants[tenant]
                continue
            waiter = queue.popleft()
            # The tenant goes to the back of the rotation (or leaves it when it has no more).
            if any(not w.done for w in queue):
                tenants.move_to_end(tenant)
            else:
                del tenants[tenant]
            self._leave(waiter)
            return waiter
        if tenants is not None:
            del self._rotation[key]
        return None

    def take_matching(
        self, model: str, band: str, wanted: Callable[[Waiter], bool]
    ) -> list[Waiter]:
        """Remove and return every live waiter of (model, band) that `wanted` accepts, in
        rotation order; the others keep their places."""
        taken = []
        for queue in self._rotation.get((model, band), {}).values():
            for waiter in queue:
                if not waiter.done and wanted(waiter):
                    self._leave(waiter)
                    taken.append(waiter)
        return taken

    def cancel(self, request_id: str) -> Waiter | None:
        """Remove a queued waiter (its client left); None if it is not queued here."""
        waiter = self._by_id.get(request_id)
        if waiter is None:
            return None
        self._leave(waiter)
        return waiter

    def expire(self, now: float) -> Iterator[Waiter]:
        """Remove and yield the waiters that have waited ``ttl`` or longer, oldest first."""
        while self._deadlines and self._deadlines[0][0] + self.ttl <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if not waiter.done:
                self._leave(waiter)
                yield waiter
