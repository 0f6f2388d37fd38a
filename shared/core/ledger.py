"""What one admission instance owns, in memory: its shards' pins and leases, and its quotas.

The ledger is the state machine behind memory-speed admission (docs/adr/0002-admission-at-
memory-speed.md). Every method is synchronous and does no I/O, so on one event loop each one is
atomic: a decision read from the ledger and applied to it cannot interleave with another.

Ownership, at each step of a lease's life:

- `grant` creates a lease; from the reply on, the *edge* runs the request and renews the lease
  (`renew`), and the ledger *accounts* it against this instance's quota of the pair;
- it ends exactly once: `release` (the edge's end-of-request message), `renew` finding it
  missing from the edge's complete list, `expire` (not renewed within ``lease_timeout``: its
  edge died or was cut off), or `take_shard` (the shard moved to another instance with it);
- a lease always belongs to the shard its request was decided in, and a shard's leases live in
  exactly one ledger, the shard owner's.

Invariants (checked after every operation by the property tests, and across instances by
`llmgw.state.checker` over the observer's audit trail):

- per pair with limits: live leases <= g, live unreserved leases <= u, pins <= p of this
  instance's quota (`Quota`); the unreserved leases are the new-pin and temporary ones, so
  across instances new sessions hold at most G - R (the book's Σu) and pinned sessions may use
  any lease quota an instance holds. That is the reserve R as one instance holding the whole
  limit keeps it (new <= G - R and new + pinned <= G), without splitting R into per-instance
  parts: a pinned session whose instance used up "its" g - u does not eat into the unreserved
  quota while another instance's share of the reserve is idle;
- per pin of a pair with limits: its listed leases <= S (max_per_session_in_flight_request_slots);
- per API key with `max_parallel_requests` (`set_key_limit`): its live leases <= g of this
  instance's quota of the key's pair (`llmgw.core.apikeys.key_pair`), so across instances the
  key's requests in flight never exceed its limit;
- one pin per (model, session); a pin listing a lease never expires or is evicted;
- every lease and pin is indexed under exactly one shard.

Quotas are never lowered below use (the quota keeper's rule); `add_shard` takes in only what
the quota covers and returns the rest.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from llmgw.core.apikeys import KeyLimits, key_pair
from llmgw.core.quota import NO_COUNTS, NO_QUOTA, PairLimits, Quota, QuotaCounts
from llmgw.core.records import record

K = TypeVar("K")

__all__ = [
    "CapacityError",
    "EndReason",
    "LeaseKind",
    "LeaseRecord",
    "Ledger",
    "LedgerObserver",
    "PairUse",
    "PinRecord",
    "Room",
    "ShardState",
]

Pair = tuple[str, str]  # (provider, model)
SessionKey = tuple[str, str]  # (model, session)


class LeaseKind(enum.StrEnum):
    """Why a lease exists (on its session's pin, creating a pin, or running elsewhere once);
    also decides which quota it may use."""

    PINNED = "pinned"  # a request of a pinned session on its pin's provider (may use the reserve)
    NEW_PIN = "new_pin"  # the request that created (or moved) its session's pin
    TEMPORARY = "temporary"  # runs elsewhere this once (capacity spike, no session, overflow)


class EndReason(enum.StrEnum):
    """How a lease ended (the audit trail and the `lease.ended` metrics label)."""

    RELEASED = "released"  # the edge said the request ended
    UNLISTED = "unlisted"  # the edge's complete lease list no longer named it
    EXPIRED = "expired"  # not renewed within lease_timeout (its edge died or was cut off)
    MOVED = "moved"  # handed over with its shard to another instance
    DROPPED = "dropped"  # this instance gave up the shard without handing it over (fenced)


class CapacityError(RuntimeError):
    """A grant or pin creation without room: the caller decided on a stale view (a bug)."""


@dataclass(slots=True)
class PinRecord:
    """A session's pin as its owner holds it. ``revision`` 0: its write is not acknowledged yet."""

    key: str
    pin_id: str
    provider: str
    model: str
    session: str
    shard: int
    created_at: float
    since: float  # when it was created or last moved: return-home hysteresis counts from here
    last_used: float  # last successful release of one of its leases (the inactivity countdown)
    stored_refreshed_at: float  # the refreshed_at its stored value carries
    revision: int = 0
    leases: set[str] = field(default_factory=set)
    uses: int = 0  # leases ever listed in it (1: a one-shot conversation so far)
    endpoint: str | None = None  # where its last request runs or ran (its prefix cache)
    parent: str | None = None  # a sub-agent's: its parent session (the client named it)


@record
class LeaseRecord:
    """One granted request lease. ``unreserved``: it counts against the quota's ``u``."""

    lease_id: str
    provider: str
    model: str
    kind: LeaseKind
    unreserved: bool
    shard: int
    edge: str
    granted_at: float
    renewed_at: float
    session: str | None = None
    pin_id: str | None = None
    endpoint: str | None = None
    key: str | None = None  # the API key's id, when its max_parallel_requests counts this lease
    key_limit: int | None = None  # that limit when granted (a receiving instance learns it)

    @property
    def pair(self) -> Pair:
        return (self.provider, self.model)

    @property
    def key_pair(self) -> Pair | None:
        return key_pair(self.key) if self.key is not None else None


@dataclass(slots=True)
class PairUse:
    """What an instance uses of a pair: live leases, of which unreserved, and pins."""

    leases: int = 0
    unreserved: int = 0
    pins: int = 0

    @property
    def counts(self) -> QuotaCounts:
        """The same counts, as a quota's (g, u, p) order reads them."""
        return QuotaCounts(self.leases, self.unreserved, self.pins)


@record
class Room:
    """What a pair can take at this instance right now."""

    pinned: bool  # a lease for a pinned session (any lease quota)
    unreserved: bool  # a new-pin or temporary lease
    pin: bool  # one more pin


@dataclass(frozen=True, slots=True)
class ShardState:
    """Everything of one shard, as it moves between instances (handover) or is dropped."""

    shard: int
    pins: tuple[PinRecord, ...]
    leases: tuple[LeaseRecord, ...]

    def counts(self) -> dict[Pair, QuotaCounts]:
        """(leases, unreserved leases, pins) per pair: the quota the shard needs."""
        result: dict[Pair, QuotaCounts] = {}

        def add(pair: Pair, counts: QuotaCounts) -> None:
            result[pair] = result.get(pair, NO_COUNTS).plus(counts)

        for lease in self.leases:
            add(lease.pair, QuotaCounts(1, int(lease.unreserved)))
            if lease.key_pair is not None:  # a key's quota has no reserve: every unit is u
                add(lease.key_pair, QuotaCounts(1, 1))
        for pin in self.pins:
            add((pin.provider, pin.model), QuotaCounts(pins=1))
        return result


class LedgerObserver:
    """Hooks for the audit trail (tests' checker) and metrics; every method is a no-op here."""

    def lease_granted(self, lease: LeaseRecord, quota: Quota | None, before: QuotaCounts) -> None:
        """A new lease; ``before``: the pair's (leases, unreserved, pins) at this instance just
        before it, and ``quota`` the quota it was granted from (None: no limits)."""

    def lease_adopted(self, lease: LeaseRecord, quota: Quota | None, before: QuotaCounts) -> None:
        """A lease taken in with its shard (handover or adoption), not a new grant."""

    def lease_ended(self, lease: LeaseRecord, reason: EndReason, at: float) -> None: ...

    def lease_ended_in_transit(self, lease: LeaseRecord, at: float) -> None:
        """A lease of a shard on its way here (a handover or an adoption) whose edge reported
        its end before the shard arrived: left out of what is taken in, never held here. The
        end is its edge's word, wherever the lease was last counted (a crashed or stopped
        previous owner never records it)."""

    def pin_added(self, pin: PinRecord, at: float, quota: Quota | None, before: int) -> None:
        """A pin taken on (new, moved or taken in with its shard); ``before``: the pair's pins
        at this instance just before it, ``quota`` the quota it came out of (None: no limits)."""

    def pin_removed(self, pin: PinRecord, at: float, reason: str) -> None: ...

    def fenced(self, at: float) -> None:
        """Its instance stopped deciding at ``at`` (its fence, or it learnt it was lost): what
        this ledger holds then is used by nobody; it drops it and joins again under a new id."""


class _IdlePins:
    """A pair's pins without live leases, as eviction candidates: the one-shot ones (one
    request served so far: evictable at once) in the order they became idle, and the others
    in a heap by last use (evictable once idle `min_idle`). The least recently used candidate
    is found without walking past conversations idle for less than `min_idle`: the oldest
    one-shot, or the heap's least recently used pin if it has been idle long enough (if it has
    not, none of the others has). Heap entries of pins that left or moved are skipped when
    met and dropped in bulk once they outnumber the live ones."""

    __slots__ = ("_again", "_heap", "_once", "_seq")

    def __init__(self) -> None:
        self._once: OrderedDict[SessionKey, None] = OrderedDict()
        self._again: dict[SessionKey, int] = {}  # each pin's live heap entry, by sequence
        self._heap: list[tuple[float, int, SessionKey]] = []  # (last use, sequence, pin)
        self._seq = 0

    def __contains__(self, skey: SessionKey) -> bool:
        return skey in self._once or skey in self._again

    def __len__(self) -> int:
        return len(self._once) + len(self._again)

    def keys(self) -> list[SessionKey]:
        return [*self._once, *self._again]

    def add(self, pin: PinRecord) -> None:
        """`pin` is idle (again, or with a later last use)."""
        skey = (pin.model, pin.session)
        if pin.uses <= 1:
            self._again.pop(skey, None)
            self._once[skey] = None
            self._once.move_to_end(skey)
            return
        self._once.pop(skey, None)
        self._seq += 1
        self._again[skey] = self._seq
        heapq.heappush(self._heap, (pin.last_used, self._seq, skey))
        if len(self._heap) > 2 * len(self._again) + 64:
            self._heap = [e for e in self._heap if self._again.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def discard(self, skey: SessionKey) -> None:
        self._once.pop(skey, None)
        self._again.pop(skey, None)  # its heap entry is skipped from now on

    def _oldest_again(self) -> tuple[float, SessionKey] | None:
        heap, again = self._heap, self._again
        while heap:
            last_used, seq, skey = heap[0]
            if again.get(skey) == seq:
                return last_used, skey
            heapq.heappop(heap)
        return None

    def first_evictable(
        self, pins: Mapping[SessionKey, PinRecord], now: float, min_idle: float
    ) -> PinRecord | None:
        once = pins[next(iter(self._once))] if self._once else None
        oldest = self._oldest_again()
        again = pins[oldest[1]] if oldest is not None and now - oldest[0] >= min_idle else None
        if once is None or again is None:
            return once or again
        return again if again.last_used < once.last_used else once

    def candidates(
        self, pins: Mapping[SessionKey, PinRecord], now: float, min_idle: float
    ) -> list[PinRecord]:
        """Every candidate, least recently used first (a scan: for the rare eviction of more
        than one pin)."""
        found = [pins[k] for k in self._once]
        found += [p for k in self._again if now - (p := pins[k]).last_used >= min_idle]
        return sorted(found, key=lambda pin: pin.last_used)


class Ledger:
    """The in-memory admission state of one instance (see the module docstring)."""

    def __init__(
        self,
        limits: Mapping[Pair, PairLimits | None],
        *,
        lease_timeout: float,
        pin_inactivity_timeout: float,
        observer: LedgerObserver | None = None,
    ) -> None:
        self.limits: dict[Pair, PairLimits | None] = dict(limits)
        self.lease_timeout = lease_timeout
        self.pin_inactivity_timeout = pin_inactivity_timeout
        self.observer = observer or LedgerObserver()
        self.pins: dict[SessionKey, PinRecord] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self.quota: dict[Pair, Quota] = {}
        self.use: dict[Pair, PairUse] = {}
        self._shard_pins: dict[int, set[SessionKey]] = {}
        self._shard_leases: dict[int, set[str]] = {}
        self._edge_leases: dict[tuple[str, int], set[str]] = {}
        # Pins without live leases, per pair: the eviction candidates (`_IdlePins`).
        self._idle: dict[Pair, _IdlePins] = {}
        self._endpoint_leases: dict[str, int] = {}
        self.on_endpoint_change: Callable[[str, int], None] | None = None

    # ---- reading ----------------------------------------------------------------------------

    def limits_of(self, provider: str, model: str) -> PairLimits | None:
        return self.limits.get((provider, model))

    def pair_use(self, pair: Pair) -> PairUse:
        return self.use.setdefault(pair, PairUse())

    def pair_quota(self, pair: Pair) -> Quota | None:
        """This instance's quota of a pair with limits (zero until granted); None: no limits."""
        if self.limits.get(pair) is None:
            return None
        return self.quota.get(pair, NO_QUOTA)

    def room(self, provider: str, model: str, extra: QuotaCounts | None = None) -> Room:
        """What the pair can take here now; with `extra` (g, u, p): if this instance held that
        much more quota (what a loan could bring, `Loans.spare`)."""
        pair = (provider, model)
        quota = self.pair_quota(pair)
        if quota is None:
            return Room(True, True, True)
        if extra is not None:
            g = quota.g + extra.leases
            quota = Quota(g, min(g, quota.u + extra.unreserved), quota.p + extra.pins)
        use = self.pair_use(pair)
        leases_left = use.leases < quota.g
        return Room(
            pinned=leases_left,
            unreserved=leases_left and use.unreserved < quota.u,
            pin=use.pins < quota.p,
        )

    def key_room(self, key: str | None) -> bool:
        """Whether a lease of API key `key` fits its max_parallel_requests quota here (True for
        no key, or a key without that limit)."""
        if key is None:
            return True
        pair = key_pair(key)
        quota = self.pair_quota(pair)
        return quota is None or self.pair_use(pair).leases < quota.g

    def set_key_limit(self, key: str, limit: int) -> None:
        """Count leases of `key` against `limit` from now on (its quota comes from the keeper)."""
        self.limits[key_pair(key)] = KeyLimits(limit)

    def pin(self, model: str, session: str) -> PinRecord | None:
        return self.pins.get((model, session))

    def session_limit(self, provider: str, model: str) -> int | None:
        limits = self.limits.get((provider, model))
        return None if limits is None else limits.max_per_session_in_flight_request_slots

    def session_full(self, pin: PinRecord) -> bool:
        limit = self.session_limit(pin.provider, pin.model)
        return limit is not None and len(pin.leases) >= limit

    def evictable(self, provider: str, model: str, now: float, min_idle: float) -> PinRecord | None:
        """The least recently used pin of the pair without leases that either served one
        request only (a one-shot conversation so far) or has been idle >= `min_idle`.

        One-shot traffic therefore never fills a pin table: its pins make room as soon as their
        request ended. Cost: O(1) amortized (`_IdlePins`), however many conversations sit idle
        for less than `min_idle` (a scan past them cost ~0.1 us per idle pin, twice per new session).
        """
        idle = self._idle.get((provider, model))
        return None if idle is None else idle.first_evictable(self.pins, now, min_idle)

    def to_evict(self, provider: str, model: str, now: float, min_idle: float) -> list[PinRecord]:
        """The pins whose eviction makes room for one more pin of the pair, least recently used
        first (`evictable`'s candidates); empty when there are not enough. One, unless the
        pair holds more pins than its quota (pins taken while it had no limits, or above
        lowered ones)."""
        quota = self.pair_quota((provider, model))
        idle = self._idle.get((provider, model))
        if quota is None or not idle:
            return []
        need = self.pair_use((provider, model)).pins - quota.p + 1
        if need == 1:
            pin = idle.first_evictable(self.pins, now, min_idle)
            return [] if pin is None else [pin]
        victims = idle.candidates(self.pins, now, min_idle)
        return victims[:need] if len(victims) >= need else []

    def endpoint_leases(self, endpoint: str) -> int:
        """Live leases of this instance's requests on `endpoint` (its own exact inflight)."""
        return self._endpoint_leases.get(endpoint, 0)

    def shard_of_lease(self, lease_id: str) -> int | None:
        lease = self.leases.get(lease_id)
        return None if lease is None else lease.shard

    def shards(self) -> set[int]:
        return set(self._shard_pins) | set(self._shard_leases)

    def edges(self) -> set[str]:
        return {edge for edge, _ in self._edge_leases}

    # ---- quotas -----------------------------------------------------------------------------

    def set_quota(self, pair: Pair, quota: Quota) -> None:
        self.quota[pair] = quota

    def keep_limits(self, pair: Pair, limits: PairLimits) -> None:
        """Count `pair` against `limits` from now on, with no quota until one is set (an applied
        config added the pair with limits, or gave it limits). Its running leases, granted
        without limits, count as they would have with them: the new-pin and temporary ones as
        unreserved."""
        self.limits[pair] = limits
        self.quota[pair] = NO_QUOTA
        use = self.pair_use(pair)
        for lease_id, lease in list(self.leases.items()):
            if lease.pair == pair and not lease.unreserved and lease.kind is not LeaseKind.PINNED:
                self.leases[lease_id] = replace(lease, unreserved=True)
                use.unreserved += 1

    def drop_limits(self, pair: Pair) -> None:
        """Stop counting `pair` against limits (removed, or its limits gone); its leases end as
        they would."""
        self.limits.pop(pair, None)
        self.quota.pop(pair, None)

    # ---- pins -------------------------------------------------------------------------------

    def create_pin(
        self,
        key: str,
        pin_id: str,
        provider: str,
        model: str,
        session: str,
        shard: int,
        now: float,
        parent: str | None = None,
    ) -> PinRecord:
        """A new pin for a session that has none (`parent`: a sub-agent's parent session);
        CapacityError without pin room."""
        skey = (model, session)
        if skey in self.pins:
            raise CapacityError(f"session {session} already has a pin")
        if not self.room(provider, model).pin:
            raise CapacityError(f"no pin room on {provider}/{model}")
        pin = PinRecord(
            key, pin_id, provider, model, session, shard, now, now, now, now, parent=parent
        )
        self._add_pin(pin, now)
        return pin

    def move_pin(self, pin: PinRecord, new_pin_id: str, provider: str, now: float) -> PinRecord:
        """Move `pin` to `provider` (a new pin id; its running leases stay where they run and no
        longer count for the moved pin). CapacityError without pin room on the target."""
        if self.pins.get((pin.model, pin.session)) is not pin:
            raise CapacityError("moving a pin that is not the session's current pin")
        if not self.room(provider, pin.model).pin:
            raise CapacityError(f"no pin room on {provider}/{pin.model}")
        self._remove_pin(pin, now, "moved")
        moved = PinRecord(
            pin.key,
            new_pin_id,
            provider,
            pin.model,
            pin.session,
            pin.shard,
            pin.created_at,
            now,
            now,
            pin.stored_refreshed_at,
            revision=pin.revision,
            uses=pin.uses,
            parent=pin.parent,
        )
        self._add_pin(moved, now)
        return moved

    def remove_pin(self, pin: PinRecord, now: float, reason: str) -> None:
        """Evict or expire a pin; it must list no live lease."""
        if pin.leases:
            raise CapacityError(f"pin {pin.pin_id} still lists leases {sorted(pin.leases)}")
        if self.pins.get((pin.model, pin.session)) is pin:
            self._remove_pin(pin, now, reason)

    def touch_pin(self, pin: PinRecord, now: float) -> None:
        pin.last_used = max(pin.last_used, now)
        idle = self._idle.get((pin.provider, pin.model))
        if idle is not None and (pin.model, pin.session) in idle:
            idle.add(pin)  # its place among the idle follows its last use

    def _add_pin(self, pin: PinRecord, now: float) -> None:
        skey = (pin.model, pin.session)
        self.pins[skey] = pin
        self._shard_pins.setdefault(pin.shard, set()).add(skey)
        use = self.pair_use((pin.provider, pin.model))
        use.pins += 1
        if not pin.leases:
            self._idle_pins(pin).add(pin)
        self.observer.pin_added(pin, now, self.pair_quota((pin.provider, pin.model)), use.pins - 1)

    def _remove_pin(self, pin: PinRecord, now: float, reason: str) -> None:
        skey = (pin.model, pin.session)
        del self.pins[skey]
        members = self._shard_pins.get(pin.shard)
        if members is not None:
            members.discard(skey)
            if not members:
                del self._shard_pins[pin.shard]
        self.pair_use((pin.provider, pin.model)).pins -= 1
        idle = self._idle.get((pin.provider, pin.model))
        if idle is not None:
            idle.discard(skey)
        self.observer.pin_removed(pin, now, reason)

    # ---- leases -----------------------------------------------------------------------------

    def grant(
        self,
        lease_id: str,
        provider: str,
        model: str,
        kind: LeaseKind,
        *,
        shard: int,
        edge: str,
        now: float,
        session: str | None = None,
        pin: PinRecord | None = None,
        endpoint: str | None = None,
        key: str | None = None,
    ) -> LeaseRecord:
        """A new lease of `kind` on (provider, model), listed in `pin` if given (a pinned or
        new-pin lease of that pin's pair), counted against API key `key`'s max_parallel_requests
        when that key has one here. CapacityError without room, past the session limit or past
        the key's quota.
        """
        pair = (provider, model)
        if lease_id in self.leases:
            raise CapacityError(f"lease id {lease_id} is taken")
        room = self.room(provider, model)
        quota = self.pair_quota(pair)
        use = self.pair_use(pair)
        if kind is LeaseKind.PINNED:
            if not room.pinned:
                raise CapacityError(f"no room for a pinned lease on {provider}/{model}")
            unreserved = False  # it never counts against u (the module's invariants)
        else:
            if not room.unreserved:
                raise CapacityError(f"no unreserved room on {provider}/{model}")
            unreserved = quota is not None
        if not self.key_room(key):
            raise CapacityError(f"API key {key} is at its quota of parallel requests")
        if pin is not None:
            if (pin.provider, pin.model) != pair:
                raise CapacityError("a lease listed in a pin must be on the pin's pair")
            if self.session_full(pin):
                raise CapacityError(f"session {pin.session} is at its in-flight limit")
        lease = LeaseRecord(
            lease_id,
            provider,
            model,
            kind,
            unreserved,
            shard,
            edge,
            now,
            now,
            session,
            pin.pin_id if pin is not None else None,
            endpoint,
            key if key is not None and key_pair(key) in self.limits else None,
            self._key_limit(key),
        )
        before = use.counts
        self._add_lease(lease)
        if pin is not None:
            self._list(pin, lease_id)
            if endpoint is not None:
                pin.endpoint = endpoint
        self.observer.lease_granted(lease, quota, before)
        return lease

    def _key_limit(self, key: str | None) -> int | None:
        limits = self.limits.get(key_pair(key)) if key is not None else None
        return limits.max_global_in_flight_request_slots if limits is not None else None

    def _count_key(self, lease: LeaseRecord, delta: int) -> None:
        if lease.key_pair is not None and lease.key_pair in self.limits:
            use = self.pair_use(lease.key_pair)
            use.leases += delta
            use.unreserved += delta

    def _list(self, pin: PinRecord, lease_id: str) -> None:
        if not pin.leases:
            idle = self._idle.get((pin.provider, pin.model))
            if idle is not None:
                idle.discard((pin.model, pin.session))
        pin.leases.add(lease_id)
        pin.uses += 1

    def _unlist(self, pin: PinRecord, lease_id: str) -> None:
        pin.leases.discard(lease_id)
        if not pin.leases:
            self._idle_pins(pin).add(pin)

    def _idle_pins(self, pin: PinRecord) -> _IdlePins:
        pair = (pin.provider, pin.model)
        idle = self._idle.get(pair)
        if idle is None:
            idle = self._idle[pair] = _IdlePins()
        return idle

    def _add_lease(self, lease: LeaseRecord) -> None:
        self.leases[lease.lease_id] = lease
        use = self.pair_use(lease.pair)
        use.leases += 1
        use.unreserved += lease.unreserved
        self._count_key(lease, +1)
        self._shard_leases.setdefault(lease.shard, set()).add(lease.lease_id)
        self._edge_leases.setdefault((lease.edge, lease.shard), set()).add(lease.lease_id)
        if lease.endpoint is not None:
            self._count_endpoint(lease.endpoint, +1)

    def _end(self, lease: LeaseRecord, reason: EndReason, at: float, refresh: bool) -> None:
        del self.leases[lease.lease_id]
        use = self.pair_use(lease.pair)
        use.leases -= 1
        use.unreserved -= lease.unreserved
        self._count_key(lease, -1)
        _discard(self._shard_leases, lease.shard, lease.lease_id)
        _discard(self._edge_leases, (lease.edge, lease.shard), lease.lease_id)
        if lease.endpoint is not None:
            self._count_endpoint(lease.endpoint, -1)
        if lease.session is not None:
            pin = self.pins.get((lease.model, lease.session))
            if pin is not None and pin.pin_id == lease.pin_id:
                self._unlist(pin, lease.lease_id)
                if refresh:
                    self.touch_pin(pin, at)
        self.observer.lease_ended(lease, reason, at)

    def _count_endpoint(self, endpoint: str, delta: int) -> None:
        count = self._endpoint_leases.get(endpoint, 0) + delta
        if count:
            self._endpoint_leases[endpoint] = count
        else:
            self._endpoint_leases.pop(endpoint, None)
        if self.on_endpoint_change is not None:
            self.on_endpoint_change(endpoint, count)

    def release(self, lease_id: str, now: float, *, refresh: bool) -> LeaseRecord | None:
        """End a lease its edge reported ended; with `refresh`, restart its pin's countdown.
        None when it is not here (already ended, or never was)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return None
        self._end(lease, EndReason.RELEASED, now, refresh)
        return lease

    def renew(
        self, edge: str, shard: int, listed: Iterable[str], now: float, *, settle: float
    ) -> list[str]:
        """An edge's complete list of its live leases in `shard`: renews each, returns the ones
        not held here (lost: the edge must end those requests), and ends the edge's leases in
        the shard that the list leaves out and that are older than `settle` seconds (their end
        message was lost; younger ones may still be on their way to the edge)."""
        listed = set(listed)
        lost = []
        for lease_id in listed:
            lease = self.leases.get(lease_id)
            if lease is None or lease.edge != edge or lease.shard != shard:
                lost.append(lease_id)
                continue
            self.leases[lease_id] = replace(lease, renewed_at=now)
        for lease_id in list(self._edge_leases.get((edge, shard), ())):
            lease = self.leases[lease_id]
            if lease_id not in listed and now - lease.granted_at >= settle:
                self._end(lease, EndReason.UNLISTED, now, refresh=False)
        return sorted(lost)

    def expired_leases(self, now: float) -> list[LeaseRecord]:
        """End and return every lease not renewed within lease_timeout of `now`."""
        expired = [x for x in self.leases.values() if now >= x.renewed_at + self.lease_timeout]
        for lease in expired:
            self._end(lease, EndReason.EXPIRED, now, refresh=False)
        return expired

    def idle_pins(self, now: float) -> list[PinRecord]:
        """Pins without leases whose inactivity countdown has run out (not removed here: the
        caller deletes their stored value, then `remove_pin`)."""
        due = []
        for idle in self._idle.values():
            for skey in idle.keys():
                pin = self.pins[skey]
                if now >= pin.last_used + self.pin_inactivity_timeout:
                    due.append(pin)
        return due

    def pins_to_refresh(self, every: float) -> Iterator[PinRecord]:
        """Stored pins whose stored refreshed_at lags their last use by `every` or more."""
        for pin in self.pins.values():
            if pin.revision and pin.last_used - pin.stored_refreshed_at >= every:
                yield pin

    # ---- shards -----------------------------------------------------------------------------

    def shard_state(self, shard: int) -> ShardState:
        pins = tuple(self.pins[k] for k in sorted(self._shard_pins.get(shard, ())))
        leases = tuple(self.leases[x] for x in sorted(self._shard_leases.get(shard, ())))
        return ShardState(shard, pins, leases)

    def take_shard(self, shard: int, now: float, reason: EndReason) -> ShardState:
        """Remove everything of `shard` from this ledger (it moves away, or is dropped) and
        return it. Its use no longer counts here, so the caller sets it aside first (the
        admission service's `Earmarks.hold_out`) until its quota has moved on; else the
        room it leaves could be granted twice."""
        state = self.shard_state(shard)
        for lease in state.leases:
            self._end(lease, reason, now, refresh=False)
        for pin in state.pins:
            if self.pins.get((pin.model, pin.session)) is pin:
                self._remove_pin(pin, now, reason.value)
        return state

    def add_shard(self, state: ShardState, now: float) -> tuple[list[LeaseRecord], list[PinRecord]]:
        """Take in a shard's pins and leases (handover or adoption); quota must already cover
        them. Returns what the pair's quota could not cover (refused leases: their requests
        lose their lease; refused pins: their sessions pin again, a prefix-cache miss), so the
        quotas hold whatever the transfer achieved."""
        refused_leases: list[LeaseRecord] = []
        refused_pins: list[PinRecord] = []
        for pin in state.pins:
            if (pin.model, pin.session) in self.pins:
                continue
            if not self.room(pin.provider, pin.model).pin:
                refused_pins.append(pin)
                continue
            self._add_pin(replace(pin, leases=set()), now)
        for lease in state.leases:
            if lease.lease_id in self.leases:
                continue
            pair = lease.pair
            quota = self.pair_quota(pair)
            use = self.pair_use(pair)
            if (
                quota is not None
                and (use.leases >= quota.g or (lease.unreserved and use.unreserved >= quota.u))
            ) or not self.key_room(lease.key):
                refused_leases.append(lease)
                continue
            before = use.counts
            self._add_lease(lease)
            if lease.session is not None:
                held = self.pins.get((lease.model, lease.session))
                if held is not None and held.pin_id == lease.pin_id:
                    self._list(held, lease.lease_id)
            self.observer.lease_adopted(lease, quota, before)
        return refused_leases, refused_pins


def _discard(index: dict[K, set[str]], key: K, lease_id: str) -> None:
    """Drop `lease_id` from index[key], and the key once its set is empty."""
    members = index.get(key)
    if members is not None:
        members.discard(lease_id)
        if not members:
            del index[key]
