"""The history checker on hand-built histories: a valid one passes, each breach is reported."""

from __future__ import annotations

from llmgw.config import Limits
from llmgw.core.leasekeys import (
    LeaseKind,
    LeaseSlotValue,
    PinSlotValue,
    PinValue,
    lease_slot_key,
    model_key,
    pin_key,
    pin_slot_key,
    unlimited_lease_key,
)
from llmgw.state import KVEntry, Violation, check_history

MODEL = "llama-3.1-8b"
MK = model_key(MODEL)
LEASE_TIMEOUT = 30.0
# iris and zeus: P=2 pins, G=4 slots of which R=1 reserved, S=2 leases per session.
LIMITS = Limits(
    max_pinned_sessions=2,
    max_global_in_flight_request_slots=4,
    global_in_flight_request_slots_reserved_for_pinned_sessions=1,
    max_per_session_in_flight_request_slots=2,
)
LIMITS_BY_PM = {("iris", MODEL): LIMITS, ("zeus", MODEL): LIMITS, ("ext", MODEL): None}


class History:
    """Builds a bucket history write by write, with revisions as the stream would number them."""

    def __init__(self) -> None:
        self.entries: list[KVEntry] = []

    def write(self, key: str, value: PinValue | PinSlotValue | LeaseSlotValue) -> int:
        revision = len(self.entries) + 1
        self.entries.append(KVEntry(key, value.to_json(), revision))
        return revision

    def delete(self, key: str) -> int:
        revision = len(self.entries) + 1
        self.entries.append(KVEntry(key, b"", revision, deleted=True))
        return revision

    def check(self) -> list[Violation]:
        return check_history(self.entries, LIMITS_BY_PM, LEASE_TIMEOUT)


def lease(
    lease_id: str, kind: LeaseKind, *, pin_id: str | None, at: float, session: str | None = None
) -> LeaseSlotValue:
    return LeaseSlotValue.taken(
        lease_id, kind, session=session, pin_id=pin_id, edge_id="edge-1", granted_at=at
    )


def pin(
    pin_id: str, provider: str, session: str, slot: int | None, leases: dict[str, str], at: float
) -> PinValue:
    return PinValue(
        pin_id=pin_id,
        provider=provider,
        model=MODEL,
        session=session,
        pin_slot=slot,
        leases=leases,
        refreshed_at=at,
    )


def admit_new_pin(
    h: History,
    *,
    provider: str = "iris",
    session: str = "s1",
    pin_id: str = "pinA",
    pslot: int = 0,
    slot: int = 1,
    lease_id: str = "L1",
    at: float = 10.0,
) -> PinValue:
    """Operation 1 on a pair with limits: pin slot, unreserved lease slot, then the pin."""
    h.write(pin_slot_key(provider, MK, pslot), PinSlotValue.taken(session, pin_id, at))
    key = lease_slot_key(provider, MK, slot)
    h.write(key, lease(lease_id, LeaseKind.NEW_PIN, pin_id=pin_id, session=session, at=at))
    value = pin(pin_id, provider, session, pslot, {lease_id: key}, at)
    h.write(pin_key(MK, session), value)
    return value


def invariants(violations: list[Violation]) -> list[str]:
    return [v.invariant for v in violations]


def test_a_valid_history_of_every_operation_passes() -> None:
    h = History()
    pin_a = admit_new_pin(h)  # op 1 on iris
    # op 2: a pinned request may use the reserved slot 0
    h.write(
        lease_slot_key("iris", MK, 0),
        lease("L2", LeaseKind.PINNED, pin_id="pinA", session="s1", at=11.0),
    )
    pin_a = pin_a.with_lease("L2", lease_slot_key("iris", MK, 0))
    h.write(pin_key(MK, "s1"), pin_a)
    # op 6 then op 5: renew L2, release L1 and L2 (slot freed first, then the pin updated)
    h.write(
        lease_slot_key("iris", MK, 0),
        lease("L2", LeaseKind.PINNED, pin_id="pinA", session="s1", at=11.0).renewed(20.0),
    )
    for lease_id, slot in (("L1", 1), ("L2", 0)):
        h.write(lease_slot_key("iris", MK, slot), LeaseSlotValue.free())
        pin_a = pin_a.without_lease(lease_id).refreshed(21.0)
        h.write(pin_key(MK, "s1"), pin_a)
    # op 4: a temporary lease in an unreserved slot, re-granted after being freed
    for lease_id in ("T1", "T2"):
        h.write(
            lease_slot_key("iris", MK, 2),
            lease(lease_id, LeaseKind.TEMPORARY, pin_id=None, at=22.0),
        )
        h.write(lease_slot_key("iris", MK, 2), LeaseSlotValue.free())
    # a pin on the unlimited provider: a per-lease record, deleted on release
    u_key = unlimited_lease_key("ext", MK, "U1")
    h.write(u_key, lease("U1", LeaseKind.NEW_PIN, pin_id="pinB", session="s2", at=23.0))
    pin_b = pin("pinB", "ext", "s2", None, {"U1": u_key}, 23.0)
    h.write(pin_key(MK, "s2"), pin_b)
    h.delete(u_key)
    h.write(pin_key(MK, "s2"), pin_b.without_lease("U1"))
    # op 3: repin s1 from iris to zeus, then free the old pin slot
    h.write(pin_slot_key("zeus", MK, 0), PinSlotValue.taken("s1", "pinC", 30.0))
    zeus_slot = lease_slot_key("zeus", MK, 1)
    h.write(zeus_slot, lease("L3", LeaseKind.NEW_PIN, pin_id="pinC", session="s1", at=30.0))
    pin_c = pin("pinC", "zeus", "s1", 0, {"L3": zeus_slot}, 30.0)
    h.write(pin_key(MK, "s1"), pin_c)
    h.write(pin_slot_key("iris", MK, 0), PinSlotValue.free())
    # op 7: the reaper frees an expired lease, unlists it, deletes the idle pin, frees its slot
    h.write(zeus_slot, LeaseSlotValue.free())
    h.write(pin_key(MK, "s1"), pin_c.without_lease("L3"))
    h.delete(pin_key(MK, "s1"))
    h.write(pin_slot_key("zeus", MK, 0), PinSlotValue.free())
    # both pin slots of iris in use at once is within P=2
    admit_new_pin(h, session="s3", pin_id="pinD", pslot=0, slot=1, lease_id="L4", at=40.0)
    admit_new_pin(h, session="s4", pin_id="pinE", pslot=1, slot=2, lease_id="L5", at=40.0)

    assert h.check() == []


def test_a_lease_slot_beyond_the_global_slots_is_reported() -> None:
    h = History()
    revision = h.write(
        lease_slot_key("iris", MK, 4), lease("T1", LeaseKind.TEMPORARY, pin_id=None, at=1.0)
    )
    (violation,) = h.check()
    assert (violation.invariant, violation.revision) == ("I2a", revision)
    assert violation.key == lease_slot_key("iris", MK, 4)
    assert "max_global_in_flight_request_slots 4" in violation.message
    assert "iris/llama-3.1-8b" in violation.message


def test_more_taken_leases_than_global_slots_is_reported() -> None:
    h = History()
    for slot in range(4):
        h.write(
            lease_slot_key("iris", MK, slot),
            lease(f"L{slot}", LeaseKind.PINNED, pin_id="p", at=1.0),
        )
    # a per-lease record on a pair with limits bypasses the slots: the fifth lease
    revision = h.write(
        unlimited_lease_key("iris", MK, "L9"), lease("L9", LeaseKind.PINNED, pin_id="p", at=1.0)
    )
    found = {(v.invariant, v.revision) for v in h.check()}
    assert found == {("layout", revision), ("I2a", revision)}


def test_a_non_pinned_lease_in_a_reserved_slot_is_reported() -> None:
    h = History()
    revision = h.write(
        lease_slot_key("iris", MK, 0), lease("T1", LeaseKind.NEW_PIN, pin_id="p", at=1.0)
    )
    (violation,) = h.check()
    assert (violation.invariant, violation.revision) == ("I2b", revision)
    assert "reserved slot 0" in violation.message and "new_pin" in violation.message


def test_a_pin_listing_more_leases_than_the_per_session_limit_is_reported() -> None:
    h = History()
    value = admit_new_pin(h)
    value = value.with_lease("L2", lease_slot_key("iris", MK, 2))
    assert h.check() == []
    h.write(pin_key(MK, "s1"), value)  # 2 leases: the limit
    revision = h.write(pin_key(MK, "s1"), value.with_lease("L3", lease_slot_key("iris", MK, 3)))
    (violation,) = h.check()
    assert (violation.invariant, violation.revision) == ("I2c", revision)
    assert "3 leases > max_per_session_in_flight_request_slots 2" in violation.message


def test_more_pin_slots_than_max_pinned_sessions_is_reported() -> None:
    h = History()
    h.write(pin_slot_key("iris", MK, 0), PinSlotValue.taken("s1", "p1", 1.0))
    h.write(pin_slot_key("iris", MK, 1), PinSlotValue.taken("s2", "p2", 1.0))
    revision = h.write(pin_slot_key("iris", MK, 2), PinSlotValue.taken("s3", "p3", 1.0))
    messages = {v.message for v in h.check() if (v.invariant, v.revision) == ("I2d", revision)}
    assert messages == {
        "pin slot index 2 >= max_pinned_sessions 2 of iris/llama-3.1-8b",
        "3 taken pin slots on iris/llama-3.1-8b > max_pinned_sessions 2",
    }


def test_a_pin_whose_pin_slot_is_freed_while_it_lives_is_reported() -> None:
    h = History()
    admit_new_pin(h)
    revision = h.write(pin_slot_key("iris", MK, 0), PinSlotValue.free())  # before the pin is gone
    (violation,) = h.check()
    assert (violation.invariant, violation.revision) == ("I2d", revision)
    assert "released while that pin" in violation.message


def test_a_taken_lease_slot_overwritten_by_another_lease_is_a_double_grant() -> None:
    h = History()
    key = lease_slot_key("iris", MK, 2)
    h.write(key, lease("L1", LeaseKind.TEMPORARY, pin_id=None, at=1.0))
    h.write(key, lease("L1", LeaseKind.TEMPORARY, pin_id=None, at=1.0).renewed(5.0))  # fine
    revision = h.write(key, lease("L2", LeaseKind.TEMPORARY, pin_id=None, at=40.0))
    (violation,) = h.check()
    assert (violation.invariant, violation.key, violation.revision) == (
        "double-grant",
        key,
        revision,
    )
    assert "lease L1 overwritten by lease L2" in violation.message


def test_a_taken_pin_slot_overwritten_by_another_pin_is_a_double_grant() -> None:
    h = History()
    key = pin_slot_key("iris", MK, 0)
    h.write(key, PinSlotValue.taken("s1", "p1", 1.0))
    revision = h.write(key, PinSlotValue.taken("s2", "p2", 2.0))
    assert ("double-grant", revision) in {(v.invariant, v.revision) for v in h.check()}


def test_a_pin_deleted_while_listing_a_live_lease_is_reported() -> None:
    h = History()
    admit_new_pin(h, at=10.0)  # lease L1 renewed at 10, live until 40
    h.write(pin_slot_key("iris", MK, 1), PinSlotValue.taken("other", "pX", 25.0))  # now = 25
    revision = h.delete(pin_key(MK, "s1"))
    (violation,) = h.check()
    assert (violation.invariant, violation.key, violation.revision) == (
        "I-expiry",
        pin_key(MK, "s1"),
        revision,
    )
    assert (
        "pin pinA deleted while listing leases ['L1']; live among them: ['L1']" == violation.message
    )


def test_messages_name_the_invariant_revision_and_key() -> None:
    h = History()
    h.write(lease_slot_key("iris", MK, 0), lease("T1", LeaseKind.TEMPORARY, pin_id=None, at=1.0))
    (violation,) = h.check()
    assert str(violation).startswith(f"[I2b] revision 1, key {lease_slot_key('iris', MK, 0)}: ")


def test_undecodable_values_and_disordered_revisions_are_reported() -> None:
    entries = [
        KVEntry(pin_key(MK, "s1"), b"{not json", 1),
        KVEntry(lease_slot_key("iris", MK, 2), b'{"v":2,"state":"free"}', 2),
        KVEntry("pin.not-a-model-key.s1", b"{}", 3),
        KVEntry("other.namespace", b"ignored", 4),
        KVEntry(lease_slot_key("iris", MK, 2), LeaseSlotValue.free().to_json(), 4),
    ]
    found = [(v.invariant, v.revision) for v in check_history(entries, LIMITS_BY_PM, 30.0)]
    assert found == [("layout", 1), ("layout", 2), ("layout", 3), ("order", 4)]


def test_pairs_without_known_limits_are_not_limit_checked() -> None:
    h = History()
    h.write(lease_slot_key("iris", MK, 9), lease("T", LeaseKind.TEMPORARY, pin_id=None, at=1.0))
    assert check_history(h.entries, {}, LEASE_TIMEOUT) == []
