"""Admission keeps a session on its engine replica (bounded-load consistent hashing)."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest
from rig import ENDPOINTS, MODEL, open_rig

from llmgw.wire import AdmitReply, AdmitRequest


@pytest.fixture
async def rig(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, enabled=False)
    yield rig
    await rig.close()


async def place(rig, session: str | None, *, end: bool = True) -> str:
    """Admit one request of `session`; with `end`, it also ends (as the edge would announce)."""
    request = AdmitRequest(
        request_id=uuid.uuid4().hex,
        edge_id="edge-test",
        model=MODEL,
        feature="chat",
        session_id=session,
    )
    reply: AdmitReply = await rig.admissions[0].decide(request)
    assert reply.admitted and reply.target.provider == "iris"
    if end:
        rig.admissions[0].load.request_ended(reply.target.endpoint, reply.granted_at, time.time())
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


async def test_a_busy_replica_sends_its_sessions_next_door(rig):
    await rig.report_all(running=0, capacity=8)
    session = "a" * 32
    home = await place(rig, session)
    other = next(e for e in ENDPOINTS if e != home)
    # The home replica runs 7 (not saturated: capacity 8), the other 1: the bound is
    # ceil(1.25 * (8 + 1) / 2) = 6, so the session spills to the other replica.
    await rig.report(home, running=7, capacity=8)
    await rig.report(other, running=1, capacity=8)
    assert await place(rig, session) == other
