"""Admission keeps a session on its engine replica (where its last request ran; a new session
starts where there is most room, ties broken by consistent hashing), with flow control on: the reservation flow control makes is the one placement chose, so it never pushes a
session off its home."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import pytest
from rig import ENDPOINTS, admitted, open_rig

from llmgw.wire import REQUEST_STATS_SUBJECT, FailedAttempt, RequestEnded


@pytest.fixture(params=[True, False], ids=["flow-control-on", "flow-control-off"])
async def rig(nats_url, unique_id, request):
    rig = await open_rig(nats_url, unique_id, enabled=request.param)
    yield rig
    await rig.close()


async def place(rig, session: str, *, end: bool = True) -> str:
    """Admit one request of `session`; with `end`, it also ends (as the edge would announce)."""
    reply = await rig.ask(session=session, band="gold")
    assert admitted(reply) and reply.target.provider == "iris"
    if end:
        message = RequestEnded(
            id=reply.id,
            edge="edge-test",
            lease=reply.lease.lease_id,
            shard=reply.lease.shard,
            refresh=True,
            ok=True,
            outcome="success",
            model="m1",
            provider="iris",
            endpoint=reply.target.endpoint,
            ended_at=time.time(),
        )
        await rig.nc.publish(REQUEST_STATS_SUBJECT, message.model_dump_json().encode())
        await rig.nc.flush()
        service = rig.admissions[0]
        deadline = time.monotonic() + 2
        while reply.lease.lease_id in service.ledger.leases:
            assert time.monotonic() < deadline, "the end never reached admission"
            await rig.nc.flush()
    return reply.target.endpoint


async def test_a_session_keeps_its_replica_and_sessions_spread(rig):
    await rig.report_all(running=0, capacity=8)
    homes = {}
    for n in range(40):
        session = f"{n:032x}"
        homes[session] = {await place(rig, session) for _ in range(3)}
    assert all(len(places) == 1 for places in homes.values())  # each session: one replica
    spread = Counter(next(iter(p)) for p in homes.values())
    assert set(spread) == set(ENDPOINTS) and min(spread.values()) >= 10


async def test_sessions_sent_one_at_a_time_land_on_their_ring_home_from_the_first_request(rig):
    """A regression: flow control used to reserve the least loaded endpoint (a tie: the first)
    and the affinity choice then counted that reservation as load, so no session ever started
    on the first endpoint in config order."""
    await rig.report_all(running=0, capacity=8)
    firsts = Counter()
    for n in range(30):
        firsts[await place(rig, f"{n + 1000:032x}")] += 1
    assert set(firsts) == set(ENDPOINTS) and min(firsts.values()) >= 8, firsts


async def test_a_busy_replica_sends_its_sessions_next_door(rig):
    await rig.report_all(running=0, capacity=8)
    session = "a" * 32
    home = await place(rig, session)
    other = next(e for e in ENDPOINTS if e != home)
    # The home replica runs all its 8 slots and queues 2 (not saturated), the other runs 1: the
    # bound is ceil(1.25 * (10 + 1) * 8 / 16) = 7, so the session spills to the other replica.
    # (With a free slot at home it would stay: leaving costs its prefix cache, gains nothing.)
    await rig.report(home, running=8, waiting=2, capacity=8)
    await rig.report(other, running=1, capacity=8)
    assert await place(rig, session) == other


@contextlib.asynccontextmanager
async def limited_rig(nats_url, unique_id, *, pins: int, per_session: int):
    """A rig whose `iris` has limits (10 requests in flight, 2 reserved), idle engines."""
    limits = {
        "max_pinned_sessions": pins,
        "max_global_in_flight_request_slots": 10,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
        "max_per_session_in_flight_request_slots": per_session,
    }
    rig = await open_rig(nats_url, unique_id, limits=limits)
    try:
        await rig.report_all(running=0, capacity=8)
        yield rig
    finally:
        await rig.close()


async def test_a_retry_never_finds_its_own_session_at_the_limit(nats_url, unique_id):
    """The failed attempt's lease is released with the retry's decision (one step), so a
    session at its in-flight limit retries on its pin, not elsewhere."""
    async with limited_rig(nats_url, unique_id, pins=10, per_session=1) as rig:
        session = "c" * 32
        first = await rig.ask(session=session, band="gold")
        assert admitted(first) and first.target.provider == "iris"
        request = rig.request(session=session, band="gold").model_copy(
            update={
                "retry_of": first.lease.lease_id,
                "failed": FailedAttempt(
                    attempt=first.id,
                    endpoint=first.target.endpoint,
                    outcome="upstream_unreachable",
                ),
            }
        )
        retry, _ = await rig.client.admit(request)
        assert admitted(retry)
        assert (retry.target.provider, retry.route) == ("iris", "pinned"), retry
        assert first.lease.lease_id not in rig.admissions[0].ledger.leases


async def test_a_full_pin_table_evicts_a_one_shot_pin_but_keeps_conversations(nats_url, unique_id):
    """Pins that one-shot traffic cannot exhaust: with the table full, a new session evicts the
    least recently used pin that served one request; a table of conversations (two requests
    each, idle less than min_idle_before_evict) sends it to the third party, counted by why."""
    async with limited_rig(nats_url, unique_id, pins=2, per_session=2) as rig:
        service = rig.admissions[0]
        await place(rig, "1" * 32)  # a one-shot conversation so far
        for _ in range(2):
            await place(rig, "2" * 32)  # a conversation
        await place(rig, "3" * 32)  # evicts 1's pin, not 2's
        pinned = {pin.session for pin in service.ledger.pins.values()}
        assert pinned == {"2" * 32, "3" * 32}
        assert service.metrics.pins_evicted.labels("iris")._value.get() == 1
        await place(rig, "3" * 32)  # now both pins are conversations
        reply = await rig.ask(session="4" * 32, band="gold")
        assert admitted(reply) and (reply.target.provider, reply.route) == ("tensorx", "new_pin")
        offloads = service.metrics.offloads.labels("tensorx", "no_managed_room")._value.get()
        assert offloads == 1
