"""A batch band waits for our engines when only quota keeps it off them; it never pays a third party.

The bands that do not overflow (silver, bronze by default) wait in their queue while the
engines are saturated: "a batch job is cheaper served by us later" (docs/config.md, "Bands").
The same holds when the engines have room but the pair's limits do not (its unreserved quota,
or the lease limit for a pinned turn): such a request goes back to the head of its queue
(`llmgw_admission_quota_holds_total`) and runs on our engines when a lease ends, instead of
starting a session on the third party. Bands that overflow (platinum, gold) still run there at
once. A held request can be cancelled, expires like any queued one, and holds no lease.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rig import BINDING_LIMITS, MODEL, admitted, open_rig
from timing import eventually

from llmgw.state.checker import AuditLog, check_audit
from llmgw.wire import Refusal

PAIR = ("iris", MODEL)
LIMITS = BINDING_LIMITS
G = LIMITS["max_global_in_flight_request_slots"]
R = LIMITS["global_in_flight_request_slots_reserved_for_pinned_sessions"]


@pytest.fixture
async def rig(nats_url, unique_id):
    audit = AuditLog()
    rig = await open_rig(
        nats_url, unique_id, limits=LIMITS, observer_for=audit.observer, queue_ttl=2.0
    )
    rig.audit = audit  # type: ignore[attr-defined]
    await rig.report_all(running=0, capacity=32)  # idle engines: only the limits bind
    yield rig
    await rig.close()


def holds(service, band: str) -> float:  # type: ignore[no-untyped-def]
    return service.metrics.quota_holds.labels(band)._value.get()


async def fill_unreserved(rig) -> list[str]:  # type: ignore[no-untyped-def]
    """G - R sessionless gold requests on iris: the pair's unreserved limit is reached."""
    replies = [await rig.ask(band="gold") for _ in range(G - R)]
    assert [r.target.provider for r in replies] == ["iris"] * (G - R)
    return [r.lease.lease_id for r in replies]


async def test_a_batch_request_waits_for_our_quota_while_an_overflow_band_runs_elsewhere(rig):
    (service,) = rig.admissions
    leases = await fill_unreserved(rig)
    silver = asyncio.ensure_future(rig.ask(band="silver", session="batch-1"))
    await eventually(lambda: holds(service, "silver") >= 1, what="the silver request held")
    assert not silver.done()
    assert len(service.flow.queues) == 1  # back in its queue, holding nothing
    assert service.ledger.pair_use(PAIR).unreserved == G - R
    # Gold overflows: it starts its session on the third party at once, as before.
    gold = await rig.ask(band="gold", session="chat-1")
    assert admitted(gold) and gold.target.provider == "tensorx"
    await asyncio.sleep(0.3)  # several ticks and rechecks: still waiting, still no lease
    assert not silver.done()
    # One lease ends: the silver request runs on our engines and pins its session there.
    await rig.end(service, leases[0])
    reply = await asyncio.wait_for(silver, 5)
    assert admitted(reply) and reply.target.provider == "iris", reply
    assert service.ledger.pair_use(PAIR).unreserved == G - R
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], [str(v) for v in violations[:3]]


async def test_a_held_request_can_be_cancelled_and_expires_like_any_queued_one(rig):
    (service,) = rig.admissions
    await fill_unreserved(rig)
    leases_before = set(service.ledger.leases)
    cancelled = rig.request(band="bronze", session="batch-2")
    asking = asyncio.ensure_future(rig.client.admit(cancelled))
    await eventually(lambda: holds(service, "bronze") >= 1, what="the bronze request held")
    await rig.cancel(cancelled.id)
    reply, _ = await asyncio.wait_for(asking, 5)
    assert reply.refusal is Refusal.CANCELLED, reply
    # Another one waits out the queue's ttl (2 s here): refused as a queued request is.
    started = time.monotonic()
    expired = await rig.ask(band="bronze", session="batch-3")
    assert expired.refusal is Refusal.QUEUE_TIMEOUT, expired
    assert 1.5 < time.monotonic() - started < 4
    assert set(service.ledger.leases) == leases_before  # neither took a lease
    assert len(service.flow.queues) == 0


async def test_an_overflow_band_waits_limit_grace_for_a_lease_to_end_then_runs_elsewhere(
    nats_url, unique_id
):
    """`admission.limit_grace` (0.5 s here): a gold request that only the limits keep off our
    engines takes a lease that ends meanwhile; without one it goes to the third party once the
    grace is over, not before."""
    rig = await open_rig(nats_url, unique_id, limits=LIMITS, limit_grace=0.5)
    try:
        await rig.report_all(running=0, capacity=32)
        (service,) = rig.admissions
        leases = await fill_unreserved(rig)
        started = time.monotonic()
        waiting = asyncio.ensure_future(rig.ask(band="gold", session="chat-2"))
        await asyncio.sleep(0.15)  # well inside limit_grace (0.5 s): it must still wait
        assert not waiting.done()
        await rig.end(service, leases[0])
        reply = await asyncio.wait_for(waiting, 5)
        assert admitted(reply) and reply.target.provider == "iris", reply
        assert time.monotonic() - started < 0.45  # the lease's end, not the grace's
        started = time.monotonic()
        elsewhere = await rig.ask(band="gold", session="chat-3")
        assert admitted(elsewhere) and elsewhere.target.provider == "tensorx", elsewhere
        assert 0.45 <= time.monotonic() - started < 2
        assert len(service.flow.queues) == 0  # it never queued
    finally:
        await rig.close()


async def test_an_overflow_band_with_nowhere_to_overflow_waits_in_its_queue(nats_url, unique_id):
    """A fleet of our own engines only: gold overflows by default, but no third party serves
    the model, so a gold request that only the limits keep off our engines waits in its queue
    (as a batch band does) and runs when a lease ends, instead of a 503 `no_capacity` once
    `limit_grace` is over; it expires with the queue's ttl like any queued request."""
    audit = AuditLog()
    rig = await open_rig(
        nats_url,
        unique_id,
        limits=LIMITS,
        third_party=False,
        observer_for=audit.observer,
        queue_ttl=2.0,
        limit_grace=0.05,
    )
    try:
        await rig.report_all(running=0, capacity=32)
        (service,) = rig.admissions
        leases = await fill_unreserved(rig)
        waiting = [
            asyncio.ensure_future(rig.ask(band="gold", session=f"new-{i}")) for i in range(2)
        ]
        await eventually(lambda: holds(service, "gold") >= 2, what="both gold requests held")
        await asyncio.sleep(0.3)  # six times limit_grace: they still wait, holding nothing
        assert not any(w.done() for w in waiting)
        assert service.ledger.pair_use(PAIR).unreserved == G - R
        for lease in leases[:2]:
            await rig.end(service, lease)
        replies = await asyncio.wait_for(asyncio.gather(*waiting), 5)
        assert all(admitted(r) and r.target.provider == "iris" for r in replies), replies
        # With no lease ending, the next one waits out the queue's ttl: 504, never 503.
        started = time.monotonic()
        expired = await rig.ask(band="gold", session="new-late")
        assert expired.refusal is Refusal.QUEUE_TIMEOUT, expired
        assert 1.5 < time.monotonic() - started < 4
        violations = check_audit(audit.events, rig.cluster.limits, lease_timeout=30.0)
        assert violations == [], [str(v) for v in violations[:3]]
    finally:
        await rig.close()
