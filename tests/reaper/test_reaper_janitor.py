"""The reaper clears what dead admission instances leave: their member keys and their leftover
quota. It never touches a live instance's, and two reapers make each change once."""

from __future__ import annotations

import asyncio

import pytest
from reaper_helpers import IRIS, MODEL, WAIT, Connect, EventLog
from timing import SteppedClock, eventually

from llmgw.config import Config
from llmgw.core.keys import MemberValue
from llmgw.core.quota import Quota, QuotaBook
from llmgw.events import EventName, EventPublisher
from llmgw.services.reaper.main import open_reaper, quota_grace, serve
from llmgw.services.reaper.metrics import ReaperMetrics
from llmgw.state.setup import open_routing_store

NOW = 10_000.0


@pytest.fixture
async def store(config: Config, connect: Connect):
    return await open_routing_store(await connect(), config)


async def test_dead_members_keys_go_after_three_ttls_and_live_ones_stay(
    config: Config, connect: Connect, store, event_log: EventLog
):
    ttl = config.admission.member_ttl
    await store.join(MemberValue("admission-dead", 0.0, NOW - 3 * ttl - 1))
    await store.join(MemberValue("admission-late", 0.0, NOW - 2 * ttl))  # dead, not long enough
    await store.join(MemberValue("admission-live", 0.0, NOW - 0.5))
    reaper = await open_reaper(
        await connect(), config, instance="reaper-a", clock=SteppedClock(NOW)
    )
    result = await reaper.run_pass()
    assert result.members_removed == ("admission-dead",)
    remaining = {m.value.instance for m in await store.members()}
    assert remaining == {"admission-late", "admission-live"}
    events = await event_log.sync(reaper.events._nc)
    assert [e.member for e in events if e.event == EventName.MEMBER_EXPIRED] == ["admission-dead"]


async def test_a_dead_instances_leftover_quota_returns_to_the_pool_after_the_grace(
    config: Config, connect: Connect, store, event_log: EventLog
):
    grace = quota_grace(config)
    await store.join(MemberValue("admission-live", 0.0, NOW - 0.5))
    book = QuotaBook(
        IRIS,
        MODEL,
        {
            "admission-live": Quota(10, 8, 50, at=NOW - 10 * grace),  # old entry, live holder
            "admission-gone": Quota(4, 3, 20, at=NOW - grace - 1),
            "admission-recent": Quota(2, 1, 5, at=NOW - grace / 2),  # its adopters are at work
        },
    )
    assert await store.write_quota_book(book, 0) is not None
    reaper = await open_reaper(
        await connect(), config, instance="reaper-a", clock=SteppedClock(NOW)
    )
    result = await reaper.run_pass()
    assert result.quota_reclaimed == ((IRIS, MODEL, "admission-gone"),)
    after = (await store.quota_book(IRIS, MODEL)).value
    assert set(after.holders) == {"admission-live", "admission-recent"}
    events = await event_log.sync(reaper.events._nc)
    (reclaimed,) = [e for e in events if e.event == EventName.QUOTA_RECLAIMED]
    assert (reclaimed.member, reclaimed.leases, reclaimed.pins) == ("admission-gone", 4, 20)


async def test_an_event_that_cannot_be_published_is_counted_and_the_change_stands(
    config: Config, connect: Connect, store
):
    await store.join(MemberValue("admission-dead", 0.0, NOW - 3 * config.admission.member_ttl - 1))
    metrics = ReaperMetrics()
    reaper = await open_reaper(
        await connect(),
        config,
        instance="reaper-a",
        clock=SteppedClock(NOW),
        metrics=metrics,
    )
    lost = await connect()
    await lost.close()  # its events' connection is gone; its bucket's is not
    reaper.events = EventPublisher(lost, "reaper-a")
    result = await reaper.run_pass()
    assert result.members_removed == ("admission-dead",)
    assert metrics.registry.get_sample_value("llmgw_reaper_unpublished_events_total") == 1.0


async def test_two_reapers_make_each_change_once(
    config: Config, connect: Connect, store, event_log: EventLog
):
    ttl = config.admission.member_ttl
    for n in range(5):
        await store.join(MemberValue(f"admission-dead-{n}", 0.0, NOW - 4 * ttl))
    first = await open_reaper(await connect(), config, instance="reaper-a", clock=SteppedClock(NOW))
    second = await open_reaper(
        await connect(), config, instance="reaper-b", clock=SteppedClock(NOW)
    )
    a, b = await asyncio.gather(first.run_pass(), second.run_pass())
    removed = [*a.members_removed, *b.members_removed]
    assert sorted(removed) == [f"admission-dead-{n}" for n in range(5)]  # each once
    events = await event_log.sync(first.events._nc, second.events._nc)
    assert len([e for e in events if e.event == EventName.MEMBER_EXPIRED]) == 5


async def test_a_successor_removes_its_exited_predecessors_keys_at_once_and_no_other(store):
    """`llmgw up` names the instance of an edge process that exited (its supervisor saw it
    end): the successor removes that member key without waiting for its TTL, and the key of
    what it had become by joining again (`<name>-r<token>`), but no other instance's."""
    from llmgw.services.admission.compose import remove_exited_member

    for name in ("up-edge-1a2b3c-0", "up-edge-1a2b3c-0-rf00d12", "up-edge-1a2b3c-00", "other"):
        await store.join(MemberValue(name, NOW, NOW))  # all freshly renewed
    assert await remove_exited_member(store, "up-edge-1a2b3c-0")
    remaining = {m.value.instance for m in await store.members()}
    assert remaining == {"up-edge-1a2b3c-00", "other"}
    assert not await remove_exited_member(store, "up-edge-1a2b3c-0")  # nothing left to remove


async def _passes_after(metrics: ReaperMetrics, count: int) -> None:
    """Return once `count` more passes have ended (a pass in progress counts as the first)."""

    def ended() -> float:
        value = metrics.registry.get_sample_value("llmgw_reaper_pass_duration_seconds_count")
        return value or 0.0

    wanted = ended() + count
    await eventually(lambda: ended() >= wanted, WAIT, f"{count} more passes")  # a metric: no event


async def test_a_served_reaper_judges_expiry_by_the_clock_it_is_given(
    config: Config, store, event_log: EventLog
):
    """`serve` hands its clock to the reaper: a member key last renewed at NOW stays while the
    stepped clock is short of three TTLs after it (passes keep running, none removes it), and
    the first pass at three TTLs removes it, announced at that time."""
    ttl = config.admission.member_ttl
    await store.join(MemberValue("admission-quiet", 0.0, NOW))
    clock, metrics = SteppedClock(NOW), ReaperMetrics()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(config, stop=stop, ready=ready, metrics=metrics, clock=clock))
    try:
        async with asyncio.timeout(WAIT):
            await ready.wait()
        for short_of_it in (NOW + ttl, NOW + 3 * ttl - 0.001):
            clock.now = short_of_it
            await _passes_after(metrics, 2)  # the second began after the step
            assert {m.value.instance for m in await store.members()} == {"admission-quiet"}
        clock.now = NOW + 3 * ttl
        await event_log.wait_until(lambda log: bool(log.named(EventName.MEMBER_EXPIRED)))
    finally:
        stop.set()
        async with asyncio.timeout(WAIT):
            await task
    (expired,) = event_log.named(EventName.MEMBER_EXPIRED)
    assert (expired.member, expired.at) == ("admission-quiet", NOW + 3 * ttl)
    assert await store.members() == []
