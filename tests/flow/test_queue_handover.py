"""A stopping admission instance hands its queued requests back: none is lost.

On SIGTERM an instance hands its shards to the others; every request waiting in its queue for
one of them is answered NOT_OWNER and its edge asks the shard's new owner, where it queues
again (or is granted) with a full request timeout of its own, however long it had waited
before (services/edge/admission_client.py). Here requests wait longer than
``nats.request_timeout`` in the instance that stops: the other instance grants them all.
"""

from __future__ import annotations

import asyncio

import pytest
from rig import admitted, open_rig, until
from test_flow_control import open_headroom, saturate


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
    await until(lambda: len(leaving.service.flow.queues) == 4, what="queued at the leaver")
    # Longer than one request timeout in its queue: the new owner must still get a full one.
    await asyncio.sleep(rig.config.nats.request_timeout + 0.5)
    assert not any(t.done() for t in tasks)

    await leaving.stop()
    await until(lambda: len(staying.service.flow.queues) == 4, what="queued at the new owner")
    assert shard in staying.service.shards.serving
    while not all(t.done() for t in tasks):
        await open_headroom(rig)
    replies = [t.result() for t in tasks]
    assert all(admitted(r) for r in replies), replies
    assert {r.owner for r in replies} == {staying.service.instance}
