"""Pins, leases and admission results of the routing state, and the pure rules behind them.

The routing state (seed 000, `ROUTING_STATE`) lives in one KV bucket (key layout and value codecs:
`llmgw.core.leasekeys`); the I/O side is `llmgw.state.routing_state.RoutingState`. What is here is
pure and property-testable: result types, slot choice from a mirror snapshot, the expiry
predicates and the index ranges each lease kind may use.

Vocabulary: a provider/model pair with limits has P pin slots and G lease slots, of which the
first R are reserved for leases of existing pins (kind "pinned"); S bounds the leases of one pin.
A pair without limits has neither: its pinned requests take one lease record each.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from llmgw.core.leasekeys import LeaseKind, LeaseSlotValue, PinValue, SlotState

__all__ = [
    "Admission",
    "AdmissionResult",
    "Lease",
    "PairLimits",
    "PairUsage",
    "Pin",
    "PinMatch",
    "RandomSource",
    "ReaperAction",
    "ReaperActionKind",
    "ReleaseResult",
    "RepinResult",
    "Usage",
    "choose_slot",
    "lease_is_expired",
    "lease_slot_ranges",
    "new_token",
    "pin_is_idle_expired",
]


class PairLimits(Protocol):
    """Capacity of one provider/model pair (the config's `Limits` satisfies it)."""

    max_pinned_sessions: int
    max_global_in_flight_request_slots: int
    global_in_flight_request_slots_reserved_for_pinned_sessions: int
    max_per_session_in_flight_request_slots: int


class RandomSource(Protocol):
    """What the routing state needs from `random.Random` (injected, never module-level)."""

    def randrange(self, start: int, stop: int = ..., step: int = ...) -> int: ...

    def choice(self, seq: Sequence[int]) -> int: ...

    def getrandbits(self, k: int) -> int: ...


class AdmissionResult(enum.StrEnum):
    """Every outcome of an admission operation (a closed set; also a metrics label)."""

    ADMITTED = "admitted"
    ALREADY_PINNED = "already_pinned"
    SESSION_NOT_PINNED = "session_not_pinned"
    PIN_LIMIT_REACHED = "pin_limit_reached"
    GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED = "global_in_flight_request_limit_reached"
    UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED = "unreserved_in_flight_request_limit_reached"
    PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED = "per_session_in_flight_request_limit_reached"


class PinMatch(enum.StrEnum):
    MATCHED = "matched"
    NOT_MATCHED = "not_matched"


class ReleaseResult(enum.StrEnum):
    RELEASED = "released"
    LOST = "lost"  # the lease had expired (and maybe been re-granted): nothing was changed


@dataclass(frozen=True, slots=True)
class Pin:
    """A session's pin as read at `revision` of its key (the revision a CAS must name)."""

    key: str
    revision: int
    value: PinValue

    @property
    def id(self) -> str:
        return self.value.pin_id

    @property
    def pin_id(self) -> str:
        return self.value.pin_id

    @property
    def provider(self) -> str:
        return self.value.provider

    @property
    def model(self) -> str:
        return self.value.model

    @property
    def session(self) -> str:
        return self.value.session

    @property
    def pin_slot(self) -> int | None:
        return self.value.pin_slot

    @property
    def leases(self) -> Mapping[str, str]:
        return self.value.leases

    @property
    def refreshed_at(self) -> float:
        return self.value.refreshed_at

    @property
    def pending(self) -> bool:
        """Being created or moved: not yet usable (see PinValue.pending)."""
        return self.value.pending


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted request lease: enough to renew and release it by CAS without reading first.

    `revision` is the revision of the lease's last write by its holder; a renewal returns a
    new Lease with the new revision, and whoever holds the Lease must use the newest one.
    `slot` is the lease slot index, or None for the per-lease record of a pair without limits.
    """

    key: str
    revision: int
    lease_id: str
    kind: LeaseKind
    provider: str
    model: str
    session: str | None
    pin_id: str | None
    edge_id: str
    granted_at: float
    renewed_at: float
    slot: int | None

    @property
    def unlimited(self) -> bool:
        return self.slot is None

    def slot_value(self) -> LeaseSlotValue:
        """The value stored under `key` while this lease holds it."""
        return LeaseSlotValue(
            SlotState.TAKEN,
            self.lease_id,
            self.kind,
            self.session,
            self.pin_id,
            self.edge_id,
            self.granted_at,
            self.renewed_at,
        )


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of an admission; `lease` is set only when ADMITTED on a pair that needs one.

    `pin` is the pin the decision was taken against (the new pin when one was created or moved;
    the current, different pin when the session was re-pinned concurrently), or None.
    """

    result: AdmissionResult
    pin: Pin | None = None
    lease: Lease | None = None


@dataclass(frozen=True, slots=True)
class RepinResult:
    """Outcome of a compare-and-swap of a pin.

    NOT_MATCHED: the pin was no longer the expected one; nothing changed, `admission` is None.
    MATCHED with a non-ADMITTED admission: the target lacked capacity; the pin was not touched.
    """

    pin_match: PinMatch
    admission: Admission | None


class ReaperActionKind(enum.StrEnum):
    LEASE_EXPIRED = "lease_expired"  # an expired lease's slot freed (record deleted)
    LEASE_UNLISTED = "lease_unlisted"  # an ended lease removed from its pin's list
    PIN_EXPIRED = "pin_expired"  # an idle pin deleted
    PIN_SLOT_FREED = "pin_slot_freed"  # the pin slot of an expired pin freed
    ORPHAN_PIN_SLOT_FREED = "orphan_pin_slot_freed"  # repair: pin slot naming no live pin
    ABANDONED_PIN_DELETED = "abandoned_pin_deleted"  # repair: a pending pin its creator left


@dataclass(frozen=True, slots=True)
class ReaperAction:
    """One state change made by a reaper primitive (published as an event by the reaper)."""

    kind: ReaperActionKind
    key: str
    revision: int  # revision of the write that made the change
    provider: str
    model: str
    session: str | None = None
    pin_id: str | None = None
    lease_id: str | None = None


@dataclass(frozen=True, slots=True)
class PairUsage:
    """Occupancy of one provider/model pair as read from the bucket at one moment."""

    provider: str
    model: str
    limits: PairLimits | None
    pins: int = 0  # live pins on this pair
    pin_slots_taken: int = 0
    leases: int = 0  # taken lease slots (or lease records when unlimited)
    leases_by_kind: Mapping[str, int] = field(default_factory=dict)
    expired_leases: int = 0  # taken but past their timeout: the reaper's next work


@dataclass(frozen=True, slots=True)
class Usage:
    at: float
    pairs: Sequence[PairUsage]


# ---------------------------------------------------------------------------------------------
# Pure rules


def lease_slot_ranges(limits: PairLimits, kind: LeaseKind) -> tuple[range, ...]:
    """The lease slot index ranges a lease of `kind` may take, in order of preference.

    Slots [0, R) are reserved for leases of existing pins; new-pin and temporary leases take
    [R, G). A pinned lease prefers the reserve, so unreserved slots stay open for new sessions.
    """
    slots = limits.max_global_in_flight_request_slots
    reserved = min(limits.global_in_flight_request_slots_reserved_for_pinned_sessions, slots)
    if kind == LeaseKind.PINNED:
        return tuple(r for r in (range(0, reserved), range(reserved, slots)) if r)
    return (range(reserved, slots),) if reserved < slots else ()


_PROBES = 8  # random probes before scanning: cheap while many slots are free


def choose_slot(
    taken: AbstractSet[int], slots: range, tried: AbstractSet[int], rng: RandomSource
) -> int | None:
    """A uniformly random index of `slots` that is neither taken nor tried; None if none is.

    Random choice spreads concurrent instances over different keys, so their CAS writes rarely
    collide. Probing first keeps the common case O(1); the scan bounds the worst case.
    """
    if not slots:
        return None
    start, size = slots.start, len(slots)
    for _ in range(_PROBES):
        index = start + rng.randrange(size)
        if index not in taken and index not in tried:
            return index
    candidates = [i for i in slots if i not in taken and i not in tried]
    return rng.choice(candidates) if candidates else None


def lease_is_expired(value: LeaseSlotValue, now: float, lease_timeout: float) -> bool:
    """A taken lease whose holder has not renewed it within `lease_timeout` of `now`."""
    return value.is_taken and not value.is_live(now, lease_timeout)


def pin_is_idle_expired(pin: PinValue, now: float, pin_inactivity_timeout: float) -> bool:
    """A pin holding no lease whose inactivity countdown has run out.

    A pin listing any lease never expires: its leases end by release or by the reaper first.
    """
    return not pin.leases and now >= pin.refreshed_at + pin_inactivity_timeout


def new_token(rng: RandomSource) -> str:
    """A fresh 64-bit id (pin ids, lease ids): 16 hex digits, a safe key token.

    Unique only if every instance's random source is seeded independently.
    """
    return f"{rng.getrandbits(64):016x}"
