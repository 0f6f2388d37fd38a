"""Several admission instances active at once: one shared headroom, strict priority across them.

Guarantee under test (docs/architecture.md, "Flow control"): per dispatch round, all instances
together grant at most the pool's headroom plus one request per other instance with waiters in
the band; no instance with waiters is starved; a band waiting in one instance holds back lower
bands in every other.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rig import admitted, open_rig
from test_flow_control import open_headroom, saturate
from timing import eventually


@pytest.fixture
async def rig3(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, instances=3)
    yield rig
    await rig.close()


def ask_at(rig, service, band: str):
    """A request decided by `service` (sent to a shard it owns, as an edge would)."""
    return rig.ask(band=band, shard=rig.shard_of_instance(service), timeout=30)


async def all_ticked(rig, n: int = 5) -> None:
    """`n` dispatch rounds in every instance (one with nothing queued idles, having nothing to
    dispatch: for it, as long as `n` rounds would take)."""
    starts = [a.flow.ticks for a in rig.admissions]
    idle_until = time.monotonic() + n * rig.admissions[0].flow.interval
    await eventually(
        lambda: all(
            a.flow.ticks >= s + n or (not a.flow.queues and time.monotonic() >= idle_until)
            for a, s in zip(rig.admissions, starts, strict=True)
        )
    )


async def drive_rounds_here(rig) -> None:
    """The test runs every dispatch round itself: each instance's tick loop is stopped, so a
    round is one `tick()` of every instance, back to back on the same gossip, and the next
    round starts only once every instance has heard the others' new queue depths. (With the
    loops running, a host too busy to deliver a round's gossip within one dispatch interval
    lets instances act on stale depths once: then the bound holds only on average.)"""
    for service in rig.admissions:
        task, service.flow._tick_task = service.flow._tick_task, None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def gossip_heard(rig) -> bool:
    """Every instance holds every other's last published queue depths."""
    for service in rig.admissions:
        for other in rig.admissions:
            if other is service:
                continue
            heard = service.flow._peers.get(other.flow.instance)
            published = {m: w for m, w in other.flow._published.items() if w}
            if (heard.waiting if heard is not None else {}) != published:
                return False
    return True


async def test_instances_share_one_headroom_instead_of_multiplying_it(rig3):
    rig = rig3
    await saturate(rig)
    # 10 bronze waiters in each instance (decided directly, as each would from its queue group).
    tasks = [
        asyncio.create_task(ask_at(rig, a, "bronze")) for a in rig.admissions for _ in range(10)
    ]
    await eventually(lambda: [len(a.flow.queues) for a in rig.admissions] == [10, 10, 10])
    await drive_rounds_here(rig)
    for service in rig.admissions:
        service.flow.tick()  # publishes its depths (nothing to dispatch: saturated)
    headroom = 3  # what one instance alone would grant for bronze (see test_flow_control)
    per_round: list[int] = []
    while rig.queued():
        assert len(per_round) < 20, ("waiters starved", per_round)
        # One round of room (the engines' batches full, nothing waiting: bronze may add 3).
        await saturate(rig)
        await rig.finish_all()
        await rig.report_all(running=8, waiting=0)
        await eventually(lambda: gossip_heard(rig), what="every instance heard the others' depths")
        with_waiters = sum(1 for a in rig.admissions if a.flow.queues)
        before = rig.queued()
        for service in rig.admissions:
            service.flow.tick()
        this_round = before - rig.queued()
        per_round.append(this_round)
        # The bound, in every round: the headroom plus one per other instance with waiters
        # (each rounds its share up). Without sharing, three instances would each grant the
        # whole headroom: 9.
        assert this_round <= headroom + with_waiters - 1, per_round
        assert this_round >= 1, ("a round with room granted nothing", per_round)
    assert all(admitted(reply) for reply in await asyncio.gather(*tasks))


async def test_a_band_waiting_in_one_instance_holds_back_lower_bands_in_the_others(rig3):
    rig = rig3
    a, b, _ = rig.admissions
    await saturate(rig)
    silver = [asyncio.create_task(ask_at(rig, a, "silver")) for _ in range(8)]
    bronze = [asyncio.create_task(ask_at(rig, b, "bronze")) for _ in range(8)]
    await eventually(lambda: (len(a.flow.queues), len(b.flow.queues)) == (8, 8))
    await all_ticked(rig)
    await open_headroom(rig)  # room for 5 silver: silver still waits after it
    await all_ticked(rig)
    assert sum(t.done() for t in silver) == 5
    assert not any(t.done() for t in bronze), "bronze dispatched in b while silver waited in a"
    for _ in range(6):
        await open_headroom(rig)
    assert all(t.done() for t in silver + bronze)
