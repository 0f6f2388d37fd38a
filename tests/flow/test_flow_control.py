"""Flow control in the admission service: real NATS, real load bucket, chosen engine load."""

from __future__ import annotations

import asyncio
import time

import pytest
from rig import ENDPOINTS, admitted, open_rig
from timing import eventually

from llmgw.config.sections import default_bands
from llmgw.core.outcomes import Refusal


@pytest.fixture
async def rig(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id)
    yield rig
    await rig.close()


async def saturate(rig) -> None:
    """Every engine's batch is full and 8 wait: saturation 2.0, above every band's ceiling."""
    await rig.report_all(running=8, waiting=8)


async def open_headroom(rig) -> None:
    """One round of room: the requests granted so far end while the engines are still full of
    other work (so their ends free nothing yet), then the engines report full batches with
    nothing waiting: bronze may add 3, silver 5."""
    await saturate(rig)
    await rig.finish_all()
    await rig.report_all(running=8, waiting=0)
    for service in rig.admissions:  # the room is taken before the round ends
        await ticks(service, 3)


async def ticks(service, n: int = 5) -> None:
    """Let `n` dispatch rounds run (what a round could have dispatched, it has). With nothing
    queued the tick idles (nothing to dispatch): then as long as `n` rounds would take."""
    start = service.flow.ticks
    idle_until = time.monotonic() + n * service.flow.interval
    await eventually(
        lambda: (
            service.flow.ticks >= start + n
            or (not service.flow.queues and time.monotonic() >= idle_until)
        ),
        what="dispatch rounds",
    )


async def test_nothing_waits_when_the_pool_is_not_saturated(rig):
    await rig.report_all(running=0, capacity=8)
    replies = await asyncio.gather(*(rig.ask(band="gold") for _ in range(10)))
    assert all(admitted(r) and r.target.provider == "iris" for r in replies)
    metrics = rig.admissions[0].metrics
    assert metrics.flow_decisions.labels("gold", "granted")._value.get() == 10
    assert metrics.queue_wait.labels("gold", "granted")._sum.get() == 0  # nobody queued
    # Grants spread over both engines: each reserves the least saturated one.
    assert {r.target.endpoint for r in replies} == set(ENDPOINTS)


async def test_no_lower_band_dispatch_while_a_higher_band_waits(rig):
    await saturate(rig)
    service = rig.admissions[0]
    silver = [asyncio.create_task(rig.ask(band="silver")) for _ in range(6)]
    await eventually(lambda: rig.queued() == 6, what="silver queued")
    bronze = [asyncio.create_task(rig.ask(band="bronze")) for _ in range(6)]
    await eventually(lambda: rig.queued() == 12, what="bronze queued")
    await ticks(service)
    assert not any(t.done() for t in silver + bronze)  # saturated: nothing moves

    await open_headroom(rig)
    await ticks(service)
    assert sum(t.done() for t in silver) == 5  # silver's ceiling 0.6 lets 5 through
    assert not any(t.done() for t in bronze), "bronze dispatched while silver waited"

    await open_headroom(rig)
    await ticks(service)
    assert all(t.done() for t in silver)
    assert sum(t.done() for t in bronze) == 2  # after the last silver, bronze's 0.3 takes 2 more
    for _ in range(3):
        await open_headroom(rig)
    replies = await asyncio.gather(*silver, *bronze)
    assert all(admitted(r) for r in replies)


async def test_a_quiet_tenant_keeps_its_share_next_to_a_tenant_sending_20x(rig):
    """Noisy sends 20 requests per round, quiet 1; each round frees room for 3."""
    await saturate(rig)
    granted_at: dict[str, list[float]] = {"noisy": [], "quiet": []}

    async def one(tenant: str) -> None:
        started = time.monotonic()
        reply = await rig.ask(band="bronze", tenant=tenant, timeout=60)
        if admitted(reply):
            granted_at[tenant].append(time.monotonic() - started)

    tasks, quiet_tasks = [], []
    rounds = []
    for _ in range(12):
        tasks += [asyncio.create_task(one("noisy")) for _ in range(20)]
        quiet_tasks.append(asyncio.create_task(one("quiet")))
        started = time.monotonic()
        await open_headroom(rig)
        rounds.append(time.monotonic() - started)
    for _ in range(2):
        await open_headroom(rig)
    await asyncio.wait_for(asyncio.gather(*quiet_tasks), 10)
    quiet, noisy = granted_at["quiet"], granted_at["noisy"]
    # Under contention (~240 noisy waiting) the quiet tenant got every request through, each
    # within a round or two, while the noisy one took the rest of the room.
    assert len(quiet) == 12
    assert max(quiet) < 2.5 * max(rounds), f"quiet waited {max(quiet):.2f} s"
    assert 20 <= len(noisy) <= 40
    for task in tasks:
        task.cancel()


async def test_a_full_band_rejects_at_once(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, queue_capacity_per_band=3)
    try:
        await saturate(rig)
        waiting = [asyncio.create_task(rig.ask(band="bronze")) for _ in range(3)]
        await eventually(lambda: rig.queued() == 3)
        started = time.monotonic()
        reply = await rig.ask(band="bronze")
        assert time.monotonic() - started < 0.5
        assert (admitted(reply), reply.refusal) == (False, Refusal.QUEUE_FULL)
        assert reply.retry_after >= 1
        silver = asyncio.create_task(rig.ask(band="silver"))  # each band has its own capacity
        await eventually(lambda: rig.queued() == 4, what="silver queued next to a full bronze band")
        for task in [*waiting, silver]:
            task.cancel()
    finally:
        await rig.close()


async def test_a_request_that_waits_queue_ttl_is_rejected(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, queue_ttl="300ms")
    try:
        await saturate(rig)
        started = time.monotonic()
        reply = await rig.ask(band="bronze")
        waited = time.monotonic() - started
        assert (admitted(reply), reply.refusal) == (False, Refusal.QUEUE_TIMEOUT)
        assert 0.3 <= waited < 1.5
        assert reply.retry_after >= 1
        assert rig.queued() == 0
    finally:
        await rig.close()


async def test_a_cancelled_request_leaves_the_queue_at_once(rig):
    await saturate(rig)
    asking = asyncio.create_task(rig.ask(band="bronze", request_id="leaving"))
    await eventually(lambda: rig.queued() == 1)
    await rig.cancel("leaving")
    reply = await asyncio.wait_for(asking, 1)
    assert reply.refusal is Refusal.CANCELLED
    assert rig.queued() == 0
    assert rig.admissions[0].metrics.cancellations._value.get() == 1


async def test_interactive_bands_overflow_to_a_third_party_and_batch_bands_wait(rig):
    await saturate(rig)
    gold = await rig.ask(band="gold")
    assert admitted(gold) and (gold.target.provider, gold.route) == ("tensorx", "overflow")
    bronze = asyncio.create_task(rig.ask(band="bronze"))
    await eventually(lambda: rig.queued() == 1)
    await open_headroom(rig)
    reply = await bronze
    assert admitted(reply) and reply.target.provider == "iris"


async def test_stale_metrics_hold_back_lower_bands_but_never_drop_the_pool(rig):
    await rig.report_all(running=0, at=time.time() - 60)  # idle, but a minute old
    platinum = await rig.ask(band="platinum")
    assert admitted(platinum) and platinum.target.provider == "iris"  # 1.0: at the healthy limit
    silver = asyncio.create_task(rig.ask(band="silver"))
    await eventually(lambda: rig.queued() == 1)
    await ticks(rig.admissions[0])
    assert not silver.done()
    await rig.report_all(running=0)  # fresh again: it flows
    assert admitted(await silver)


async def test_unhealthy_endpoints_degrade_the_provider_for_the_model(rig):
    await rig.report_all(running=0, healthy=False)
    reply = await rig.ask(band="bronze")  # no healthy managed endpoint: nothing to protect
    assert admitted(reply) and reply.target.provider == "tensorx"
    await rig.report("engine-2", running=0, healthy=True)
    reply = await rig.ask(band="bronze")
    assert admitted(reply) and reply.target.endpoint == "engine-2"


async def test_flow_control_off_admits_regardless_of_saturation(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, enabled=False)
    try:
        await saturate(rig)
        replies = await asyncio.gather(*(rig.ask(band="bronze") for _ in range(5)))
        assert all(admitted(r) and r.target.provider == "iris" for r in replies)
    finally:
        await rig.close()


async def test_batch_headroom_keeps_a_slot_per_engine_for_the_interactive_bands(
    nats_url, unique_id
):
    """The shipped bands: silver and bronze leave one batch slot per engine free, so the next
    platinum or gold request finds a slot instead of waiting for one (engines do not preempt)."""
    rig = await open_rig(nats_url, unique_id, bands=[band.model_dump() for band in default_bands()])
    try:
        service = rig.admissions[0]
        await rig.report_all(running=7, capacity=8)  # one free slot per engine: the headroom
        batch = [asyncio.create_task(rig.ask(band=b)) for b in ("silver", "bronze", "bronze")]
        await eventually(lambda: rig.queued() == 3, what="silver and bronze queued")
        await ticks(service)
        assert not any(t.done() for t in batch)  # not saturated, yet held back
        urgent = [await rig.ask(band="platinum"), await rig.ask(band="gold")]
        assert all(admitted(r) and r.target.provider == "iris" for r in urgent)
        assert {r.target.endpoint for r in urgent} == set(ENDPOINTS)  # one free slot each

        await rig.finish_all()
        await rig.report_all(running=5, capacity=8)  # 6 free: room for 4 beyond the headroom
        await ticks(service)
        assert all(t.done() and admitted(t.result()) for t in batch)
        more = [asyncio.create_task(rig.ask(band="bronze")) for _ in range(2)]
        await eventually(lambda: sum(t.done() for t in more) == 1, what="one more bronze grant")
        await ticks(service)
        assert sum(t.done() for t in more) == 1  # the second would take the headroom
    finally:
        await rig.close()


async def test_the_tick_idles_while_nothing_waits_and_a_queued_request_wakes_it(rig):
    service = rig.admissions[0]
    await rig.report_all(running=0, capacity=8)
    assert admitted(await rig.ask(band="gold"))  # granted at arrival: nothing queued
    start = service.flow.ticks
    await asyncio.sleep(0.5)  # 50 rounds at the 10 ms interval, were it not idle
    assert service.flow.ticks - start <= 1  # at most the once-a-second housekeeping round
    await saturate(rig)
    silver = asyncio.create_task(rig.ask(band="silver"))
    await eventually(lambda: service.flow.ticks > start + 1, what="a round for the queued request")
    assert not silver.done() and rig.queued() == 1
    await open_headroom(rig)
    assert admitted(await silver)


async def test_a_band_removed_live_answers_its_queued_requests_and_the_kept_ones_wait_on(rig):
    await saturate(rig)
    service = rig.admissions[0]
    silver = [asyncio.create_task(rig.ask(band="silver")) for _ in range(3)]
    bronze = [asyncio.create_task(rig.ask(band="bronze")) for _ in range(3)]
    await eventually(lambda: rig.queued() == 6, what="silver and bronze queued")
    admission = service.config.admission
    bands = [band for band in admission.bands if band.name != "bronze"]
    config = service.config.model_copy(
        update={"admission": admission.model_copy(update={"bands": bands})}
    )
    assert service.follow_config(config) == 3
    refused = await asyncio.gather(*bronze)  # asked again by their edge, then refused
    assert all(r.refusal is Refusal.UNKNOWN_BAND for r in refused), refused
    await ticks(service)
    assert rig.queued() == 3 and not any(t.done() for t in silver)  # still saturated: they wait
    await open_headroom(rig)
    await ticks(service)
    assert all(t.done() and admitted(t.result()) for t in silver)


async def test_queue_bounds_applied_live_expire_and_refuse_by_the_new_values(rig):
    """An applied config's `queue_ttl` and `queue_capacity_per_band` (30 s and 2000 in the
    rig) take the requests already queued: the shortened TTL expires them, the lowered capacity
    refuses the next one at once while the band is over it."""
    await saturate(rig)
    service = rig.admissions[0]
    queued = [asyncio.create_task(rig.ask(band="bronze")) for _ in range(3)]
    await eventually(lambda: rig.queued() == 3, what="bronze queued")
    admission = service.config.admission
    shorter = admission.model_copy(update={"queue_ttl": 0.4, "queue_capacity_per_band": 2})
    applied = service.config.model_copy(update={"admission": shorter})
    service.follow_config(applied)
    rig.client.follow(applied)  # the edge's wait follows too
    full = await rig.ask(band="bronze")
    assert (admitted(full), full.refusal) == (False, Refusal.QUEUE_FULL)
    started = time.monotonic()
    expired = await asyncio.gather(*queued)
    assert all(r.refusal is Refusal.QUEUE_TIMEOUT for r in expired), expired
    assert time.monotonic() - started < 1.5 and rig.queued() == 0  # 0.4 s after they came


async def test_a_lease_end_releases_a_queued_request_without_waiting_for_a_tick(
    nats_url, unique_id
):
    """Ticks 20 s apart: a request that waits for a slot gets the one a lease end frees, in a
    release between two ticks (no tick ran meanwhile)."""
    rig = await open_rig(nats_url, unique_id, interval="20s", queue_ttl="60s")
    try:
        service = rig.admissions[0]
        # Two engines of 8 configured slots: silver (ceiling 0.6) is let through while the
        # mean queue past the slots is at most 2.4 of target 4: 21 requests, the 22nd waits.
        await rig.report_all(running=0, capacity=8)
        first = [await rig.ask(band="silver") for _ in range(21)]
        assert all(admitted(r) for r in first)
        await eventually(lambda: service.load.own("engine-1") + service.load.own("engine-2") == 21)
        late = [asyncio.create_task(rig.ask(band="silver", timeout=30)) for _ in range(2)]
        await eventually(lambda: rig.queued() == 2, what="two late requests queued")
        await eventually(lambda: service.flow._room is not None, what="the tick's first round")
        ticks_before, releases_before = service.flow.ticks, service.flow.releases
        await rig.end(service, next(iter(service.ledger.leases)))  # room for one
        done, _ = await asyncio.wait(late, return_when=asyncio.FIRST_COMPLETED, timeout=10)
        assert len(done) == 1 and admitted(done.pop().result())
        assert rig.queued() == 1  # the other waits on, and no tick ran: a release let it go
        assert service.flow.ticks == ticks_before
        assert service.flow.releases > releases_before
        await rig.end(service, next(iter(service.ledger.leases)))
        assert all(admitted(r) for r in await asyncio.gather(*late))
    finally:
        await rig.close()
