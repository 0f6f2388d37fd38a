"""Replays a routing-state history and reports every invariant breach, with key and revision.

Input: every write the bucket applied, in revision order (HistoryRecorder / MemoryKV.history),
the limits of each provider/model pair, and the lease timeout. After each write the checker
looks at the state it produced and reports:

    order        revisions do not strictly increase (the history is not a replay of one bucket)
    layout       a routing key or value that does not decode, a value that does not match its
                 key, a slot key deleted (slots are freed, never deleted), a per-lease record
                 on a pair with limits
    I2a          taken lease slots of a pair > G, or a lease slot index >= G
    I2b          a taken slot with index < R whose lease is not of kind "pinned"
    I2c          a pin listing more than S leases
    I2d          taken pin slots of a pair > P, a pin slot index >= P, live pins of a pair > P,
                 or a live pin of a pair with limits whose pin slot is not taken in its name
    double-grant a taken slot overwritten by another lease (or pin) without passing through free
    pending      a pending pin (being created or moved) holds no slot and no lease, and is
                 not counted as a pin; a layout breach otherwise
    I-expiry     a pin deleted while its last value still lists leases (the pin would expire
                 under a lease it holds); live ones are named, with now = the latest time
                 written in any value so far (the injected clock's domain)

I3 (one pin per model and session) is structural: one key per (model, session). Whether a write
was a CAS cannot be seen in a history; what a blind overwrite breaks shows up above.

Pairs absent from `limits_by_pm` are not limit-checked; a pair mapped to None has no limits.
Keys outside the pin./pslot./lease. namespaces are ignored.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from llmgw.core.leasekeys import (
    KeyFormatError,
    LeaseKind,
    LeaseSlotKey,
    LeaseSlotValue,
    ParsedKey,
    PinKey,
    PinSlotKey,
    PinSlotValue,
    PinValue,
    RoutingValue,
    UnlimitedLeaseKey,
    ValueFormatError,
    decode_value,
    model_key,
    parse_key,
    pin_slot_key,
)
from llmgw.state.kv import KVEntry

__all__ = ["PairLimits", "Violation", "check_history"]

_ROUTING_NAMESPACES = ("pin", "pslot", "lease")


class PairLimits(Protocol):
    """The limits of one provider/model pair (the config's `Limits` satisfies it)."""

    max_pinned_sessions: int
    max_global_in_flight_request_slots: int
    global_in_flight_request_slots_reserved_for_pinned_sessions: int
    max_per_session_in_flight_request_slots: int


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    key: str
    revision: int
    message: str

    def __str__(self) -> str:
        return f"[{self.invariant}] revision {self.revision}, key {self.key}: {self.message}"


class _Replay:
    def __init__(
        self, limits_by_pm: Mapping[tuple[str, str], PairLimits | None], lease_timeout: float
    ) -> None:
        self.limits: dict[tuple[str, str], PairLimits | None] = {}
        self.model_names: dict[str, str] = {}
        for (provider, model), limits in limits_by_pm.items():
            mk = model_key(model)
            self.limits[(provider, mk)] = limits
            self.model_names[mk] = model
        self.lease_timeout = lease_timeout
        self.state: dict[str, tuple[ParsedKey, RoutingValue]] = {}
        self.taken_leases: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.taken_pslots: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.live_pins: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.pin_keys_by_id: dict[str, str] = {}
        self.now = float("-inf")
        self.last_revision = 0
        self.violations: list[Violation] = []
        self.entry: KVEntry | None = None

    # ---- helpers ---------------------------------------------------------------------

    def report(self, invariant: str, message: str, key: str | None = None) -> None:
        assert self.entry is not None
        self.violations.append(
            Violation(invariant, key or self.entry.key, self.entry.revision, message)
        )

    def pair(self, provider: str, mk: str) -> str:
        return f"{provider}/{self.model_names.get(mk, mk)}"

    def known(self, provider: str, mk: str) -> bool:
        return (provider, mk) in self.limits

    def limits_of(self, provider: str, mk: str) -> PairLimits | None:
        return self.limits.get((provider, mk))

    def advance_clock(self, value: RoutingValue) -> None:
        times: tuple[float | None, ...]
        if isinstance(value, PinValue):
            times = (value.refreshed_at,)
        elif isinstance(value, PinSlotValue):
            times = (value.at,)
        else:
            times = (value.granted_at, value.renewed_at)
        self.now = max([self.now, *(t for t in times if t is not None)])

    # ---- replay ----------------------------------------------------------------------

    def apply(self, entry: KVEntry) -> None:
        self.entry = entry
        if entry.revision <= self.last_revision:
            self.report(
                "order",
                f"revision {entry.revision} does not follow "
                f"{self.last_revision}: not one bucket's history in order",
            )
        self.last_revision = max(self.last_revision, entry.revision)
        if entry.key.split(".", 1)[0] not in _ROUTING_NAMESPACES:
            return
        try:
            parsed = parse_key(entry.key)
        except KeyFormatError as exc:
            self.report("layout", str(exc))
            return
        previous = self.state.pop(entry.key, (None, None))[1]
        self.forget(entry.key, parsed, previous)
        if entry.deleted:
            self.on_delete(parsed, previous)
            return
        try:
            value = decode_value(parsed, entry.value)
        except ValueFormatError as exc:
            self.report("layout", f"{exc} (value treated as absent)")
            return
        self.advance_clock(value)
        self.state[entry.key] = (parsed, value)
        if isinstance(parsed, PinKey):
            assert isinstance(value, PinValue)
            self.on_pin(parsed, value)
        elif isinstance(parsed, PinSlotKey):
            assert isinstance(value, PinSlotValue)
            self.on_pin_slot(parsed, value, previous)
        else:
            assert isinstance(value, LeaseSlotValue)
            self.on_lease(parsed, value, previous)

    def forget(self, key: str, parsed: ParsedKey, previous: RoutingValue | None) -> None:
        """Remove the key's previous value from the per-pair indexes."""
        if isinstance(parsed, PinKey) and isinstance(previous, PinValue):
            self.live_pins[(previous.provider, parsed.mk)].discard(key)
            if self.pin_keys_by_id.get(previous.pin_id) == key:
                del self.pin_keys_by_id[previous.pin_id]
        elif isinstance(parsed, PinSlotKey):
            self.taken_pslots[(parsed.provider, parsed.mk)].discard(key)
        elif isinstance(parsed, LeaseSlotKey | UnlimitedLeaseKey):
            self.taken_leases[(parsed.provider, parsed.mk)].discard(key)

    def on_delete(self, parsed: ParsedKey, previous: RoutingValue | None) -> None:
        key = self.entry.key if self.entry else ""
        if isinstance(parsed, PinKey):
            if isinstance(previous, PinValue) and previous.leases:
                live = [
                    lease_id
                    for lease_id, lease_key in sorted(previous.leases.items())
                    if self.lease_is_live(lease_key, lease_id)
                ]
                self.report(
                    "I-expiry",
                    f"pin {previous.pin_id} deleted while listing leases "
                    f"{sorted(previous.leases)}; live among them: {live or 'none'}",
                )
        elif isinstance(parsed, PinSlotKey | LeaseSlotKey):
            self.report("layout", "slot key deleted: slots are freed (state free), never deleted")
            if isinstance(parsed, PinSlotKey) and isinstance(previous, PinSlotValue):
                self.check_pin_slot_released(key, previous)

    def lease_is_live(self, lease_key: str, lease_id: str) -> bool:
        held = self.state.get(lease_key)
        if held is None or not isinstance(held[1], LeaseSlotValue):
            return False
        lease = held[1]
        return lease.lease_id == lease_id and lease.is_live(self.now, self.lease_timeout)

    def on_pin(self, parsed: PinKey, pin: PinValue) -> None:
        key = parsed.key
        if pin.session != parsed.session or pin.mk != parsed.mk:
            self.report(
                "layout",
                f"pin value names session {pin.session!r} / model {pin.model!r}, not the key's",
            )
        pm = (pin.provider, parsed.mk)
        self.pin_keys_by_id[pin.pin_id] = key
        if pin.pending:
            # Not a pin yet: it must hold nothing, and counts against no limit.
            if pin.leases or pin.pin_slot is not None:
                self.report("layout", f"pending pin {pin.pin_id} lists leases or a pin slot")
            return
        if pin.replaces is not None:
            self.report("layout", f"active pin {pin.pin_id} still names the pin it replaced")
        self.live_pins[pm].add(key)
        if not self.known(*pm):
            return
        limits = self.limits_of(*pm)
        if limits is None:
            return
        max_per_session = limits.max_per_session_in_flight_request_slots
        if len(pin.leases) > max_per_session:
            self.report(
                "I2c",
                f"pin {pin.pin_id} lists {len(pin.leases)} leases > "
                f"max_per_session_in_flight_request_slots {max_per_session} "
                f"of {self.pair(*pm)}",
            )
        max_pins = limits.max_pinned_sessions
        if len(self.live_pins[pm]) > max_pins:
            self.report(
                "I2d",
                f"{len(self.live_pins[pm])} live pins on {self.pair(*pm)} > "
                f"max_pinned_sessions {max_pins}",
            )
        if pin.pin_slot is None:
            self.report(
                "I2d",
                f"pin {pin.pin_id} of {self.pair(*pm)} (a pair with limits) holds no pin slot",
            )
            return
        slot_key = pin_slot_key(pin.provider, parsed.mk, pin.pin_slot)
        held = self.state.get(slot_key)
        slot = held[1] if held else None
        if not (isinstance(slot, PinSlotValue) and slot.is_taken and slot.pin_id == pin.pin_id):
            owner = (
                "free or missing"
                if not (isinstance(slot, PinSlotValue) and slot.is_taken)
                else f"taken by pin {slot.pin_id}"
            )
            self.report("I2d", f"pin {pin.pin_id} claims pin slot {slot_key}, which is {owner}")

    def on_pin_slot(
        self, parsed: PinSlotKey, slot: PinSlotValue, previous: RoutingValue | None
    ) -> None:
        key = parsed.key
        pm = (parsed.provider, parsed.mk)
        if isinstance(previous, PinSlotValue) and previous.is_taken:
            if slot.is_taken and slot.pin_id != previous.pin_id:
                self.report(
                    "double-grant",
                    f"pin slot taken by pin {previous.pin_id} "
                    f"overwritten by pin {slot.pin_id} without being freed",
                )
            if not slot.is_taken or slot.pin_id != previous.pin_id:
                self.check_pin_slot_released(key, previous)
        if not slot.is_taken:
            return
        self.taken_pslots[pm].add(key)
        if not self.known(*pm):
            return
        limits = self.limits_of(*pm)
        if limits is None:
            self.report("layout", f"pin slot taken on {self.pair(*pm)}, a pair without limits")
            return
        max_pins = limits.max_pinned_sessions
        if parsed.index >= max_pins:
            self.report(
                "I2d",
                f"pin slot index {parsed.index} >= max_pinned_sessions "
                f"{max_pins} of {self.pair(*pm)}",
            )
        if len(self.taken_pslots[pm]) > max_pins:
            self.report(
                "I2d",
                f"{len(self.taken_pslots[pm])} taken pin slots on "
                f"{self.pair(*pm)} > max_pinned_sessions {max_pins}",
            )

    def check_pin_slot_released(self, key: str, previous: PinSlotValue) -> None:
        """A pin slot stopped naming a pin: that pin must not be live and claiming it."""
        pin_key_ = self.pin_keys_by_id.get(previous.pin_id or "")
        held = self.state.get(pin_key_) if pin_key_ else None
        if held is None:
            return
        parsed, value = held
        if (
            isinstance(value, PinValue)
            and value.pin_id == previous.pin_id
            and value.pin_slot is not None
            and pin_slot_key(value.provider, parsed.mk, value.pin_slot) == key
        ):
            self.report(
                "I2d",
                f"pin slot of pin {previous.pin_id} released while that pin "
                f"({pin_key_}) is live and claims it",
            )

    def on_lease(
        self,
        parsed: LeaseSlotKey | UnlimitedLeaseKey,
        lease: LeaseSlotValue,
        previous: RoutingValue | None,
    ) -> None:
        key = parsed.key
        pm = (parsed.provider, parsed.mk)
        if isinstance(parsed, UnlimitedLeaseKey) and (
            not lease.is_taken or lease.lease_id != parsed.lease_id
        ):
            self.report(
                "layout",
                f"lease record must be taken by lease {parsed.lease_id}, "
                f"found state {lease.state} lease {lease.lease_id}",
            )
        if (
            isinstance(previous, LeaseSlotValue)
            and previous.is_taken
            and lease.is_taken
            and lease.lease_id != previous.lease_id
        ):
            self.report(
                "double-grant",
                f"slot held by lease {previous.lease_id} overwritten "
                f"by lease {lease.lease_id} without being freed",
            )
        if not lease.is_taken:
            return
        self.taken_leases[pm].add(key)
        if not self.known(*pm):
            return
        limits = self.limits_of(*pm)
        if limits is None:
            if isinstance(parsed, LeaseSlotKey):
                self.report(
                    "layout", f"indexed lease slot on {self.pair(*pm)}, a pair without limits"
                )
            return
        if isinstance(parsed, UnlimitedLeaseKey):
            self.report(
                "layout",
                f"per-lease record on {self.pair(*pm)}, a pair with limits (bypasses its slots)",
            )
        max_slots = limits.max_global_in_flight_request_slots
        reserved = limits.global_in_flight_request_slots_reserved_for_pinned_sessions
        if isinstance(parsed, LeaseSlotKey):
            if parsed.index >= max_slots:
                self.report(
                    "I2a",
                    f"lease slot index {parsed.index} >= "
                    f"max_global_in_flight_request_slots {max_slots} "
                    f"of {self.pair(*pm)}",
                )
            if parsed.index < reserved and lease.kind != LeaseKind.PINNED:
                self.report(
                    "I2b",
                    f"reserved slot {parsed.index} (< {reserved}) taken by "
                    f"lease {lease.lease_id} of kind {lease.kind}, not pinned",
                )
        if len(self.taken_leases[pm]) > max_slots:
            self.report(
                "I2a",
                f"{len(self.taken_leases[pm])} taken lease slots on "
                f"{self.pair(*pm)} > max_global_in_flight_request_slots "
                f"{max_slots}",
            )


def check_history(
    entries: Iterable[KVEntry],
    limits_by_pm: Mapping[tuple[str, str], PairLimits | None],
    lease_timeout: float,
) -> list[Violation]:
    """Every invariant breach in `entries` (see the module docstring), in history order.

    `limits_by_pm` maps (provider id, model name) to the pair's limits, or None for a pair
    without limits.
    """
    replay = _Replay(limits_by_pm, lease_timeout)
    for entry in entries:
        replay.apply(entry)
    return replay.violations
