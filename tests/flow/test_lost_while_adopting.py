"""An instance that is lost while it adopts a shard does not serve that shard under its next id.

A lost instance (fenced, or its member key taken away) drops every shard it serves and joins
again under a new id. A shard it was still taking in (an adoption's roll call, its transfers)
was not among them: the adoption went on, took the shard in and subscribed after the rejoin,
and the instance, able to decide again, served a shard whose key names its old, dead id until
its next round dropped it; meanwhile any live instance may claim that shard (its owner is not
live) and serve it too. Here the adoption of a dead peer's shards is held at its roll call
while the instance's key is taken away; every shard it subscribes to must be one whose key
names the id it has then, while it may decide.
"""

from __future__ import annotations

import asyncio

import pytest
from rig import EDGE_LIMITS, open_rig
from timing import eventually

from llmgw.services.admission import shards as shards_module
from llmgw.services.admission.shards import ShardKeeper
from llmgw.services.admission.successor import remove_exited_member
from llmgw.state.setup import open_routing_store

SHARDS = 8


@pytest.fixture
async def rig(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, 2, limits=EDGE_LIMITS, shards=SHARDS)
    yield rig
    await rig.close()


async def test_a_shard_adopted_across_a_rejoin_is_not_served_under_the_new_id(rig, monkeypatch):
    dead, adopter = rig.cluster.admissions
    service = adopter.service
    old = service.instance
    orphans = set(dead.service.shards.serving)
    held, go = asyncio.Event(), asyncio.Event()
    gather = shards_module.gather

    async def held_gather(ctx, shards):  # type: ignore[no-untyped-def]
        if ctx.instance == old and set(shards) & orphans:
            held.set()
            await go.wait()
        return await gather(ctx, shards)

    served = []  # (shard, the id it was subscribed under, the id its key names, may decide)
    subscribe = ShardKeeper.subscribe

    async def recorded(self, record):  # type: ignore[no-untyped-def]
        await subscribe(self, record)
        membership = self.ctx.membership
        owner = membership.owners.get(record.number)
        served.append(
            (
                record.number,
                self.ctx.instance,
                owner.owner if owner else None,
                membership.can_serve(),
            )
        )

    monkeypatch.setattr(shards_module, "gather", held_gather)
    monkeypatch.setattr(ShardKeeper, "subscribe", recorded)
    await dead.kill()
    store = await open_routing_store(rig.nc, rig.config)
    assert await remove_exited_member(store, dead.name)  # its shards can be claimed at once
    await eventually(held.is_set, timeout=10, what="the adoption of the dead peer's shards")

    assert await remove_exited_member(store, old)  # the adopter's own key taken away: lost
    await eventually(lambda: not service.membership.can_serve(), timeout=10, what="lost")
    go.set()
    await eventually(lambda: service.instance != old, timeout=10, what="the rejoin")
    await eventually(lambda: orphans <= service.shards.serving, timeout=20, what="adopted anew")
    wrong = [entry for entry in served if entry[2] != entry[1] or not entry[3]]
    assert wrong == [], "served under another id than its key names, or while lost"
