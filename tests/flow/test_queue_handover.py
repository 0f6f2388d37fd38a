"""A stopping admission instance hands its queued requests back, and its leases over, with
nothing lost or left behind.

On SIGTERM an instance hands its shards to the others; every request waiting in its queue for
one of them is answered NOT_OWNER and its edge asks the shard's new owner, where it queues
again (or is granted) with a full request timeout of its own, however long it had waited
before (services/edge/admission_client.py). Here requests wait longer than
``nats.request_timeout`` in the instance that stops: the other instance grants them all.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rig import MODEL, admitted, open_rig
from test_flow_control import open_headroom, saturate
from timing import eventually

from llmgw.wire import RequestEnded


@pytest.fixture
async def rig2(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, instances=2)
    yield rig
    await rig.close()


async def test_requests_queued_at_a_stopping_instance_are_granted_by_the_next_owner(rig2):
    rig = rig2
    leaving, staying = rig.cluster.admissions
    shard = rig.shard_of_instance(leaving.service)
    await saturate(rig)  # bronze waits: no ceiling room, and bronze never overflows
    tasks = [asyncio.create_task(rig.ask(band="bronze", shard=shard, timeout=30)) for _ in range(4)]
    await eventually(lambda: len(leaving.service.flow.queues) == 4, what="queued at the leaver")
    # Longer than one request timeout in its queue: the new owner must still get a full one.
    await asyncio.sleep(rig.config.nats.request_timeout + 0.5)
    assert not any(t.done() for t in tasks)

    await leaving.stop()
    await eventually(lambda: len(staying.service.flow.queues) == 4, what="queued at the new owner")
    assert shard in staying.service.shards.serving
    while not all(t.done() for t in tasks):
        await open_headroom(rig)
    replies = [t.result() for t in tasks]
    assert all(admitted(r) for r in replies), replies
    assert {r.owner for r in replies} == {staying.service.instance}


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data


async def test_an_end_that_overtakes_its_leases_handover_leaves_nothing_behind(rig2):
    """The edge's end message reaches the receiver while the shard is in flight (the giver has
    taken the lease out, the receiver does not hold it yet): the receiver remembers it and
    does not take the ended lease in with the shard, so nothing waits for lease_timeout."""
    rig = rig2
    leaving, staying = rig.cluster.admissions
    shard = rig.shard_of_instance(leaving.service)
    await rig.report_all(running=0, capacity=8)
    reply = await rig.ask(band="gold", shard=shard)
    assert admitted(reply) and reply.owner == leaving.service.instance
    lease = reply.lease
    assert lease is not None
    ended = RequestEnded(
        id=reply.id,
        edge="edge-test",
        lease=lease.lease_id,
        shard=shard,
        ok=True,
        outcome="success",
        model=MODEL,
        provider=reply.target.provider,
        endpoint=reply.target.endpoint,
        ended_at=time.time(),
        sent=True,
    )
    # Delivered to the receiver alone, as when it overtakes the handover (the giver, which
    # still holds the lease, would release it: that is the ordinary path).
    await staying.service.on_request_ended(_Msg(ended.model_dump_json().encode()))
    assert lease.lease_id in leaving.service.ledger.leases

    await leaving.stop()  # the shard goes to `staying` with the lease in its state
    await eventually(lambda: shard in staying.service.shards.serving, what="the shard handed over")
    assert lease.lease_id not in staying.service.ledger.leases
    assert not staying.service.ledger.leases
