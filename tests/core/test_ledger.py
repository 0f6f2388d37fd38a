"""The ledger: every operation keeps the quotas, the session limit and its indexes exact.

A hypothesis state machine drives random sequences of everything an owner does (grants of each
kind, releases, renewals, expiry, pins created, moved, evicted and expired, quotas raised and
lowered, shards handed out and taken in) and checks every invariant of the module docstring
after each step, against a recount from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.core.ledger import CapacityError, EndReason, LeaseKind, Ledger, PairUse, Room
from llmgw.core.quota import Quota


@dataclass(frozen=True)
class Limits:
    max_pinned_sessions: int = 4
    max_global_in_flight_request_slots: int = 6
    global_in_flight_request_slots_reserved_for_pinned_sessions: int = 2
    max_per_session_in_flight_request_slots: int = 2


LIMITED = ("iris", "m")
OPEN = ("tx", "m")
SESSIONS = [f"{i:032x}" for i in range(8)]
ENDPOINTS = ["e1", "e2"]


def ledger() -> Ledger:
    return Ledger({LIMITED: Limits(), OPEN: None}, lease_timeout=30, pin_inactivity_timeout=300)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = ledger()
        self.now = 0.0
        self.ids = 0
        self.ledger.set_quota(LIMITED, Quota(4, 3, 3))
        self.away = []  # shard states taken out (to bring back)

    def _id(self) -> str:
        self.ids += 1
        return f"{self.ids:016x}"

    @rule(dt=st.floats(0, 50))
    def tick(self, dt):
        self.now += dt

    @rule(
        session=st.sampled_from(SESSIONS),
        pair=st.sampled_from([LIMITED, OPEN]),
        shard=st.integers(0, 3),
    )
    def create_pin(self, session, pair, shard):
        if self.ledger.pin(pair[1], session) is not None:
            return
        room = self.ledger.room(*pair)
        try:
            pin = self.ledger.create_pin(
                f"pin.{shard}.{session}", self._id(), *pair, session, shard, self.now
            )
        except CapacityError:
            assert not room.pin
            return
        assert room.pin and pin.leases == set()

    @rule(
        session=st.sampled_from(SESSIONS),
        kind=st.sampled_from(list(LeaseKind)),
        endpoint=st.sampled_from(ENDPOINTS),
        listed=st.booleans(),
        edge=st.sampled_from("ab"),
    )
    def grant(self, session, kind, endpoint, listed, edge):
        pin = self.ledger.pin("m", session)
        if kind is LeaseKind.TEMPORARY or not listed or pin is None:
            pin, pair, shard = None, LIMITED, 0
        else:
            pair, shard = (pin.provider, pin.model), pin.shard
        room = self.ledger.room(*pair)
        full = pin is not None and self.ledger.session_full(pin)
        before = len(pin.leases) if pin is not None else 0
        try:
            lease = self.ledger.grant(
                self._id(),
                *pair,
                kind,
                shard=shard,
                edge=edge,
                now=self.now,
                session=session,
                pin=pin,
                endpoint=endpoint,
            )
        except CapacityError:
            ok = room.pinned if kind is LeaseKind.PINNED else room.unreserved
            assert not ok or full
            return
        assert not full
        if pin is not None:
            assert lease.lease_id in pin.leases and len(pin.leases) == before + 1

    @precondition(lambda self: self.ledger.leases)
    @rule(data=st.data(), refresh=st.booleans())
    def release(self, data, refresh):
        lease_id = data.draw(st.sampled_from(sorted(self.ledger.leases)))
        assert self.ledger.release(lease_id, self.now, refresh=refresh) is not None
        assert self.ledger.release(lease_id, self.now, refresh=refresh) is None  # exactly once

    @rule(edge=st.sampled_from("ab"), shard=st.integers(0, 3), data=st.data())
    def renew(self, edge, shard, data):
        mine = sorted(
            i for i, x in self.ledger.leases.items() if x.edge == edge and x.shard == shard
        )
        listed = data.draw(st.lists(st.sampled_from([*mine, "ffffffffffffffff"]), unique=True))
        lost = self.ledger.renew(edge, shard, listed, self.now, settle=5.0)
        assert "ffffffffffffffff" not in listed or "ffffffffffffffff" in lost
        for lease_id in mine:
            if lease_id not in listed and lease_id in self.ledger.leases:
                assert self.now - self.ledger.leases[lease_id].granted_at < 5.0

    @rule()
    def expire(self):
        for lease in self.ledger.expired_leases(self.now):
            assert self.now >= lease.renewed_at + 30
        for pin in self.ledger.idle_pins(self.now):
            assert not pin.leases
            self.ledger.remove_pin(pin, self.now, "expired")

    @rule(min_idle=st.floats(0, 100))
    def evict(self, min_idle):
        pin = self.ledger.evictable(*LIMITED, self.now, min_idle)
        if pin is not None:  # a one-shot pin goes as soon as it is idle, any other after min_idle
            assert not pin.leases and (pin.uses <= 1 or self.now - pin.last_used >= min_idle)
            self.ledger.remove_pin(pin, self.now, "evicted")
        else:  # nothing idle qualifies
            for key in self.ledger.pins:
                other = self.ledger.pins[key]
                if (other.provider, other.model) == LIMITED and not other.leases:
                    assert other.uses > 1 and self.now - other.last_used < min_idle

    @precondition(lambda self: self.ledger.pins)
    @rule(data=st.data(), to=st.sampled_from([LIMITED, OPEN]))
    def move(self, data, to):
        key = data.draw(st.sampled_from(sorted(self.ledger.pins)))
        pin = self.ledger.pins[key]
        if (pin.provider, pin.model) == to:
            return
        room = self.ledger.room(*to)
        try:
            moved = self.ledger.move_pin(pin, self._id(), to[0], self.now)
        except CapacityError:
            assert not room.pin
            return
        assert moved.leases == set() and self.ledger.pin(*key) is moved

    @precondition(lambda self: self.ledger.pins)
    @rule(data=st.data())
    def removing_a_busy_pin_is_refused(self, data):
        pin = self.ledger.pins[data.draw(st.sampled_from(sorted(self.ledger.pins)))]
        if pin.leases:
            with pytest.raises(CapacityError):
                self.ledger.remove_pin(pin, self.now, "evicted")

    @rule(g=st.integers(0, 6), u=st.integers(0, 4), p=st.integers(0, 4))
    def set_quota(self, g, u, p):
        use = self.ledger.pair_use(LIMITED)
        g, p = max(g, use.leases), max(p, use.pins)
        u = min(max(u, use.unreserved), g)  # the keeper never lowers a quota below use
        self.ledger.set_quota(LIMITED, Quota(g, u, p))

    @rule(shard=st.integers(0, 3))
    def hand_out(self, shard):
        state = self.ledger.take_shard(shard, self.now, EndReason.MOVED)
        assert not self.ledger.shard_state(shard).pins and not self.ledger.shard_state(shard).leases
        if state.pins or state.leases:
            self.away.append(state)

    @precondition(lambda self: self.away)
    @rule()
    def take_back(self):
        state = self.away.pop()
        refused, refused_pins = self.ledger.add_shard(state, self.now)
        for lease in state.leases:
            assert (lease.lease_id in self.ledger.leases) != (lease in refused)
        for pin in state.pins:
            assert (self.ledger.pin(pin.model, pin.session) is not None) != (pin in refused_pins)

    @invariant()
    def counts_match_a_recount(self):
        ledger = self.ledger
        for pair in (LIMITED, OPEN):
            leases = [x for x in ledger.leases.values() if x.pair == pair]
            use = ledger.pair_use(pair)
            assert use.leases == len(leases)
            assert use.unreserved == sum(x.unreserved for x in leases)
            assert use.pins == sum(1 for p in ledger.pins.values() if (p.provider, p.model) == pair)
        for endpoint in ENDPOINTS:
            assert ledger.endpoint_leases(endpoint) == sum(
                1 for x in ledger.leases.values() if x.endpoint == endpoint
            )

    @invariant()
    def quotas_and_the_session_limit_hold(self):
        ledger = self.ledger
        quota = ledger.pair_quota(LIMITED)
        use = ledger.pair_use(LIMITED)
        assert use.leases <= quota.g and use.unreserved <= quota.u and use.pins <= quota.p
        for pin in ledger.pins.values():
            if (pin.provider, pin.model) == LIMITED:
                assert len(pin.leases) <= Limits.max_per_session_in_flight_request_slots
            for lease_id in pin.leases:
                assert ledger.leases[lease_id].pin_id == pin.pin_id

    @invariant()
    def every_pin_and_lease_is_in_exactly_one_shard(self):
        ledger = self.ledger
        shard_leases = [x for s in ledger.shards() for x in ledger.shard_state(s).leases]
        shard_pins = [p for s in ledger.shards() for p in ledger.shard_state(s).pins]
        assert sorted(x.lease_id for x in shard_leases) == sorted(ledger.leases)
        assert len(shard_pins) == len(ledger.pins)

    @invariant()
    def idle_pins_are_exactly_those_without_leases(self):
        ledger = self.ledger
        evictable = set()
        for pair in (LIMITED, OPEN):
            while True:
                pin = ledger.evictable(*pair, float("inf"), 0)
                if pin is None or (pin.model, pin.session) in evictable:
                    break
                evictable.add((pin.model, pin.session))
                break
        for key in evictable:
            assert not ledger.pins[key].leases


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_pinned_lease_takes_the_reserve_first_and_new_leases_never_do():
    lg = ledger()
    lg.set_quota(LIMITED, Quota(g=3, u=1, p=2))  # reserve at this instance: g - u = 2
    pin = lg.create_pin("pin.0.s", "p1", *LIMITED, "s", 0, 0.0)
    first = lg.grant(
        "l1", *LIMITED, LeaseKind.NEW_PIN, shard=0, edge="e", now=0, session="s", pin=pin
    )
    assert first.unreserved and not lg.room(*LIMITED).unreserved
    second = lg.grant(
        "l2", *LIMITED, LeaseKind.PINNED, shard=0, edge="e", now=0, session="s", pin=pin
    )
    assert not second.unreserved  # from the reserve
    with pytest.raises(CapacityError, match="unreserved"):
        lg.grant("l3", *LIMITED, LeaseKind.TEMPORARY, shard=0, edge="e", now=0)


def test_pinned_leases_beyond_this_instances_share_of_the_reserve_never_count_against_u():
    # g - u = 1 here, but the reserve R is the pair's, not this instance's: two pinned leases
    # use lease quota only, so u stays whole for new sessions (and lendable to a peer's). New
    # sessions are still held to new <= u and everything to leases <= g, as one instance
    # holding the whole limit holds them.
    lg = ledger()
    lg.set_quota(LIMITED, Quota(g=4, u=3, p=3))
    pin = lg.create_pin("pin.0.s", "p1", *LIMITED, "s", 0, 0.0)
    for lease_id in ("l1", "l2"):
        lease = lg.grant(
            lease_id, *LIMITED, LeaseKind.PINNED, shard=0, edge="e", now=0, session="s", pin=pin
        )
        assert not lease.unreserved
    assert lg.pair_use(LIMITED).unreserved == 0
    lg.grant("l3", *LIMITED, LeaseKind.TEMPORARY, shard=0, edge="e", now=0)
    lg.grant("l4", *LIMITED, LeaseKind.TEMPORARY, shard=0, edge="e", now=0)
    assert lg.pair_use(LIMITED) == PairUse(4, 2, 1)
    room = lg.room(*LIMITED)
    assert not room.pinned and not room.unreserved  # g = 4 leases live


def test_renewal_reports_lost_leases_and_ends_the_unlisted_old_ones():
    lg = ledger()
    lg.set_quota(LIMITED, Quota(4, 4, 4))
    old = lg.grant("a" * 16, *LIMITED, LeaseKind.TEMPORARY, shard=1, edge="edge", now=0.0)
    young = lg.grant("b" * 16, *LIMITED, LeaseKind.TEMPORARY, shard=1, edge="edge", now=9.5)
    lost = lg.renew("edge", 1, ["c" * 16], 10.0, settle=2.0)
    assert lost == ["c" * 16]
    assert old.lease_id not in lg.leases  # its end message was lost: ended now
    assert young.lease_id in lg.leases  # may still be on its way to the edge


def test_expiry_ends_leases_not_renewed_and_a_pin_outlives_its_last_lease_by_its_timeout():
    lg = ledger()
    lg.set_quota(LIMITED, Quota(4, 4, 4))
    pin = lg.create_pin("pin.0.s", "p1", *LIMITED, "s", 0, 0.0)
    lg.grant("l1", *LIMITED, LeaseKind.NEW_PIN, shard=0, edge="e", now=0.0, session="s", pin=pin)
    assert lg.expired_leases(29.9) == [] and [x.lease_id for x in lg.expired_leases(30.0)] == ["l1"]
    assert lg.idle_pins(299.0) == [] and lg.idle_pins(300.0) == [pin]


def test_a_pair_given_limits_counts_its_running_leases_and_grants_from_quota():
    lg = ledger()
    pin = lg.create_pin("pin.0.s", "p1", *OPEN, "s", 0, 0.0)
    lg.grant("a", *OPEN, LeaseKind.PINNED, shard=0, edge="e", now=0.0, pin=pin)
    lg.grant("b", *OPEN, LeaseKind.TEMPORARY, shard=0, edge="e", now=0.0)
    assert lg.pair_use(OPEN).unreserved == 0  # no limits: nothing is unreserved
    lg.keep_limits(OPEN, Limits())
    use = lg.pair_use(OPEN)
    assert (use.leases, use.unreserved, use.pins) == (2, 1, 1)  # the temporary one
    assert lg.room(*OPEN) == Room(False, False, False)  # no quota yet
    lg.set_quota(OPEN, Quota(3, 3, 1))
    assert lg.room(*OPEN) == Room(True, True, False)
    lg.release("b", 1.0, refresh=True)
    assert (use.leases, use.unreserved) == (1, 0)  # it ends as it counts now, once
    lg.drop_limits(OPEN)
    assert lg.room(*OPEN) == Room(True, True, True) and lg.pair_quota(OPEN) is None


def test_pins_above_the_quota_are_evicted_together_to_make_room_for_one():
    lg = ledger()
    lg.set_quota(LIMITED, Quota(6, 4, 4))
    for n, session in enumerate(SESSIONS[:4]):
        lg.create_pin(f"pin.0.{session}", f"p{n}", *LIMITED, session, 0, 0.0)
    assert len(lg.to_evict(*LIMITED, 1.0, 60.0)) == 1  # at its quota: one makes room
    lg.set_quota(LIMITED, Quota(6, 4, 2))  # held above it: three must go for one more
    assert [p.pin_id for p in lg.to_evict(*LIMITED, 1.0, 60.0)] == ["p0", "p1", "p2"]
    lg.set_quota(LIMITED, Quota(6, 4, 0))
    assert lg.to_evict(*LIMITED, 1.0, 60.0) == []  # five would have to go: only four can


def test_a_sub_agents_pin_keeps_its_parent_when_it_moves_and_when_its_shard_does():
    lg = ledger()
    lg.set_quota(LIMITED, Quota(4, 4, 4))
    pin = lg.create_pin("pin.0.c", "p1", *LIMITED, "c", 0, 0.0, parent="root")
    assert pin.parent == "root" and lg.pin("m", "c").parent == "root"
    moved = lg.move_pin(pin, "p2", "tx", 1.0)
    assert moved.parent == "root" and moved.pin_id == "p2"
    state = lg.take_shard(0, 2.0, EndReason.MOVED)
    other = ledger()
    other.add_shard(state, 2.0)
    assert other.pin("m", "c").parent == "root"
    assert lg.create_pin("pin.0.d", "p3", *OPEN, "d", 0, 3.0).parent is None


def _served(lg: Ledger, pin, now: float, times: int) -> None:  # type: ignore[no-untyped-def]
    """`pin` serves `times` requests, one after another, each ending well at `now`."""
    for n in range(times):
        lease_id = f"{pin.pin_id}-{now}-{n}"
        lg.grant(
            lease_id, *LIMITED, LeaseKind.PINNED, shard=0, edge="e", now=now,
            session=pin.session, pin=pin,
        )  # fmt: skip
        lg.release(lease_id, now, refresh=True)


def test_eviction_finds_the_least_recently_used_candidate_past_recent_conversations():
    """Conversations idle for less than min_idle are no candidates, however many; among the
    candidates (one-shots, and conversations idle long enough) the least recently used goes
    first. The idle index's heap stays within twice its pins, however often they are used."""
    lg = ledger()
    lg.set_quota(LIMITED, Quota(8, 8, 1000))
    pins = [lg.create_pin(f"pin.0.c{i}", f"c{i}", *LIMITED, f"c{i}", 0, 0.0) for i in range(500)]
    for n, pin in enumerate(pins):  # 500 conversations, used at t = 0 .. 99.8
        _served(lg, pin, n * 0.2, 2)
    assert lg.evictable(*LIMITED, 100.0, 60.0) is pins[0]  # idle since t = 0
    for n, pin in enumerate(pins):  # each used again, at t = 100 .. 199.8
        _served(lg, pin, 100 + n * 0.2, 1)
    assert lg.evictable(*LIMITED, 200.0, 150.0) is None  # none idle 150 s
    once = lg.create_pin("pin.0.o", "o", *LIMITED, "o", 0, 200.0)
    _served(lg, once, 200.0, 1)
    assert lg.evictable(*LIMITED, 201.0, 150.0) is once  # a one-shot goes at once
    assert lg.evictable(*LIMITED, 260.0, 150.0) is pins[0]  # idle since t = 100: older
    lg.set_quota(LIMITED, Quota(8, 8, 501))  # the table full: one goes
    assert [p.pin_id for p in lg.to_evict(*LIMITED, 260.0, 150.0)] == ["c0"]
    lg.set_quota(LIMITED, Quota(8, 8, 499))  # above a lowered quota: three go
    assert [p.pin_id for p in lg.to_evict(*LIMITED, 260.0, 150.0)] == ["c0", "c1", "c2"]
    heap = lg._idle[LIMITED]._heap  # entries of pins used since are dropped in bulk
    assert len(heap) <= 2 * len(pins) + 64
