"""The audit checker over hand-made trails: what an instance that stopped or crashed still held
leaves the count, and a real breach is still caught around it."""

from __future__ import annotations

from timing import SteppedClock

from llmgw.core.ledger import EndReason, LeaseKind, LeaseRecord, PinRecord
from llmgw.core.quota import Quota, QuotaCounts
from llmgw.state.checker import ENDED_IN_TRANSIT, AuditLog, check_audit


class Limits:
    max_pinned_sessions = 2
    max_global_in_flight_request_slots = 8
    global_in_flight_request_slots_reserved_for_pinned_sessions = 2
    max_per_session_in_flight_request_slots = 2


LIMITS = {("a", "m"): Limits()}


def pin(session: str, pin_id: str) -> PinRecord:
    return PinRecord(f"pin.0.m.{session}", pin_id, "a", "m", session, 0, 0.0, 0.0, 0.0, 0.0)


def add(log: AuditLog, instance: str, session: str, pin_id: str) -> None:
    log.observer(instance).pin_added(pin(session, pin_id), 0.0, Quota(8, 6, 2), 0)


def check(log: AuditLog) -> list:
    return check_audit(log.events, LIMITS, lease_timeout=5.0)


def test_a_stopped_instances_leftover_pins_leave_the_count():
    log = AuditLog(clock=SteppedClock(0.0, tick=1.0).wall)
    add(log, "g", "s1", "p1")
    add(log, "g", "s2", "p2")
    log.stopped("g")  # it released the shard: s1 and s2 are only in the bucket now
    add(log, "r", "s1", "p3")  # the adopter refused s1's pin; the session pins again
    add(log, "r", "s3", "p4")
    assert check(log) == []


def test_pins_beyond_p_are_still_caught_next_to_a_stopped_instance():
    log = AuditLog(clock=SteppedClock(0.0, tick=1.0).wall)
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
    log = AuditLog(clock=SteppedClock(0.0, tick=1.0).wall)
    add(log, "g", "s1", "p1")
    add(log, "r", "s1", "p2")
    found = check(log)
    assert [v.invariant for v in found] == ["I3"]
    assert "p1" in found[0].context


def test_a_fenced_instances_pins_leave_the_count_but_a_pin_it_adds_after_is_caught():
    """Fenced, an instance decides nothing with the pins it holds; the shard's next owner may
    have found no copy of one in the bucket (its write had not landed) and pinned the session
    again. That is no second pin in use: it was reported as I3 before fences were recorded."""
    clock = SteppedClock(0.0, tick=1.0)  # each entry a second after the last
    log = AuditLog(clock=clock.wall)
    add(log, "g", "s1", "p1")  # t=1: its write is still on its way to the bucket
    add(log, "g", "s2", "p2")  # t=2
    log.observer("g").fenced(2.5)  # learnt at its next heartbeat, stamped with the fence
    add(log, "r", "s1", "p3")  # t=4, r claimed the shard: no copy of p1, s1 pins again
    add(log, "r", "s2", "p2")  # t=5: p2's copy adopted
    assert check(log) == []
    add(log, "g", "s1", "p4")  # t=6: a fenced instance that still decides
    found = check(log)
    assert [v.invariant for v in found] == ["I3"]
    assert "added by g while pin p3 lives at r" in found[0].message


def test_a_lease_a_fenced_instance_grants_on_a_pin_it_held_is_caught():
    """Its pins leave the count at its fence, so I2c and I3 no longer see a lease on one: a
    grant on such a pin after the fence is a breach of its own. Before the fence it is not,
    and a lease on a pin it adds after the fence counts like any other."""
    clock = SteppedClock(0.0, tick=1.0)  # each entry a second after the last
    log = AuditLog(clock=clock.wall)
    add(log, "g", "s1", "p1")  # t=1
    on_pin = LeaseRecord(
        "before", "a", "m", LeaseKind.PINNED, False, 0, "edge", 2.0, 2.0, "s1", "p1"
    )
    log.observer("g").lease_granted(on_pin, None, QuotaCounts(0, 0, 1))  # t=2: still deciding
    log.observer("g").fenced(2.5)
    assert check(log) == []
    late = LeaseRecord("late", "a", "m", LeaseKind.PINNED, False, 0, "edge", 3.0, 3.0, "s1", "p1")
    log.observer("g").lease_granted(
        late, None, QuotaCounts(1, 0, 0)
    )  # t=3: a fenced instance decides
    found = check(log)
    assert [v.invariant for v in found] == ["fenced"]
    assert "granted by g on pin p1, which it held when fenced at 2.500" in found[0].message
    add(log, "g", "s2", "p2")  # t=4: pins it adds after its fence count, and so do their leases
    again = LeaseRecord("new", "a", "m", LeaseKind.NEW_PIN, False, 0, "edge", 5.0, 5.0, "s2", "p2")
    log.observer("g").lease_granted(again, None, QuotaCounts(1, 0, 1))
    assert [v.invariant for v in check(log)] == ["fenced"]


def test_a_lease_on_a_pin_a_fenced_instance_adopts_again_after_rejoining_counts():
    """Fenced, an instance drops everything and joins again; a shard it claims then brings the
    bucket's copy of a pin it held at its fence back into its ledger (the same pin id): a lease
    on it from then on is an ordinary grant, not a fenced instance deciding."""
    clock = SteppedClock(0.0, tick=1.0)
    log = AuditLog(clock=clock.wall)
    add(log, "g", "s1", "p1")  # t=1
    log.observer("g").fenced(1.5)
    log.observer("g").pin_removed(pin("s1", "p1"), 2.5, "dropped")  # t=2: dropped on rejoining
    add(log, "g", "s1", "p1")  # t=3: the shard claimed again, p1's copy adopted
    adopted = LeaseRecord("on", "a", "m", LeaseKind.PINNED, False, 0, "edge", 4.0, 4.0, "s1", "p1")
    log.observer("g").lease_granted(adopted, None, QuotaCounts(0, 0, 1))  # t=4
    assert check(log) == []


def test_a_grant_decided_before_the_fence_and_recorded_after_a_stall_is_no_breach():
    """A loaded host stalls the instance between its decision (it could still decide) and the
    trail's record of it; the fence, learnt later, is stamped back before that record. The
    decision's own time says it came first."""
    clock = SteppedClock(0.0, tick=1.0)
    log = AuditLog(clock=clock.wall)
    add(log, "g", "s1", "p1")  # t=1
    stalled = LeaseRecord(
        "stalled", "a", "m", LeaseKind.PINNED, False, 0, "e", 1.4, 1.4, "s1", "p1"
    )
    log.observer("g").lease_granted(stalled, None, QuotaCounts(0, 0, 1))  # recorded at t=2
    log.observer("g").fenced(1.5)  # learnt at t=3, its fence at 1.5: after the decision
    assert check(log) == []


def lease(lease_id: str, key: str = "k1") -> LeaseRecord:
    return LeaseRecord(
        lease_id, "a", "m", LeaseKind.TEMPORARY, True, 0, "edge", 0.0, 0.0, key=key, key_limit=1
    )


def grant(log: AuditLog, instance: str, lease_id: str) -> None:
    log.observer(instance).lease_granted(lease(lease_id), None, QuotaCounts())


def test_a_lease_granted_while_its_instance_was_being_killed_counts_until_lease_timeout():
    """A kill is not instantaneous: a decision in flight may land after the crash is recorded.
    Its edge (if it got the reply) ends it within lease_timeout of the grant, as for the
    instance's other leases: counted until then, not forever, and not less."""
    clock = SteppedClock(0.0, tick=1.0)  # each entry a second after the last
    log = AuditLog(clock=clock.wall)
    log.crash("g")  # t=1
    grant(log, "g", "late")  # t=2: live until t=7 (lease_timeout 5)
    grant(log, "r", "early")  # t=3: a second live lease of a key limited to 1
    found = check(log)
    assert [v.invariant for v in found] == ["IK"]
    assert "late at g (crashed at 1.000), since 2.000" in found[0].context
    clock.now = 10.0
    grant(log, "r", "after")  # t=11: the late one is over; "early" is still live
    assert [v.invariant for v in check(log)] == ["IK", "IK"]
    log.observer("r").lease_ended(lease("early"), EndReason.RELEASED, 0.0)
    grant(log, "r", "alone")  # t=13: "after" and "alone" on a limit of 1
    assert [v.invariant for v in check(log)] == ["IK", "IK", "IK"]


class Halved(Limits):
    max_global_in_flight_request_slots = 4


def numbered(n: int) -> LeaseRecord:
    return LeaseRecord(f"l{n}", "a", "m", LeaseKind.TEMPORARY, False, 0, "e", 0.0, 0.0)


def test_a_grant_after_a_lowered_limit_is_held_to_it_and_older_leases_are_not_revoked():
    clock = SteppedClock(0.0, tick=1.0)  # each entry a second after the last
    log = AuditLog(clock=clock.wall)
    granting = log.observer("i1")
    for n in range(6):  # t = 1..6: six live leases under G = 8
        granting.lease_granted(numbered(n), None, (n, 0, 0))
    lowered = clock.now + 0.5  # G = 4 from here: the six keep running
    changed = [(lowered, {("a", "m"): Halved()})]
    assert check_audit(log.events, LIMITS, lease_timeout=5.0, changed=changed) == []
    for n in range(4):
        granting.lease_ended(numbered(n), EndReason.RELEASED, 0.0)
    granting.lease_granted(numbered(6), None, (2, 0, 0))  # 3 live: within the new G
    assert check_audit(log.events, LIMITS, lease_timeout=5.0, changed=changed) == []
    granting.lease_granted(numbered(7), None, (3, 0, 0))
    granting.lease_granted(numbered(8), None, (4, 0, 0))  # 5 live > 4
    found = check_audit(log.events, LIMITS, lease_timeout=5.0, changed=changed)
    assert [v.invariant for v in found] == ["I2a"] and "G=4" in found[0].message
    assert check_audit(log.events, LIMITS, lease_timeout=5.0) == []  # G = 8 throughout: fine


def test_an_end_recorded_in_transit_counts_where_the_lease_was_held_and_others_do_not():
    """A crashed instance records no end. The instance that takes its shard in records the end
    of a lease its edge ended meanwhile (left out of what it took in): that lease is over, at
    the crashed holder. An ordinary end recorded by an instance that does not hold the lease
    (the giver of a handover, late) ends nothing."""
    clock = SteppedClock(0.0, tick=1.0)
    log = AuditLog(clock=clock.wall)
    for n in range(8):  # G = 8 live leases at g
        log.observer("g").lease_granted(numbered(n), None, (n, 0, 0))
    log.crash("g")
    log.observer("r").lease_ended_in_transit(numbered(0), 0.0)
    log.observer("r").lease_granted(numbered(8), None, (0, 0, 0))  # 8 live: l0 is over
    assert check(log) == []
    log.observer("r").lease_ended(numbered(1), EndReason.RELEASED, 0.0)  # not r's: no end
    log.observer("r").lease_granted(numbered(9), None, (1, 0, 0))
    assert [v.invariant for v in check(log)] == ["I2a"]
    assert [e.reason for e in log.events if e.kind == "ended"] == [ENDED_IN_TRANSIT, "released"]
