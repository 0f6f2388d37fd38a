"""An attempt asked again is answered the same way: what makes an edge's re-ask safe when a NATS
node dies with an ask or its answer in its connection buffers.

The lost answer is made by hand: the first ask is published by the test with a reply subject
nobody listens to (the answer is lost exactly as in a dead connection), then the edge's client
(`NatsAdmission`) asks for the same attempt. The lost ask is a scripted owner that ignores the
first ask of every attempt. All over a real nats-server.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from rig import admitted, open_rig
from test_flow_control import open_headroom, saturate
from timing import eventually

from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.core.outcomes import Refusal
from llmgw.services.edge.admission_client import NatsAdmission
from llmgw.wire import (
    REQUEST_STATS_SUBJECT,
    AdmitReply,
    AdmitRequest,
    ReplyStatus,
    RequestEnded,
    Target,
    admission_subject,
)


@pytest.fixture
async def rig(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id)
    yield rig
    await rig.close()


async def lose_the_answer(rig, request: AdmitRequest) -> None:
    """Ask as an edge would, but nobody listens where the answer goes."""
    payload = request.model_dump_json(exclude_defaults=True).encode()
    await rig.nc.publish(admission_subject(request.shard), payload, reply="lost.answer")
    await rig.nc.flush()


async def test_a_grant_whose_answer_was_lost_is_answered_again_with_the_same_lease(rig):
    await rig.report_all(running=0, capacity=8)
    service = rig.admissions[0]
    request = rig.request(band="gold", session="s1")
    await lose_the_answer(rig, request)
    await eventually(lambda: len(service.ledger.leases) == 1, what="the first ask granted")
    (granted,) = service.ledger.leases

    reply, _ = await rig.client.admit(request)
    assert admitted(reply) and reply.lease is not None
    assert reply.lease.lease_id == granted
    assert list(service.ledger.leases) == [granted]  # one attempt, one lease
    # A new attempt of the same session is a new decision (its own lease).
    other, _ = await rig.client.admit(rig.request(band="gold", session="s1"))
    assert admitted(other) and other.lease.lease_id != granted
    assert len(service.ledger.leases) == 2


async def test_a_grant_asked_again_after_its_shard_moved_gets_the_same_lease_from_the_new_owner(
    nats_url, unique_id
):
    """The answer is lost, the shard is handed over with the lease (a graceful stop), and the
    ask again reaches the new owner: it answers with the grant it took in, no second lease."""
    rig = await open_rig(nats_url, unique_id, 2)
    try:
        await rig.report_all(running=0, capacity=8)
        handle, other = rig.cluster.admissions
        giver, receiver = handle.service, other.service
        request = rig.request(band="gold", shard=min(giver.shards.serving))
        await lose_the_answer(rig, request)
        await eventually(lambda: len(giver.ledger.leases) == 1, what="the first ask granted")
        (granted,) = giver.ledger.leases
        await handle.stop()  # every shard to the receiver, with the lease
        assert list(receiver.ledger.leases) == [granted]

        reply, _ = await rig.client.admit(request)
        assert admitted(reply) and reply.lease is not None
        assert reply.lease.lease_id == granted
        assert list(receiver.ledger.leases) == [granted]  # one attempt, one lease
    finally:
        await rig.close()


async def test_a_refusal_asked_again_is_the_same_refusal_even_once_there_is_room(rig):
    await rig.report_all(running=0, capacity=8)
    service = rig.admissions[0]
    keyed = {"key": "k1", "key_parallel": 1}
    first, _ = await rig.client.admit(rig.request(band="gold").model_copy(update=keyed))
    assert admitted(first)
    refused = rig.request(band="gold").model_copy(update=keyed)
    await lose_the_answer(rig, refused)  # refused: the key's one slot is taken
    await eventually(lambda: service.metrics.rejections.labels("key_limit")._value.get() == 1)
    await rig.finish_all()  # now the key has room
    reply, _ = await rig.client.admit(refused)
    assert reply.refusal is Refusal.KEY_LIMIT  # decided once: the answer the edge missed
    assert service.ledger.leases == {}


async def test_an_ended_grant_asked_again_gets_no_second_lease(rig):
    await rig.report_all(running=0, capacity=8)
    service = rig.admissions[0]
    request = rig.request(band="gold")
    reply, _ = await rig.client.admit(request)
    assert admitted(reply)
    await rig.finish_all()
    # A late ask of the ended attempt: no answer (its edge had one), and above all no lease.
    with pytest.raises(TimeoutError):
        await rig.nc.request(
            admission_subject(request.shard),
            request.model_dump_json(exclude_defaults=True).encode(),
            timeout=0.5,
        )
    assert service.ledger.leases == {}


async def test_a_queued_attempt_asked_again_waits_once_and_its_decision_follows_the_new_ask(rig):
    await saturate(rig)
    service = rig.admissions[0]
    request = rig.request(band="silver")
    await lose_the_answer(rig, request)  # its QUEUED went nowhere
    await eventually(lambda: rig.queued() == 1, what="queued")

    asked = asyncio.create_task(rig.client.admit(request))
    await asyncio.sleep(3 * rig.client.reask_after)  # it asks again (QUEUED) and waits
    assert rig.queued() == 1 and not asked.done()  # still one waiter, not two
    while not asked.done():
        await open_headroom(rig)
    reply, _ = await asked
    assert admitted(reply)
    assert len(service.ledger.leases) == 1


async def test_the_edge_asks_again_when_an_ask_gets_no_answer(nats_url):
    """A scripted owner of a shard loses the first ask of every attempt and answers the next
    (QUEUED, the QUEUED of an ask again, then the decision): the edge's client asks again with
    the same attempt id and reply subject, and takes the decision within its request timeout."""
    nc = await nats.connect(nats_url)
    asks: list[tuple[str, str]] = []

    async def owner(msg) -> None:
        request = AdmitRequest.model_validate_json(msg.data)
        asks.append((request.id, msg.reply))
        if len(asks) == 1:
            return  # lost
        queued = AdmitReply(id=request.id, status=ReplyStatus.QUEUED).model_dump_json()
        refused = AdmitReply(id=request.id, status=ReplyStatus.REFUSED, refusal=Refusal.NO_CAPACITY)
        for answer in (queued, queued, refused.model_dump_json()):
            await nc.publish(msg.reply, answer.encode())

    request = AdmitRequest(id="edge-9.1", edge="edge-9", model="m", feature="chat", shard=7)
    sub = await nc.subscribe(admission_subject(request.shard), cb=owner)
    client = NatsAdmission(nc, request_timeout=2.0, queue_ttl=1.0)
    await client.start()
    try:
        started = time.monotonic()
        reply, _ = await client.admit(request)
        took = time.monotonic() - started
    finally:
        await client.stop()
        await sub.unsubscribe()
        await nc.close()
    assert reply.refusal is Refusal.NO_CAPACITY  # the decision, past both QUEUED
    assert len(asks) == 2 and asks[0] == asks[1]  # same attempt, same reply subject
    assert client.reask_after <= took < client.request_timeout, took


async def test_a_second_grant_of_an_answered_attempt_is_ended_at_once(nats_url):
    """Two owners (the shard moved between an ask and its ask again, and the new owner adopted
    it by roll call, without the old owner's answers) grant one attempt two leases: the edge
    takes the first and ends the other at once, so nobody holds it until a renewal leaves it
    out."""
    nc = await nats.connect(nats_url)
    ends: list[RequestEnded] = []

    async def on_end(msg) -> None:
        ends.append(RequestEnded.model_validate_json(msg.data))

    def grant(attempt: str, lease_id: str) -> bytes:
        lease = LeaseRecord(lease_id, "p", "m", LeaseKind.TEMPORARY, True, 7, "edge-9", 0.0, 0.0)
        target = Target(
            provider="p", provider_kind="managed", endpoint="e", url="u", upstream_model="m"
        )
        reply = AdmitReply(id=attempt, status=ReplyStatus.ADMITTED, target=target, lease=lease)
        return reply.model_dump_json().encode()

    async def owners(msg) -> None:  # the old owner's grant, then the new owner's
        request = AdmitRequest.model_validate_json(msg.data)
        await nc.publish(msg.reply, grant(request.id, "lease-old"))
        await nc.publish(msg.reply, grant(request.id, "lease-new"))

    request = AdmitRequest(id="edge-9.2", edge="edge-9", model="m", feature="chat", shard=7)
    subs = [
        await nc.subscribe(admission_subject(request.shard), cb=owners),
        await nc.subscribe(REQUEST_STATS_SUBJECT, cb=on_end),
    ]
    client = NatsAdmission(nc, request_timeout=2.0, queue_ttl=1.0)
    await client.start()
    try:
        reply, _ = await client.admit(request)
        await eventually(lambda: len(ends) == 1, what="the stray grant ended")
    finally:
        await client.stop()
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()
    assert reply.lease.lease_id == "lease-old"
    (end,) = ends
    assert (end.id, end.lease, end.shard, end.sent, end.ok) == (
        "edge-9.2",
        "lease-new",
        7,
        False,
        False,
    )
    assert client.strays == 1
