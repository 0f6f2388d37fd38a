"""A receiver that does not listen for handovers yet: the giver sends the handover again.

A newcomer's member key exists before it subscribes to its handover subject, so the giver's
first handover request can find no responders. Taken as a lost message, the receiver would
adopt the shard by roll call instead, and lose every lease no edge announces in time (none
here: nothing answers roll calls). The giver sends it again within the handover timeout, so the
receiver that subscribes a moment later takes the leases in with the shard.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from rig import EDGE_LIMITS, admitted, open_rig
from timing import eventually

from llmgw.core.shards import desired_owner
from llmgw.wire import handover_subject

GIVER, RECEIVER = "admission-0", "admission-1"
SHARDS = 8


@pytest.fixture
async def rig(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, limits=EDGE_LIMITS, shards=SHARDS)
    yield rig
    await rig.close()


async def test_a_receiver_that_subscribes_late_still_gets_the_handover(rig, monkeypatch):
    await rig.report_all(running=0, capacity=16)
    moving = [k for k in range(SHARDS) if desired_owner(k, [GIVER, RECEIVER]) == RECEIVER]
    assert moving
    leases = []  # one in every shard that moves: whichever is handed first finds nobody
    for shard in moving:
        reply = await rig.ask(shard=shard)
        assert admitted(reply), reply
        leases.append(reply.lease.lease_id)

    handover = handover_subject(RECEIVER)
    listen, unanswered = asyncio.Event(), []
    subscribe, request = Client.subscribe, Client.request

    async def late_subscribe(self, subject, *args, **kwargs):  # type: ignore[no-untyped-def]
        if subject == handover:
            await listen.wait()  # the receiver's member key exists; its handovers find nobody
        return await subscribe(self, subject, *args, **kwargs)

    async def counted_request(self, subject, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return await request(self, subject, *args, **kwargs)
        except NoRespondersError:
            if subject == handover:
                unanswered.append(subject)
            raise

    monkeypatch.setattr(Client, "subscribe", late_subscribe)
    monkeypatch.setattr(Client, "request", counted_request)
    joining = asyncio.create_task(rig.cluster.add_admission(RECEIVER))
    try:
        await eventually(lambda: unanswered, timeout=10, what="a handover that found no responders")
    finally:
        listen.set()
    receiver = (await joining).service

    with contextlib.suppress(AssertionError):  # the assert below says what is missing
        await eventually(lambda: set(leases) <= set(receiver.ledger.leases), timeout=5)
    assert set(leases) <= set(receiver.ledger.leases), (leases, list(receiver.ledger.leases))
    await eventually(lambda: set(moving) <= set(receiver.shards.serving), what="the moved shards")
    assert receiver.shards.adopted_leases == len(leases)
    assert receiver.shards.refused_leases == 0
