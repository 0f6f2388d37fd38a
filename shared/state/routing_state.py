"""The routing state of seed 000 (`ROUTING_STATE`) over a KVStore: pins, pin slots, leases.

Every operation is a short sequence of single-key reads and compare-and-swap writes on one
bucket (layout: `llmgw.core.leasekeys`); a process may die between any two of them. The order
of the steps is chosen so that a partial operation can only leave *extra* taken slots or stale
lease entries in a pin, never over-admission:

- capacity first, then the pin: a slot is taken (CAS) before the pin that names it is written,
  and freed only after the pin stopped naming it; an abandoned operation leaks capacity only
  until its lease times out (the reaper frees it) or the repair grace period passes;
- a lease is listed in its pin only after its slot is taken, and unlisted only after the slot is
  freed, so a pin whose list is empty holds no live lease and may expire (CAS delete of exactly
  that revision);
- a holder frees or renews its slot by CAS from the revision it last wrote: a lease that expired
  and was granted to someone else can no longer be touched by its former holder.

Invariants kept (checked by `llmgw.state.checker` over the bucket's history): taken lease slots
per pair <= G, reserved slots (< R) only held by pinned leases, leases per pin <= S, taken pin
slots per pair <= P, one pin per (model, session), no pin deleted while it lists a lease.
Documented window: if an admission stalls longer than the repair grace between taking a pin slot
and writing its pin, repair may free that pin slot first (pins may then exceed P until that pin
expires); choose a grace far above any admission's duration.

Concurrency: one RoutingState per process and event loop; any number of processes may share the
bucket. Slot choice uses a watch-fed mirror (`llmgw.state.slots`) as a hint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from llmgw.core.leasekeys import (
    LEASE_PREFIX,
    PIN_PREFIX,
    PIN_SLOT_PREFIX,
    KeyFormatError,
    LeaseKind,
    LeaseSlotKey,
    LeaseSlotValue,
    ParsedKey,
    PinKey,
    PinSlotKey,
    PinSlotValue,
    PinValue,
    UnlimitedLeaseKey,
    ValueFormatError,
    lease_prefix,
    model_key,
    parse_key,
    pin_key,
    pin_slot_key,
    pin_slot_prefix,
    unlimited_lease_key,
)
from llmgw.core.leases import (
    Admission,
    AdmissionResult,
    Lease,
    PairLimits,
    PairUsage,
    Pin,
    PinMatch,
    RandomSource,
    ReaperAction,
    ReaperActionKind,
    ReleaseResult,
    RepinResult,
    Usage,
    choose_slot,
    lease_is_expired,
    lease_slot_ranges,
    new_token,
    pin_is_idle_expired,
)
from llmgw.state.kv import CasConflict, KVEntry, KVStore
from llmgw.state.slots import SlotFamily, SlotMirror

__all__ = ["RoutingState"]

Clock = Callable[[], float]
_V = TypeVar("_V", covariant=True)

_FREE = LeaseSlotValue.free().to_json()  # the same bytes for pin slots and lease slots
_MAX_SLOT_ATTEMPTS = 16  # CAS attempts on slots per take; conflicts are rare (random choice)
_MAX_PIN_ATTEMPTS = 16  # CAS attempts on one pin key (bounded by S concurrent requests)


@dataclass(frozen=True, slots=True)
class _Pair:
    provider: str
    model: str
    mk: str
    limits: PairLimits | None
    pin_slots: SlotFamily | None  # None for a pair without limits
    lease_slots: SlotFamily | None


class RoutingState:
    """Pins, pin capacity and request leases shared by every instance through one bucket.

    `limits` maps (provider, model) to the pair's limits; a pair mapped to None, or absent,
    has no limits. `clock` returns seconds (the same domain in every instance: it stamps
    leases and pins); `rng` must be seeded independently per instance (it makes the ids).
    Call `start()` (or use `async with`) before admitting, so the slot mirror is loaded.
    """

    def __init__(
        self,
        kv: KVStore,
        limits: Mapping[tuple[str, str], PairLimits | None],
        *,
        clock: Clock,
        rng: RandomSource,
        lease_timeout: float = 30.0,
        pin_inactivity_timeout: float = 300.0,
        instance_id: str = "",
    ) -> None:
        self._kv = kv
        self._clock = clock
        self._rng = rng
        self.lease_timeout = lease_timeout
        self.pin_inactivity_timeout = pin_inactivity_timeout
        self.instance_id = instance_id
        self.mirror = SlotMirror(kv)
        self.limits: dict[tuple[str, str], PairLimits | None] = dict(limits)
        self.cas_conflicts = 0  # slot CAS attempts lost to another writer (mirror staleness)
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._models_by_mk: dict[str, str] = {}
        for provider, model in self.limits:
            self._pair(provider, model)

    async def start(self) -> None:
        await self.mirror.start()

    async def close(self) -> None:
        await self.mirror.close()

    async def __aenter__(self) -> RoutingState:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def has_limits(self, provider: str, model: str) -> bool:
        return self.limits.get((provider, model)) is not None

    # ---- admission -------------------------------------------------------------------------

    async def get_pin(self, model: str, session: str) -> Pin | None:
        key = pin_key(model_key(model), session)
        return _pin(await self._kv.get(key))

    async def try_admit_unpinned_session_request(
        self, provider: str, model: str, session: str, *, edge_id: str | None = None
    ) -> Admission:
        """Create the session's pin on `provider` with its first lease (seed: a new pin).

        PIN_LIMIT_REACHED / UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED when the pair lacks pin
        or unreserved request capacity; ALREADY_PINNED (pin None) when the session got pinned
        meanwhile. Any capacity taken on the way is given back before returning.

        On a pair with limits the pin is written first, pending, and only then takes its pin
        slot and lease: a pin slot is therefore never taken for a pin that no key names yet,
        so repair can free a slot whose pin is gone without guessing whether its creator is
        merely slow (see docs/adr/0001-routing-state.md).
        """
        pair = self._pair(provider, model)
        now = self._clock()
        pin_id = new_token(self._rng)
        key = pin_key(pair.mk, session)
        if pair.pin_slots is None:
            lease = await self._grant(pair, LeaseKind.NEW_PIN, session, pin_id, edge_id, now)
            if lease is None:  # pragma: no cover - a pair without limits always grants
                return Admission(AdmissionResult.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED)
            value = PinValue(
                pin_id, provider, model, session, None, {lease.lease_id: lease.key}, now
            )
            try:
                revision = await self._kv.create(key, value.to_json())
            except CasConflict:
                await self._end(lease)
                return Admission(AdmissionResult.ALREADY_PINNED)
            return Admission(AdmissionResult.ADMITTED, Pin(key, revision, value), lease)

        pending = PinValue(pin_id, provider, model, session, None, {}, now, pending=True)
        try:
            pending_revision = await self._kv.create(key, pending.to_json())
        except CasConflict:
            return Admission(AdmissionResult.ALREADY_PINNED)
        result, pin, lease = await self._fill_pending(pair, pending, pending_revision, edge_id, now)
        if result is not AdmissionResult.ADMITTED:
            await self._delete(key, pending_revision)  # no-op if someone already replaced it
        return Admission(result, pin, lease)

    async def _fill_pending(
        self, pair: _Pair, pending: PinValue, revision: int, edge_id: str | None, now: float
    ) -> tuple[AdmissionResult, Pin | None, Lease | None]:
        """Take a pin slot and a first lease for a pending pin, then activate it by CAS.

        Returns ADMITTED with the active pin and lease; or the limit that stopped it, or
        ALREADY_PINNED when the pending pin was replaced meanwhile (an abandoned pending pin
        deleted by repair, or a concurrent move), with everything taken given back.
        """
        assert pair.pin_slots is not None
        pin_slot = await self._take_pin_slot(pair.pin_slots, pending.session, pending.pin_id, now)
        if pin_slot is None:
            return AdmissionResult.PIN_LIMIT_REACHED, None, None
        lease = await self._grant(
            pair, LeaseKind.NEW_PIN, pending.session, pending.pin_id, edge_id, now
        )
        if lease is None:
            await self._give_back_pin_slot(pair, pin_slot)
            return AdmissionResult.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED, None, None
        active = replace(
            pending,
            pin_slot=pin_slot[0],
            leases={lease.lease_id: lease.key},
            pending=False,
            replaces=None,
        )
        try:
            activated = await self._kv.update(pending.key, active.to_json(), revision)
        except CasConflict:
            await self._end(lease)
            await self._free_pin_slot(pair.provider, pair.mk, pin_slot[0], pending.pin_id)
            return AdmissionResult.ALREADY_PINNED, None, None
        return AdmissionResult.ADMITTED, Pin(pending.key, activated, active), lease

    async def try_admit_pinned_session_request(
        self, model: str, session: str, *, pin: Pin | None = None, edge_id: str | None = None
    ) -> Admission:
        """Admit a request of a pinned session on its pin's provider: get + slot CAS + pin CAS.

        `pin`: the pin the caller has just read with get_pin, to skip reading it again (the
        pin's CAS still decides; a stale one costs a retry). If the pin changed meanwhile the
        lease is given back and the result carries the new pin (ALREADY_PINNED) or none
        (SESSION_NOT_PINNED), so the caller routes again.
        """
        key = pin_key(model_key(model), session)
        if pin is None or pin.key != key:
            pin = _pin(await self._kv.get(key))
        if pin is None:
            return Admission(AdmissionResult.SESSION_NOT_PINNED)
        if pin.pending:
            return Admission(AdmissionResult.ALREADY_PINNED, pin)  # not usable yet: route again
        pair = self._pair(pin.provider, model)
        per_session = (
            None if pair.limits is None else pair.limits.max_per_session_in_flight_request_slots
        )
        if per_session is not None and len(pin.leases) >= per_session:
            return Admission(AdmissionResult.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED, pin)
        lease = await self._grant(pair, LeaseKind.PINNED, session, pin.id, edge_id, self._clock())
        if lease is None:
            return Admission(AdmissionResult.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED, pin)
        for _ in range(_MAX_PIN_ATTEMPTS):
            value = pin.value.with_lease(lease.lease_id, lease.key)
            try:
                revision = await self._kv.update(key, value.to_json(), pin.revision)
            except CasConflict:
                current = _pin(await self._kv.get(key))
                if current is None or current.id != pin.id:
                    await self._end(lease)
                    if current is None:
                        return Admission(AdmissionResult.SESSION_NOT_PINNED)
                    return Admission(AdmissionResult.ALREADY_PINNED, current)
                pin = current
                if per_session is not None and len(pin.leases) >= per_session:
                    break
                continue
            return Admission(AdmissionResult.ADMITTED, Pin(key, revision, value), lease)
        await self._end(lease)
        return Admission(AdmissionResult.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED, pin)

    async def try_compare_and_swap_pin_and_admit_request(
        self,
        expected_pin: Pin,
        model: str,
        session: str,
        provider: str,
        *,
        edge_id: str | None = None,
    ) -> RepinResult:
        """Move the session's pin to `provider` if it is still `expected_pin` (its revision).

        NOT_MATCHED when the pin changed meanwhile. When the target lacks capacity the pin is
        the expected one again (MATCHED with the limit result; the admission's `pin` is that
        pin at its current revision, for trying the next provider). On success the old pin's
        slot is freed; the old pin's running leases keep their slots on the old provider
        until they are released.

        On a pair with limits the move is pin-first, like a creation: the pin is swapped to a
        pending pin naming the target, which then takes its pin slot and lease; if the target
        is full the expected pin's value is written back.
        """
        pair = self._pair(provider, model)
        now = self._clock()
        pin_id = new_token(self._rng)
        key = expected_pin.key
        if pair.pin_slots is None:
            lease = await self._grant(pair, LeaseKind.NEW_PIN, session, pin_id, edge_id, now)
            if lease is None:  # pragma: no cover - a pair without limits always grants
                return RepinResult(
                    PinMatch.MATCHED,
                    Admission(
                        AdmissionResult.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED, expected_pin
                    ),
                )
            value = PinValue(
                pin_id, provider, model, session, None, {lease.lease_id: lease.key}, now
            )
            try:
                revision = await self._kv.update(key, value.to_json(), expected_pin.revision)
            except CasConflict:
                await self._end(lease)
                return RepinResult(PinMatch.NOT_MATCHED, None)
            moved = Pin(key, revision, value)
        else:
            pending = PinValue(
                pin_id,
                provider,
                model,
                session,
                None,
                {},
                now,
                pending=True,
                replaces=expected_pin.id,
            )
            try:
                pending_revision = await self._kv.update(
                    key, pending.to_json(), expected_pin.revision
                )
            except CasConflict:
                return RepinResult(PinMatch.NOT_MATCHED, None)
            result, pin, lease = await self._fill_pending(
                pair, pending, pending_revision, edge_id, now
            )
            if result is AdmissionResult.ALREADY_PINNED:
                return RepinResult(PinMatch.NOT_MATCHED, None)
            if result is not AdmissionResult.ADMITTED:
                try:
                    restored = await self._kv.update(
                        key, expected_pin.value.to_json(), pending_revision
                    )
                except CasConflict:
                    return RepinResult(PinMatch.NOT_MATCHED, None)
                return RepinResult(
                    PinMatch.MATCHED, Admission(result, Pin(key, restored, expected_pin.value))
                )
            assert pin is not None
            moved = pin
        if expected_pin.pin_slot is not None and not expected_pin.pending:
            old_mk = model_key(expected_pin.model)
            await self._free_pin_slot(
                expected_pin.provider, old_mk, expected_pin.pin_slot, expected_pin.id
            )
        return RepinResult(PinMatch.MATCHED, Admission(AdmissionResult.ADMITTED, moved, lease))

    async def try_admit_request_without_pin(
        self, provider: str, model: str, *, edge_id: str | None = None
    ) -> Admission:
        """A temporary lease in the unreserved slots. A pair without limits needs no lease:
        ADMITTED with lease None (seed: unlimited providers take no lease for such requests)."""
        pair = self._pair(provider, model)
        if pair.limits is None:
            return Admission(AdmissionResult.ADMITTED)
        lease = await self._grant(pair, LeaseKind.TEMPORARY, None, None, edge_id, self._clock())
        if lease is None:
            return Admission(AdmissionResult.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED)
        return Admission(AdmissionResult.ADMITTED, None, lease)

    # ---- lease lifetime --------------------------------------------------------------------

    async def renew_request_lease(self, lease: Lease) -> Lease | None:
        """The renewed lease (new revision), or None if it was lost (expired and reclaimed)."""
        now = self._clock()
        renewed = replace(lease, renewed_at=now)
        try:
            revision = await self._kv.update(
                lease.key, renewed.slot_value().to_json(), lease.revision
            )
        except CasConflict:
            return None
        if lease.slot is not None:
            family = self._pair(lease.provider, lease.model).lease_slots
            if family is not None:
                self.mirror.note(family, lease.slot, revision, lease.lease_id, taken=True)
        return replace(renewed, revision=revision)

    async def release_request_lease(
        self, lease: Lease, refresh_pin: bool, *, pin: Pin | None = None
    ) -> ReleaseResult:
        """Free the lease's slot, then take it off its pin (refreshing the pin if asked).

        `pin`: the pin as the admission left it (a hint): while nobody has written it since,
        unlisting is one CAS without reading it first. LOST: the slot was no longer at the
        lease's revision; nothing at all was changed.
        """
        if not await self._end(lease):
            return ReleaseResult.LOST
        if lease.pin_id is not None and lease.session is not None:
            key = pin_key(model_key(lease.model), lease.session)
            await self._unlist(
                key,
                lease.pin_id,
                (lease.lease_id,),
                refresh_at=self._clock() if refresh_pin else None,
                hint=pin,
            )
        return ReleaseResult.RELEASED

    # ---- reaper primitives -----------------------------------------------------------------

    async def expire_leases(self, now: float) -> list[ReaperAction]:
        """Reclaim every lease not renewed within lease_timeout of `now`, and unlist it."""
        actions: list[ReaperAction] = []
        for entry, parsed, value in _decoded(await self._kv.list(LEASE_PREFIX), LeaseSlotValue):
            if not isinstance(parsed, LeaseSlotKey | UnlimitedLeaseKey):
                continue
            if not lease_is_expired(value, now, self.lease_timeout):
                continue
            if isinstance(parsed, LeaseSlotKey):
                family = self.mirror.family(lease_prefix(parsed.provider, parsed.mk))
                revision = await self._free_slot(family, entry.key, parsed.index, entry.revision)
            else:
                revision = await self._delete(entry.key, entry.revision)
            if revision is None:
                continue  # renewed, released or reclaimed meanwhile
            model = self._model_name(parsed.mk)
            actions.append(
                ReaperAction(
                    ReaperActionKind.LEASE_EXPIRED,
                    entry.key,
                    revision,
                    parsed.provider,
                    model,
                    value.session,
                    value.pin_id,
                    value.lease_id,
                )
            )
            if value.pin_id is not None and value.session is not None and value.lease_id:
                key = pin_key(parsed.mk, value.session)
                unlisted = await self._unlist(key, value.pin_id, (value.lease_id,))
                if unlisted is not None:
                    actions.append(
                        ReaperAction(
                            ReaperActionKind.LEASE_UNLISTED,
                            key,
                            unlisted,
                            parsed.provider,
                            model,
                            value.session,
                            value.pin_id,
                            value.lease_id,
                        )
                    )
        return actions

    async def expire_pins(self, now: float) -> list[ReaperAction]:
        """Delete every pin without leases idle for pin_inactivity_timeout; free its pin slot."""
        actions: list[ReaperAction] = []
        for entry, parsed, pin in _decoded(await self._kv.list(PIN_PREFIX), PinValue):
            if not isinstance(parsed, PinKey) or pin.pending:
                continue  # a pending pin is repair's business, not expiry's
            if not pin_is_idle_expired(pin, now, self.pin_inactivity_timeout):
                continue
            revision = await self._delete(entry.key, entry.revision)
            if revision is None:
                continue  # a request took a lease on it (or refreshed it) meanwhile
            actions.append(
                ReaperAction(
                    ReaperActionKind.PIN_EXPIRED,
                    entry.key,
                    revision,
                    pin.provider,
                    pin.model,
                    pin.session,
                    pin.pin_id,
                )
            )
            if pin.pin_slot is not None:
                freed = await self._free_pin_slot(pin.provider, parsed.mk, pin.pin_slot, pin.pin_id)
                if freed is not None:
                    actions.append(
                        ReaperAction(
                            ReaperActionKind.PIN_SLOT_FREED,
                            pin_slot_key(pin.provider, parsed.mk, pin.pin_slot),
                            freed,
                            pin.provider,
                            pin.model,
                            pin.session,
                            pin.pin_id,
                        )
                    )
        return actions

    async def repair(self, now: float, grace: float) -> list[ReaperAction]:
        """Undo what operations that died half-way left behind.

        - a pin slot taken for longer than `grace` whose pin is missing or is another pin: free
          (an admission or repin died before writing its pin, or an expiry before freeing it);
        - a lease listed in a pin whose slot is free or holds another lease: unlist (a release
          or an expiry died before unlisting);
        - a pending pin older than lease_timeout: delete (its creator died or stalls; if it
          resumes, its activation CAS fails and it gives back what it took).
        Reads are ordered so no repair acts on an operation still in progress: abandoned pending
        pins go first (so their slots are freed in the same pass); then pin slots are read before
        pins (a pin, pending or active, is written before the slot that names it, so a slot
        whose pin is missing from a later read is orphaned for good, however slow its writer);
        pins before leases (a lease is listed after its slot is taken). `grace` only delays
        freeing; safety does not depend on it.
        """
        actions: list[ReaperAction] = []
        for entry, _, pin in _decoded(await self._kv.list(PIN_PREFIX), PinValue):
            if pin.pending and now >= pin.refreshed_at + self.lease_timeout:
                revision = await self._delete(entry.key, entry.revision)
                if revision is not None:
                    actions.append(
                        ReaperAction(
                            ReaperActionKind.ABANDONED_PIN_DELETED,
                            entry.key,
                            revision,
                            pin.provider,
                            pin.model,
                            pin.session,
                            pin.pin_id,
                        )
                    )
        pin_slots = _decoded(await self._kv.list(PIN_SLOT_PREFIX), PinSlotValue)
        pins = _decoded(await self._kv.list(PIN_PREFIX), PinValue)
        leases = _decoded(await self._kv.list(LEASE_PREFIX), LeaseSlotValue)
        # A slot stays its pin's while the pin key names it, as the pin or as the pin a
        # pending move replaces (written back if the move fails).
        owners = {(entry.key, pin.pin_id) for entry, _, pin in pins}
        owners |= {(entry.key, pin.replaces) for entry, _, pin in pins if pin.replaces}
        for entry, parsed, slot in pin_slots:
            if not isinstance(parsed, PinSlotKey) or not slot.is_taken or slot.session is None:
                continue
            if slot.at is not None and now < slot.at + grace:
                continue
            if (pin_key(parsed.mk, slot.session), slot.pin_id) in owners:
                continue
            family = self.mirror.family(pin_slot_prefix(parsed.provider, parsed.mk))
            revision = await self._free_slot(family, entry.key, parsed.index, entry.revision)
            if revision is not None:
                actions.append(
                    ReaperAction(
                        ReaperActionKind.ORPHAN_PIN_SLOT_FREED,
                        entry.key,
                        revision,
                        parsed.provider,
                        self._model_name(parsed.mk),
                        slot.session,
                        slot.pin_id,
                    )
                )
        holders = {entry.key: value.lease_id for entry, _, value in leases if value.is_taken}
        for entry, _, pin in pins:
            ended = [
                lease_id
                for lease_id, lease_key in pin.leases.items()
                if holders.get(lease_key) != lease_id
            ]
            if not ended:
                continue
            revision = await self._unlist(entry.key, pin.pin_id, ended)
            if revision is not None:
                actions.extend(
                    ReaperAction(
                        ReaperActionKind.LEASE_UNLISTED,
                        entry.key,
                        revision,
                        pin.provider,
                        pin.model,
                        pin.session,
                        pin.pin_id,
                        lease_id,
                    )
                    for lease_id in ended
                )
        return actions

    async def usage(self, now: float | None = None) -> Usage:
        """Pins, pin slots and leases per provider/model pair, read from the bucket now."""
        at = self._clock() if now is None else now
        pin_slots = _decoded(await self._kv.list(PIN_SLOT_PREFIX), PinSlotValue)
        pins = _decoded(await self._kv.list(PIN_PREFIX), PinValue)
        leases = _decoded(await self._kv.list(LEASE_PREFIX), LeaseSlotValue)
        counts: dict[tuple[str, str], Counter[str]] = {pm: Counter() for pm in self.limits}
        for _, _, pin in pins:
            counts.setdefault((pin.provider, pin.model), Counter())["pins"] += 1
        for _, parsed, slot in pin_slots:
            if isinstance(parsed, PinSlotKey) and slot.is_taken:
                pm = (parsed.provider, self._model_name(parsed.mk))
                counts.setdefault(pm, Counter())["pin_slots"] += 1
        for _, parsed, lease in leases:
            if isinstance(parsed, LeaseSlotKey | UnlimitedLeaseKey) and lease.is_taken:
                counter = counts.setdefault(
                    (parsed.provider, self._model_name(parsed.mk)), Counter()
                )
                counter["leases"] += 1
                counter[f"kind:{lease.kind}"] += 1
                counter["expired"] += lease_is_expired(lease, at, self.lease_timeout)
        pairs = [
            PairUsage(
                provider,
                model,
                self.limits.get((provider, model)),
                pins=c["pins"],
                pin_slots_taken=c["pin_slots"],
                leases=c["leases"],
                leases_by_kind={k.value: c[f"kind:{k}"] for k in LeaseKind},
                expired_leases=c["expired"],
            )
            for (provider, model), c in sorted(counts.items())
        ]
        return Usage(at, pairs)

    # ---- steps -----------------------------------------------------------------------------

    def _pair(self, provider: str, model: str) -> _Pair:
        pair = self._pairs.get((provider, model))
        if pair is not None:
            return pair
        mk = model_key(model)
        self._models_by_mk.setdefault(mk, model)
        limits = self.limits.get((provider, model))
        pin_slots = lease_slots = None
        if limits is not None:
            pin_slots = self.mirror.add_family(
                pin_slot_prefix(provider, mk), limits.max_pinned_sessions, "pin_id"
            )
            lease_slots = self.mirror.add_family(
                lease_prefix(provider, mk), limits.max_global_in_flight_request_slots, "lease_id"
            )
        pair = _Pair(provider, model, mk, limits, pin_slots, lease_slots)
        self._pairs[(provider, model)] = pair
        return pair

    def _model_name(self, mk: str) -> str:
        return self._models_by_mk.get(mk, mk)

    async def _take_slot(
        self, family: SlotFamily, ranges: Sequence[range], value: bytes, owner: str
    ) -> tuple[int, int] | None:
        """(index, revision) of a slot taken with `value`, or None if none looks free.

        Picks a random slot the mirror believes free and CASes from the mirror's revision; on a
        conflict it refreshes that key and tries another.
        """
        tried: set[int] = set()
        attempts = 0
        for slots in ranges:
            while attempts < _MAX_SLOT_ATTEMPTS:
                index = choose_slot(family.taken, slots, tried, self._rng)
                if index is None:
                    break
                tried.add(index)
                attempts += 1
                key = family.key(index)
                expected = family.revision(index)
                try:
                    if expected == 0:
                        revision = await self._kv.create(key, value)
                    else:
                        revision = await self._kv.update(key, value, expected)
                except CasConflict:
                    self.cas_conflicts += 1
                    entry = await self._kv.get(key)
                    if entry is None:
                        self.mirror.note(family, index, 0, None, taken=False)
                    else:
                        self.mirror.observe(entry)
                    continue
                self.mirror.note(family, index, revision, owner, taken=True)
                return index, revision
        return None

    async def _take_pin_slot(
        self, family: SlotFamily, session: str, pin_id: str, now: float
    ) -> tuple[int, int] | None:
        value = PinSlotValue.taken(session, pin_id, now).to_json()
        return await self._take_slot(family, (range(family.size),), value, pin_id)

    async def _give_back_pin_slot(self, pair: _Pair, taken: tuple[int, int] | None) -> None:
        if taken is not None and pair.pin_slots is not None:
            index, revision = taken
            await self._free_slot(pair.pin_slots, pair.pin_slots.key(index), index, revision)

    async def _grant(
        self,
        pair: _Pair,
        kind: LeaseKind,
        session: str | None,
        pin_id: str | None,
        edge_id: str | None,
        now: float,
    ) -> Lease | None:
        """A new lease of `kind` on the pair, or None if no allowed slot is free."""
        lease_id = new_token(self._rng)
        edge = self.instance_id if edge_id is None else edge_id
        value = LeaseSlotValue.taken(
            lease_id, kind, session=session, pin_id=pin_id, edge_id=edge, granted_at=now
        ).to_json()
        if pair.lease_slots is None or pair.limits is None:
            key = unlimited_lease_key(pair.provider, pair.mk, lease_id)
            revision = await self._kv.create(key, value)
            return Lease(
                key,
                revision,
                lease_id,
                kind,
                pair.provider,
                pair.model,
                session,
                pin_id,
                edge,
                now,
                now,
                None,
            )
        family = pair.lease_slots
        taken = await self._take_slot(family, lease_slot_ranges(pair.limits, kind), value, lease_id)
        if taken is None:
            return None
        index, revision = taken
        return Lease(
            family.key(index),
            revision,
            lease_id,
            kind,
            pair.provider,
            pair.model,
            session,
            pin_id,
            edge,
            now,
            now,
            index,
        )

    async def _end(self, lease: Lease) -> bool:
        """Free the lease's slot (delete its record) at the lease's revision; False if lost."""
        if lease.slot is None:
            return await self._delete(lease.key, lease.revision) is not None
        family = self._pair(lease.provider, lease.model).lease_slots
        return await self._free_slot(family, lease.key, lease.slot, lease.revision) is not None

    async def _free_slot(
        self, family: SlotFamily | None, key: str, index: int, revision: int
    ) -> int | None:
        try:
            freed = await self._kv.update(key, _FREE, revision)
        except CasConflict:
            return None
        if family is not None:
            self.mirror.note(family, index, freed, None, taken=False)
        return freed

    async def _delete(self, key: str, revision: int) -> int | None:
        try:
            return await self._kv.delete(key, revision)
        except CasConflict:
            return None

    async def _free_pin_slot(self, provider: str, mk: str, index: int, pin_id: str) -> int | None:
        """Free pin slot `index` only while it still names `pin_id`; the revision, or None."""
        key = pin_slot_key(provider, mk, index)
        family = self.mirror.family(pin_slot_prefix(provider, mk))
        trust_mirror = family is not None and family.owner(index) == pin_id
        for _ in range(_MAX_PIN_ATTEMPTS):
            if trust_mirror and family is not None:
                revision = family.revision(index)
                trust_mirror = False
            else:
                entry = await self._kv.get(key)
                if entry is None:
                    return None
                self.mirror.observe(entry)
                try:
                    slot = PinSlotValue.from_json(entry.value)
                except ValueFormatError:
                    return None
                if not slot.is_taken or slot.pin_id != pin_id:
                    return None
                revision = entry.revision
            freed = await self._free_slot(family, key, index, revision)
            if freed is not None:
                return freed
        return None

    async def _unlist(
        self,
        key: str,
        pin_id: str,
        lease_ids: Collection[str],
        *,
        refresh_at: float | None = None,
        hint: Pin | None = None,
    ) -> int | None:
        """Remove `lease_ids` from pin `pin_id` at `key` (and refresh it if asked).

        Retries on conflict while the key still holds that pin. Returns the revision written,
        or None if nothing needed writing (pin gone, replaced, or already without them).
        `hint`, a recent read of the pin, saves the first read (the CAS still decides).
        """
        for _ in range(_MAX_PIN_ATTEMPTS):
            if hint is not None and hint.key == key:
                current, hint = hint, None
            else:
                current = _pin(await self._kv.get(key))
            if current is None or current.id != pin_id:
                return None
            value = current.value
            if any(lease_id in value.leases for lease_id in lease_ids):
                value = replace(
                    value, leases={k: v for k, v in value.leases.items() if k not in lease_ids}
                )
            if refresh_at is not None:
                value = value.refreshed(refresh_at)
            if value == current.value:
                return None
            try:
                return await self._kv.update(key, value.to_json(), current.revision)
            except CasConflict:
                continue
        return None


def _pin(entry: KVEntry | None) -> Pin | None:
    if entry is None:
        return None
    return Pin(entry.key, entry.revision, PinValue.from_json(entry.value))


class _Codec(Protocol[_V]):
    def from_json(self, raw: bytes) -> _V: ...


def _decoded(entries: Sequence[KVEntry], codec: _Codec[_V]) -> list[tuple[KVEntry, ParsedKey, _V]]:
    """(entry, parsed key, value) of each entry that decodes; others are skipped (the history
    checker reports layout breaches; the reaper must not stop on one)."""
    decoded: list[tuple[KVEntry, ParsedKey, _V]] = []
    for entry in entries:
        try:
            decoded.append((entry, parse_key(entry.key), codec.from_json(entry.value)))
        except (KeyFormatError, ValueFormatError):
            continue
    return decoded
