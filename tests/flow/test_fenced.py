"""A fenced admission instance decides nothing, not even a request that was waiting in its queue
when it fenced itself; and the audit trail records its fence, so the checker does not count the
pins it can no longer use.

An instance stops deciding once its last heartbeat is `fence_after` old, so that nobody who
takes its shards for dead (after `member_ttl`) decides beside it. The requests it answers on
arrival are checked, but the flow-control tick used to place a queued request without asking
whether the instance still owned its shard: a loaded instance whose heartbeat was late went on
placing its queued requests while another instance had claimed and adopted the shard, and the
mesh soak once saw two live pins of one session (I3). The first test drives that interleaving:
the instance's heartbeats hang; the other instance claims its shard once its key has aged out
and pins the session there; then the engines report room and the fenced instance's tick runs
the queued request of the session. It must hand it back (NOT_OWNER: its edge asks the owner)
instead of pinning the session a second time.

The second is the checker's side of the same moment: a pin the fenced instance made just
before its fence, whose write has not reached the bucket, is not found by the shard's next
owner, which pins the session again. Only one of the two pins is in use (the fenced instance
decides nothing), but without the fence in the audit trail the checker took both for live.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from rig import admitted, open_rig
from timing import eventually

from llmgw.core.shards import shard_of
from llmgw.state.checker import AuditLog, check_audit

LIMITS = {
    "max_pinned_sessions": 100,
    "max_global_in_flight_request_slots": 100,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 10,
    "max_per_session_in_flight_request_slots": 10,
}


class _Held:
    """An instance's store whose calls named `held` wait until `go` is set (heartbeats or pin
    writes that a loaded host or a stalled connection delays); everything else goes straight
    through."""

    def __init__(self, store, *held: str) -> None:  # type: ignore[no-untyped-def]
        self._store, self._held = store, held
        self.go = asyncio.Event()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        call = getattr(self._store, name)
        if name not in self._held:
            return call

        async def held(*args, **kwargs):  # type: ignore[no-untyped-def]
            await self.go.wait()
            return await call(*args, **kwargs)

        return held


@contextlib.asynccontextmanager
async def _stalled(instance):  # type: ignore[no-untyped-def]
    """`instance`'s pin writes and heartbeats held (`_Held`) until the test lets them go, and
    let go at the end whatever happened."""
    writes = instance.pins.store = _Held(instance.pins.store, "create_pin", "update_pin", "get_pin")
    heartbeats = instance.membership.store = _Held(instance.membership.store, "renew_member")
    try:
        yield writes, heartbeats
    finally:
        writes.go.set()
        heartbeats.go.set()


def _parts(rig):  # type: ignore[no-untyped-def]
    """The instance to fence, the other one, and a session of a shard the first one serves."""
    fenced, owner = (a.service for a in rig.cluster.admissions)
    shards = rig.config.admission.shards
    session = next(
        s
        for s in (f"conversation-{i}" for i in range(1000))
        if shard_of(s, shards) in fenced.shards.serving
    )
    return fenced, owner, session, shard_of(session, shards)


@pytest.fixture
async def rig(nats_url, unique_id):
    audit = AuditLog()
    # member_ttl 3 s: fenced 1.5 s after its last heartbeat, taken for dead at 3 s.
    rig = await open_rig(
        nats_url, unique_id, 2, limits=LIMITS, observer_for=audit.observer, member_ttl="3s"
    )
    rig.audit = audit  # type: ignore[attr-defined]
    yield rig
    await rig.close()


async def test_a_fenced_instance_hands_back_its_queued_requests_instead_of_placing_them(rig):
    fenced, owner, session, shard = _parts(rig)
    # Saturation 0.5 (KV half full): bronze (ceiling 0.3) waits, gold (0.85) is placed.
    await rig.report_all(running=0, kv_usage=0.45)
    queued = asyncio.create_task(rig.ask(band="bronze", session=session, timeout=30))
    await eventually(lambda: len(fenced.flow.queues) == 1, what="queued at the instance")

    fenced.membership.store = _Held(fenced.membership.store, "renew_member")  # never lands
    await eventually(lambda: not fenced.membership.can_serve(), timeout=5, what="the fence")
    await eventually(lambda: shard in owner.shards.serving, timeout=10, what="the claim")
    # The owner decides the session: pinned on our engines.
    pinned = await owner.decide(rig.request(band="gold", session=session))
    assert admitted(pinned) and pinned.owner == owner.instance, pinned
    assert owner.ledger.pin(pinned.served_model, session) is not None

    await rig.report_all(running=0, kv_usage=0.1)  # room: the fenced instance's tick runs
    reply = await queued
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])
    assert not fenced.ledger.leases, "a fenced instance granted a queued request"
    # Handed back, asked again: the owner grants it on the session's pin.
    assert admitted(reply) and reply.owner == owner.instance, reply


async def test_a_pin_a_fenced_instance_could_not_write_is_no_second_live_pin(rig):
    fenced, owner, session, shard = _parts(rig)
    await rig.report_all(running=0, kv_usage=0.1)
    async with _stalled(fenced) as (_writes, heartbeats):
        first = await fenced.decide(rig.request(band="gold", session=session))
        assert admitted(first) and first.owner == fenced.instance, first
        await eventually(lambda: not fenced.membership.can_serve(), timeout=5, what="the fence")
        await eventually(lambda: shard in owner.shards.serving, timeout=10, what="the claim")
        assert owner.ledger.pin(first.served_model, session) is None  # no copy in the bucket
        again = await owner.decide(rig.request(band="gold", session=session))
        assert admitted(again) and again.route == "new_pin", again

        heartbeats.go.set()  # its heartbeat lands, late: it learns it is lost
        await eventually(
            lambda: any(e.kind == "fenced" for e in rig.audit.events), what="the fence recorded"
        )
        [fence] = [e for e in rig.audit.events if e.kind == "fenced"]
        added = [e for e in rig.audit.events if e.kind == "pin_added"]
        assert [e.instance for e in added] == ["admission-0", "admission-1"]
        assert added[0].at < fence.at < added[1].at  # stamped when it stopped deciding
        violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
        assert violations == [], "\n".join(str(v) for v in violations[:3])


async def test_a_pin_write_a_lost_instance_queued_does_not_land_after_it_dropped_the_shard(rig):
    """The pin write of the fenced instance is stalled (a slow connection) while the shard's
    next owner pins the session again. Once the fenced instance has dropped the shard, its
    stalled write goes on: it must not land (its conflict path reads the key and writes over
    it), or the bucket's copy names a pin nobody holds and the owner's is lost."""
    fenced, owner, session, shard = _parts(rig)
    await rig.report_all(running=0, kv_usage=0.1)
    async with _stalled(fenced) as (writes, heartbeats):
        first = await fenced.decide(rig.request(band="gold", session=session))
        assert admitted(first) and first.owner == fenced.instance, first
        # The session's second request: its pin's (deferred) first write is queued, and stalls.
        second = await fenced.decide(rig.request(band="gold", session=session))
        assert admitted(second) and second.route == "pinned", second
        model = first.served_model
        key = fenced.ledger.pin(model, session).key
        await eventually(lambda: not fenced.membership.can_serve(), timeout=5, what="the fence")
        await eventually(lambda: shard in owner.shards.serving, timeout=10, what="the claim")
        again = await owner.decide(rig.request(band="gold", session=session))
        assert admitted(again) and again.route == "new_pin", again
        back = await owner.decide(rig.request(band="gold", session=session))  # written now
        assert admitted(back) and back.route == "pinned", back
        ours = owner.ledger.pin(model, session)
        await owner.pins.drain([key])
        assert (await owner.pins.store.get_pin(key)).value.pin_id == ours.pin_id

        heartbeats.go.set()  # it learns it is lost, and drops the shard
        await eventually(lambda: fenced.ledger.pin(model, session) is None, what="the drop")
        writes.go.set()  # its stalled write goes on
        await fenced.pins.drain()
        stored = await owner.pins.store.get_pin(key)
        assert stored is not None and stored.value.pin_id == ours.pin_id, stored
        assert owner.ledger.pin(model, session) is ours
