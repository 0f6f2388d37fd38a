"""The audit checker over hand-made trails: what an instance that stopped or crashed still held
leaves the count, and a real breach is still caught around it."""

from __future__ import annotations

from llmgw.core.ledger import EndReason, LeaseKind, LeaseRecord, PinRecord
from llmgw.core.quota import Quota
from llmgw.state.checker import AuditLog, check_audit


class Limits:
    max_pinned_sessions = 2
    max_global_in_flight_request_slots = 8
    global_in_flight_request_slots_reserved_for_pinned_sessions = 2
    max_per_session_in_flight_request_slots = 2


LIMITS = {("a", "m"): Limits()}


class Clock:
    t = 0.0

    def __call__(self) -> float:
        Clock.t += 1.0
        return Clock.t


def pin(session: str, pin_id: str) -> PinRecord:
    return PinRecord(f"pin.0.m.{session}", pin_id, "a", "m", session, 0, 0.0, 0.0, 0.0, 0.0)


def add(log: AuditLog, instance: str, session: str, pin_id: str) -> None:
    log.observer(instance).pin_added(pin(session, pin_id), 0.0, Quota(8, 6, 2), 0)


def check(log: AuditLog) -> list:
    return check_audit(log.events, LIMITS, lease_timeout=5.0)


def test_a_stopped_instances_leftover_pins_leave_the_count():
    log = AuditLog(clock=Clock())
    add(log, "g", "s1", "p1")
    add(log, "g", "s2", "p2")
    log.stopped("g")  # it released the shard: s1 and s2 are only in the bucket now
    add(log, "r", "s1", "p3")  # the adopter refused s1's pin; the session pins again
    add(log, "r", "s3", "p4")
    assert check(log) == []


def test_pins_beyond_p_are_still_caught_next_to_a_stopped_instance():
    log = AuditLog(clock=Clock())
    add(log, "g", "s1", "p1")
    log.stopped("g")
    add(log, "r", "s2", "p2")
    add(log, "r", "s3", "p3")
    add(log, "x", "s4", "p4")  # three live pins on P=2
    found = check(log)
    assert [v.invariant for v in found] == ["I2d"]
    assert "s2" in found[0].context and "s4" in found[0].context  # who held what
    add(log, "g", "s5", "p5")  # a stopped instance that still decides is counted again
    assert [v.invariant for v in check(log)] == ["I2d", "I2d"]


def test_two_live_pins_of_one_session_are_caught_with_the_first_one_named():
    log = AuditLog(clock=Clock())
    add(log, "g", "s1", "p1")
    add(log, "r", "s1", "p2")
    found = check(log)
    assert [v.invariant for v in found] == ["I3"]
    assert "p1" in found[0].context


def lease(lease_id: str, key: str = "k1") -> LeaseRecord:
    return LeaseRecord(
        lease_id, "a", "m", LeaseKind.TEMPORARY, True, 0, "edge", 0.0, 0.0, key=key, key_limit=1
    )


def grant(log: AuditLog, instance: str, lease_id: str) -> None:
    log.observer(instance).lease_granted(lease(lease_id), None, (0, 0, 0))


def test_a_lease_granted_while_its_instance_was_being_killed_counts_until_lease_timeout():
    """A kill is not instantaneous: a decision in flight may land after the crash is recorded.
    Its edge (if it got the reply) ends it within lease_timeout of the grant, as for the
    instance's other leases: counted until then, not forever, and not less."""
    Clock.t = 0.0
    log = AuditLog(clock=Clock())
    log.crash("g")  # t=1
    grant(log, "g", "late")  # t=2: live until t=7 (lease_timeout 5)
    grant(log, "r", "early")  # t=3: a second live lease of a key limited to 1
    found = check(log)
    assert [v.invariant for v in found] == ["IK"]
    assert "late at g (crashed at 1.000), since 2.000" in found[0].context
    Clock.t = 10.0
    grant(log, "r", "after")  # t=11: the late one is over; "early" is still live
    assert [v.invariant for v in check(log)] == ["IK", "IK"]
    log.observer("r").lease_ended(lease("early"), EndReason.RELEASED, 0.0)
    grant(log, "r", "alone")  # t=13: "after" and "alone" on a limit of 1
    assert [v.invariant for v in check(log)] == ["IK", "IK", "IK"]
