"""A handover that reaches its receiver after the shard has moved on is taken in by nobody.

G hands shard k to R, but R takes the message in late (its handover subscription busy with
another handover, or a loaded host): R's claim of k stops waiting for it after a second and
adopts k by roll call instead. A third instance N joins and k, which rendezvous hashing now
gives to N, goes from R to N. Only then does R get to G's handover. R no longer has any record
of k, so before it took the old state in as a fresh handover (pins and leases of several
seconds ago) and subscribed to k: two instances decided k's requests, one from an old copy,
until R's next round saw that k's key names N. When N moved a pin R had taken in again, the
checker saw two live pins of one session: the mesh soak's rare I3 ("admission-3 moved a pin
that admission-2 still had").
"""

from __future__ import annotations

import asyncio

import pytest
from rig import EDGE_LIMITS, MODEL, admitted, open_rig
from timing import eventually

from llmgw.core.shards import desired_owner, shard_of
from llmgw.services.admission.shards import Handovers
from llmgw.state.checker import AuditLog, check_audit
from llmgw.wire import Handover

G, R, N = "admission-0", "admission-1", "admission-2"
SHARDS = 8


def _moving_session() -> tuple[str, int]:
    """A session of a shard that G hands to R, and R to N once N has joined."""
    for i in range(1000):
        session = f"conversation-{i}"
        k = shard_of(session, SHARDS)
        if desired_owner(k, [G, R]) == R and desired_owner(k, [G, R, N]) == N:
            return session, k
    raise AssertionError("no such shard")


@pytest.fixture
async def rig(nats_url, unique_id):
    audit = AuditLog()
    rig = await open_rig(
        nats_url, unique_id, limits=EDGE_LIMITS, shards=SHARDS, observer_for=audit.observer
    )
    rig.audit = audit  # type: ignore[attr-defined]
    yield rig
    await rig.close()


async def test_a_handover_that_arrives_after_the_shard_moved_on_is_not_taken_in(rig, monkeypatch):
    session, k = _moving_session()
    await rig.report_all(running=0, capacity=16)
    reply = await rig.ask(session=session)
    assert admitted(reply) and reply.owner == G, reply
    await rig.finish_all()

    late, taken = asyncio.Event(), []
    receive = Handovers.receive

    async def held(self, msg):  # type: ignore[no-untyped-def]
        shard = Handover.model_validate_json(msg.data).state.shard
        if self.ctx.instance != R or shard != k or late.is_set():
            return await receive(self, msg)

        async def later() -> None:
            await late.wait()
            await receive(self, msg)

        taken.append(asyncio.create_task(later()))  # the subscription goes on meanwhile

    monkeypatch.setattr(Handovers, "receive", held)
    r = (await rig.cluster.add_admission()).service
    await eventually(lambda: k in r.shards.serving, timeout=10, what="R adopting k by roll call")
    assert taken, "G's handover of k should be held"
    n = (await rig.cluster.add_admission()).service
    await eventually(
        lambda: k in n.shards.serving and k not in r.shards.serving,
        timeout=10,
        what="k handed on from R to N",
    )

    late.set()  # G's handover of k reaches R now
    await asyncio.wait_for(taken[0], 10)
    # N moves the session's pin (its provider is degraded): one pin of the session, at N.
    n.catalog.forced_degraded.add(("iris", MODEL))
    moved = await n.decide(rig.request(session=session))
    assert admitted(moved) and moved.target.provider == "tensorx", moved
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])
    assert k not in r.shards.serving, "R took an old copy of k in beside its owner"
    assert r.ledger.pin(MODEL, session) is None
    assert k in n.shards.serving
