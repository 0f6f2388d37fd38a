"""A slow receiver of a handover: the giver never spends the shard's quota twice.

The giver of a shard sets the quota its pins and leases use aside and earmarks it in the quota
books; the receiver moves the earmark to itself as it takes the shard in. Here the receiver is
slow (its quota transfer lands seconds after the giver's handover request timed out, as on a
loaded host), and the giver keeps deciding for its other shards meanwhile. Before earmarks, the
giver made the set-aside quota spendable again a fixed time after the timeout, and the late
transfer then moved it a second time: 6 pins on P=5 (the mesh soak's rare I2d). The audit
checker, fed by both ledgers, must find nothing, and the pins held must stay within P.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rig import MODEL, open_rig
from timing import eventually

from llmgw.core.quota import NO_COUNTS
from llmgw.core.shards import desired_owner, shard_of
from llmgw.services.admission.earmarks import Earmarks
from llmgw.state.checker import AuditLog, check_audit

P = 5
LIMITS = {
    "max_pinned_sessions": P,
    "max_global_in_flight_request_slots": 200,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
    "max_per_session_in_flight_request_slots": 4,
}
GIVER, RECEIVER = "admission-0", "admission-1"
SLOW = 5.0  # the receiver's transfer lands this long after it starts: past any giver timeout


def _sessions(shards: int, moving: bool, n: int, start: int = 0) -> list[str]:
    """`n` sessions of one shard that moves to the receiver when it joins, or of shards that
    stay with the giver."""
    found: list[str] = []
    i = start
    while len(found) < n:
        session = f"conversation-{i}"
        k = shard_of(session, shards)
        if (desired_owner(k, [GIVER, RECEIVER]) == RECEIVER) == moving and (
            not moving or not found or shard_of(found[0], shards) == k
        ):
            found.append(session)
        i += 1
    return found


def _pins(service) -> int:  # type: ignore[no-untyped-def]
    return service.ledger.pair_use(("iris", MODEL)).pins


@pytest.fixture
async def rig(nats_url, unique_id, monkeypatch):
    audit = AuditLog()
    transfer = Earmarks.transfer
    slow = {"on": True}

    async def slow_transfer(self, source, target, counts, *args, **kwargs):  # type: ignore[no-untyped-def]
        if (
            slow["on"]
            and self.keeper.me == RECEIVER
            and counts.get(("iris", MODEL), NO_COUNTS).pins
        ):
            await asyncio.sleep(SLOW)  # the shard with the pins
        return await transfer(self, source, target, counts, *args, **kwargs)

    monkeypatch.setattr(Earmarks, "transfer", slow_transfer)
    rig = await open_rig(nats_url, unique_id, limits=LIMITS, observer_for=audit.observer)
    rig.audit = audit  # type: ignore[attr-defined]
    yield rig
    slow["on"] = False  # the shards' way back at the end need not wait
    await rig.close()


async def test_a_slow_receiver_never_lets_the_giver_spend_the_shards_quota_twice(rig):
    shards = rig.config.admission.shards
    await rig.report_all(running=0, capacity=16)
    giver = rig.admissions[0]
    # The giver holds all P pins: 3 of sessions of a shard that will move, 2 that stay.
    for session in _sessions(shards, True, 3) + _sessions(shards, False, 2):
        reply = await rig.ask(session=session)
        assert reply.target is not None and reply.target.provider == "iris", reply
    assert _pins(giver) == P  # their leases stay live: no pin is idle, none can be evicted

    joined = asyncio.create_task(rig.cluster.add_admission(RECEIVER))
    # New sessions keep asking the giver (shards it keeps) until the receiver has the moved
    # pins, past the point where the giver's handover timed out and well past its retry.
    moved = shard_of(_sessions(shards, True, 1)[0], shards)
    fresh = iter(_sessions(shards, False, 1_000, start=10_000))
    deadline = time.monotonic() + SLOW + 10
    while time.monotonic() < deadline:
        await rig.ask(session=next(fresh))
        if joined.done() and moved in joined.result().service.shards.serving:
            break
        await asyncio.sleep(0.05)  # pacing: a new session every 50 ms while the shard moves
    receiver = (await joined).service
    await eventually(lambda: moved in receiver.shards.serving, timeout=15, what="the moved shard")
    for _ in range(10):  # and a few more once the move is done
        await rig.ask(session=next(fresh))

    assert _pins(giver) + _pins(receiver) <= P, (_pins(giver), _pins(receiver))
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])
