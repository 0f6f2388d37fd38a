"""Several admission instances are as generous as one: a share used up is borrowed, not offloaded.

Each instance grants within its own quota of a pair (ADR 0002). When its share cannot take a
request that the pair's limits could, the instance borrows first (what nobody holds, by CAS of
the book, or what a peer holds idle, lent by that peer in one CAS) and places the request in
the turn the loan lands. A lone instance holding the whole limit is the reference: with two
instances the same requests must land on the managed provider, the reserve for pinned sessions
must serve every pinned session whatever instance owns it, and the audit checker must find no
grant beyond a quota or a limit.
"""

from __future__ import annotations

import asyncio

import pytest
from rig import BINDING_LIMITS, MODEL, admitted, open_rig
from timing import eventually

from llmgw.core.shards import shard_of
from llmgw.state.checker import AuditLog, check_audit

PAIR = ("iris", MODEL)
LIMITS = BINDING_LIMITS
G = LIMITS["max_global_in_flight_request_slots"]
R = LIMITS["global_in_flight_request_slots_reserved_for_pinned_sessions"]


@pytest.fixture
async def rig2(nats_url, unique_id):
    audit = AuditLog()
    rig = await open_rig(nats_url, unique_id, 2, limits=LIMITS, observer_for=audit.observer)
    rig.audit = audit  # type: ignore[attr-defined]
    await rig.report_all(running=0, capacity=32)  # idle engines: flow control lets all through
    yield rig
    await rig.close()


def _sessions_at(rig, service, n: int, prefix: str) -> list[str]:  # type: ignore[no-untyped-def]
    """`n` session ids whose shards `service` serves."""
    shards = rig.config.admission.shards
    found, i = [], 0
    while len(found) < n:
        session = f"{prefix}-{i}"
        if service.shards.serves(shard_of(session, shards)):
            found.append(session)
        i += 1
    return found


def _checked(rig) -> None:  # type: ignore[no-untyped-def]
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])


async def test_one_instance_takes_the_whole_unreserved_limit_when_the_other_is_idle(rig2):
    rig = rig2
    a, b = rig.admissions
    await eventually(lambda: b.quotas.books[PAIR].value.quota(b.instance).u > 0, what="b's share")
    shard = rig.shard_of_instance(a)
    # Sessionless requests at one instance: a lone instance would run G - R of them on iris.
    replies = [await rig.ask(shard=shard) for _ in range(G - R)]
    assert all(admitted(r) for r in replies)
    assert [r.target.provider for r in replies] == ["iris"] * (G - R), [
        r.target.provider for r in replies
    ]
    assert a.quotas.loans.rounds["free"] + a.quotas.loans.rounds["lent"] >= 1
    # The unreserved limit is reached across the pair: the next one goes to the third party.
    extra = await rig.ask(shard=shard)
    assert admitted(extra) and extra.target.provider == "tensorx"
    total = sum(s.ledger.pair_use(PAIR).unreserved for s in rig.admissions)
    assert total == G - R
    _checked(rig)


async def test_concurrent_requests_at_one_instance_share_a_round_of_loans(rig2):
    rig = rig2
    a, _ = rig.admissions
    shard = rig.shard_of_instance(a)
    replies = await asyncio.gather(*(rig.ask(shard=shard) for _ in range(G - R)))
    providers = [r.target.provider for r in replies if admitted(r)]
    assert providers == ["iris"] * (G - R), providers
    _checked(rig)


async def test_the_reserve_serves_pinned_sessions_whatever_instance_owns_them(rig2):
    rig = rig2
    a, b = rig.admissions
    # R + 1 sessions pinned at `a` (their first turns, then ended), more than a's share of R.
    sessions = _sessions_at(rig, a, R + 1, "pinned")
    for session in sessions:
        first = await rig.ask(session=session)
        assert admitted(first) and first.target.provider == "iris"
    await rig.finish_all()
    # The unreserved part is used up at `b` (sessionless requests), so pinned turns need R.
    shard_b = rig.shard_of_instance(b)
    fill = [await rig.ask(shard=shard_b) for _ in range(G - R)]
    assert [r.target.provider for r in fill] == ["iris"] * (G - R)
    # Every pinned turn at `a` runs on its pin while the reserve and leases allow: R of them.
    turns = [await rig.ask(session=session) for session in sessions]
    routes = [(r.target.provider, r.route) for r in turns]
    assert routes[:R] == [("iris", "pinned")] * R, routes
    assert routes[R] == ("tensorx", "temporary"), routes  # G leases live: a lone one would too
    live = sum(s.ledger.pair_use(PAIR).leases for s in rig.admissions)
    assert live == G
    _checked(rig)


async def test_a_peer_that_lent_nothing_is_asked_again_once_one_of_its_requests_ends(rig2):
    rig = rig2
    a, b = rig.admissions
    await eventually(lambda: b.quotas.books[PAIR].value.quota(b.instance).u > 0, what="b's share")
    held = await rig.ask(shard=rig.shard_of_instance(b))
    assert admitted(held) and held.target.provider == "iris"
    await eventually(lambda: a.load.inflight(held.target.endpoint, a._clock()) >= 1, what="gossip")
    # `a` asked `b` a moment ago and got nothing: `b` is left out of a's loans for a while...
    a.quotas.loans._dry[(PAIR, b.instance)] = a.quotas.loans._monotonic() + 3600
    # ... until b's request ends (its load gossip shows one fewer): then it is asked at once.
    await rig.finish_all()
    await eventually(lambda: (PAIR, b.instance) not in a.quotas.loans._dry, what="b asked again")


@pytest.fixture
async def rig_pins(nats_url, unique_id):
    audit = AuditLog()
    limits = {**LIMITS, "max_pinned_sessions": 4}
    rig = await open_rig(nats_url, unique_id, 2, limits=limits, observer_for=audit.observer)
    rig.audit = audit  # type: ignore[attr-defined]
    await rig.report_all(running=0, capacity=32)
    yield rig
    await rig.close()


async def test_a_full_pin_table_at_a_peer_lends_its_idle_pins_as_a_lone_instance_evicts(rig_pins):
    rig = rig_pins
    a, b = rig.admissions
    # Every pin of the pair is held at `b` by one-shot sessions (served once, now idle).
    for session in _sessions_at(rig, b, 4, "one-shot"):
        reply = await rig.ask(session=session)
        assert admitted(reply) and reply.target.provider == "iris", reply
    await rig.finish_all()
    assert b.ledger.pair_use(PAIR).pins == 4
    # A new session at `a`: a lone instance would evict an idle pin and pin it on iris.
    (session,) = _sessions_at(rig, a, 1, "new")
    reply = await rig.ask(session=session)
    assert (reply.target.provider, reply.route) == ("iris", "new_pin"), reply
    assert b.ledger.pair_use(PAIR).pins == 3 and a.ledger.pair_use(PAIR).pins == 1
    _checked(rig)
