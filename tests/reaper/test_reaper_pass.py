"""Reaper passes driven by a stepped clock on a real bucket: exact expiry boundaries, racing
passes, repair after its grace period, and a pass that survives a failing or stalled step."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest_asyncio
from nats.aio.client import Client as NatsClient
from reaper_helpers import IRIS, MODEL, Connect, EventLog, session_id

from llmgw.config import Config
from llmgw.core.leasekeys import PinSlotValue, model_key, pin_slot_key
from llmgw.core.leases import AdmissionResult, Lease, ReaperAction, ReaperActionKind
from llmgw.events import EventName, EventPublisher, PinSlotFreed, ReaperCause
from llmgw.services.reaper.main import open_reaper
from llmgw.services.reaper.metrics import ReaperMetrics
from llmgw.services.reaper.service import MIN_REPAIR_GRACE, Reaper, repair_grace
from llmgw.state import KVStore, open_routing_bucket
from llmgw.state.routing_state import RoutingState
from llmgw.state.setup import limits_from_config

K = ReaperActionKind


class SteppedClock:
    """Time moves only when the test moves it (the same clock stamps leases and reaps them)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class World:
    config: Config
    connect: Connect
    kv: KVStore
    admission: RoutingState
    clock: SteppedClock
    publishers: list[NatsClient] = field(default_factory=list)
    states: list[RoutingState] = field(default_factory=list)

    async def reaper(self, name: str) -> Reaper:
        nc = await self.connect()
        self.publishers.append(nc)
        reaper, routing = await open_reaper(nc, self.config, instance=name, clock=self.clock)
        self.states.append(routing)
        return reaper

    async def new_pin(self, session: str) -> Lease:
        admitted = await self.admission.try_admit_unpinned_session_request(IRIS, MODEL, session)
        assert admitted.result == AdmissionResult.ADMITTED and admitted.lease is not None
        return admitted.lease


@pytest_asyncio.fixture
async def world(config: Config, connect: Connect) -> AsyncIterator[World]:
    clock = SteppedClock()
    nc = await connect()
    kv = await open_routing_bucket(nc.jetstream(), config.pinning.bucket)
    # The only instance taking slots, on a new bucket: its slot mirror (a hint fed by a watch)
    # would know nothing its own writes do not tell it, so it is not started.
    admission = RoutingState(
        kv,
        limits_from_config(config),
        clock=clock,
        rng=random.Random(7),
        lease_timeout=config.pinning.lease_timeout,
        pin_inactivity_timeout=config.pinning.pin_inactivity_timeout,
        instance_id="edge-test",
    )
    world = World(config, connect, kv, admission, clock)
    yield world
    for state in world.states:
        await state.close()


def _kinds(actions: list[ReaperAction]) -> Counter[str]:
    return Counter(str(a.kind) for a in actions)


async def test_racing_passes_reclaim_each_expired_lease_once(
    world: World, event_log: EventLog
) -> None:
    leases = [await world.new_pin(session_id(i)) for i in range(4)]
    for _ in range(8):
        admitted = await world.admission.try_admit_request_without_pin(IRIS, MODEL)
        assert admitted.lease is not None
        leases.append(admitted.lease)
    first, second = await world.reaper("reaper-a"), await world.reaper("reaper-b")

    world.clock.advance(world.config.pinning.lease_timeout)  # now == renewed_at + timeout
    results = await asyncio.gather(first.run_pass(), second.run_pass())

    reclaimed = Counter(a.lease_id for r in results for a in r.actions if a.kind == K.LEASE_EXPIRED)
    assert reclaimed == Counter({lease.lease_id: 1 for lease in leases})
    events = await event_log.sync(*world.publishers)
    announced = Counter(e.lease_id for e in events if e.event == EventName.LEASE_EXPIRED)
    assert announced == reclaimed
    assert all(r.failed_steps == () for r in results)
    usage = await world.admission.usage()
    assert sum(p.leases for p in usage.pairs) == 0


async def test_a_lease_is_reclaimed_only_once_its_timeout_has_passed(world: World) -> None:
    lease = await world.new_pin(session_id(1))
    reaper = await world.reaper("reaper-a")
    world.clock.advance(world.config.pinning.lease_timeout - 0.001)
    assert (await reaper.run_pass()).actions == ()
    world.clock.advance(0.001)
    actions = list((await reaper.run_pass()).actions)
    assert [(a.kind, a.lease_id) for a in actions[:2]] == [
        (K.LEASE_EXPIRED, lease.lease_id),
        (K.LEASE_UNLISTED, lease.lease_id),
    ]


async def test_idle_pin_expires_at_its_inactivity_timeout_and_a_renewed_one_never(
    world: World, event_log: EventLog
) -> None:
    idle_session, busy_session = session_id(1), session_id(2)
    idle = await world.new_pin(idle_session)
    busy = await world.new_pin(busy_session)
    await world.admission.release_request_lease(idle, refresh_pin=True)  # idle from now on
    reaper = await world.reaper("reaper-a")
    inactivity = world.config.pinning.pin_inactivity_timeout

    world.clock.advance(inactivity - 0.01)
    renewed = await world.admission.renew_request_lease(busy)
    assert renewed is not None
    assert (await reaper.run_pass()).actions == ()

    world.clock.advance(0.01)
    renewed = await world.admission.renew_request_lease(renewed)
    assert renewed is not None
    result = await reaper.run_pass()
    assert _kinds(list(result.actions)) == {K.PIN_EXPIRED: 1, K.PIN_SLOT_FREED: 1}
    assert {a.session for a in result.actions} == {idle_session}
    assert await world.admission.get_pin(MODEL, idle_session) is None

    for _ in range(40):  # 20 s of clock, far beyond the 2 s inactivity timeout
        world.clock.advance(0.5)
        renewed = await world.admission.renew_request_lease(renewed)
        assert renewed is not None
        assert (await reaper.run_pass()).actions == ()
    pin = await world.admission.get_pin(MODEL, busy_session)
    assert pin is not None and list(pin.leases) == [busy.lease_id]

    events = await event_log.sync(*world.publishers)
    assert [(e.event, e.session) for e in events] == [
        (EventName.PIN_EXPIRED, idle_session),
        (EventName.PIN_SLOT_FREED, idle_session),
    ]
    freed = events[1]
    assert isinstance(freed, PinSlotFreed) and freed.cause == ReaperCause.EXPIRY


async def test_repair_frees_an_orphan_pin_slot_only_after_the_grace_period(
    world: World, event_log: EventLog
) -> None:
    # An admission died between taking a pin slot and writing its pin.
    key = pin_slot_key(IRIS, model_key(MODEL), 7)
    orphan = PinSlotValue.taken(session_id(5), "deadbeefdeadbeef", world.clock())
    await world.kv.create(key, orphan.to_json())
    reaper = await world.reaper("reaper-a")
    grace = repair_grace(world.config.pinning.lease_timeout)
    assert reaper.grace == grace == MIN_REPAIR_GRACE  # 2 x 1s is below the floor

    world.clock.advance(grace - 0.5)
    assert (await reaper.run_pass()).actions == ()
    world.clock.advance(0.5)
    result = await reaper.run_pass()
    assert [(a.kind, a.key) for a in result.actions] == [(K.ORPHAN_PIN_SLOT_FREED, key)]

    events = await event_log.sync(*world.publishers)
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, PinSlotFreed)
    assert (event.cause, event.key, event.pin_id) == (ReaperCause.REPAIR, key, "deadbeefdeadbeef")
    assert event.revision == result.actions[0].revision
    entry = await world.kv.get(key)
    assert entry is not None and not PinSlotValue.from_json(entry.value).is_taken


class _BrokenSteps:
    """Reaper primitives whose first step fails and whose repair stalls."""

    def __init__(self, action: ReaperAction) -> None:
        self.action = action

    async def expire_leases(self, now: float) -> list[ReaperAction]:
        raise ConnectionError("NATS went away")

    async def expire_pins(self, now: float) -> list[ReaperAction]:
        return [self.action]

    async def repair(self, now: float, grace: float) -> list[ReaperAction]:
        await asyncio.Event().wait()  # a NATS call that never answers
        return []


async def test_a_failing_or_stalled_step_does_not_stop_the_pass(
    connect: Connect, event_log: EventLog
) -> None:
    action = ReaperAction(
        K.PIN_EXPIRED,
        f"pin.{model_key(MODEL)}.{session_id(3)}",
        42,
        IRIS,
        MODEL,
        session_id(3),
        "0123456789abcdef",
    )
    nc = await connect()
    metrics = ReaperMetrics()
    reaper = Reaper(
        _BrokenSteps(action),
        EventPublisher(nc, "reaper-x"),
        metrics,
        clock=SteppedClock(),
        interval=0.1,
        grace=60.0,
        step_timeout=0.05,
    )

    result = await reaper.run_pass()

    assert result.failed_steps == ("expire_leases", "repair")
    assert result.actions == (action,)
    sample = metrics.registry.get_sample_value
    assert sample("llmgw_reaper_step_failures_total", {"step": "expire_leases"}) == 1
    assert sample("llmgw_reaper_step_failures_total", {"step": "repair"}) == 1
    assert sample("llmgw_reaper_actions_total", {"kind": "pin_expired"}) == 1
    assert sample("llmgw_reaper_last_pass_timestamp_seconds") == 1_000.0
    events = await event_log.sync(nc)
    assert [(e.event, e.revision, e.instance) for e in events] == [
        (EventName.PIN_EXPIRED, 42, "reaper-x")
    ]


async def test_repair_leaves_alone_pins_and_leases_rewritten_while_it_lists(world: World) -> None:
    """Busy sessions rewrite their pin and lease keys all the time; a key being rewritten while
    the reaper lists the bucket is still live and must never look missing to repair."""
    sessions = [session_id(10 + n) for n in range(3)]
    first_leases = [await world.new_pin(session) for session in sessions]
    reaper = await world.reaper("reaper-a")
    world.clock.advance(reaper.grace + 1)  # every pin slot is old enough to be repaired
    held = []
    for lease in first_leases:
        renewed = await world.admission.renew_request_lease(lease)
        assert renewed is not None
        held.append(renewed)
    done = asyncio.Event()

    async def renewing(n: int) -> None:  # an edge renewing a long request's lease
        while not done.is_set():
            renewed = await world.admission.renew_request_lease(held[n])
            assert renewed is not None, "a renewed lease was reclaimed"
            held[n] = renewed

    async def requests_coming_and_going(session: str) -> None:  # each rewrites the pin twice
        while not done.is_set():
            admitted = await world.admission.try_admit_pinned_session_request(MODEL, session)
            assert admitted.lease is not None, admitted.result
            await world.admission.release_request_lease(admitted.lease, refresh_pin=True)

    traffic = [asyncio.create_task(renewing(n)) for n in range(len(sessions))]
    traffic += [asyncio.create_task(requests_coming_and_going(s)) for s in sessions]
    try:
        actions = [a for _ in range(40) for a in (await reaper.run_pass()).actions]
    finally:
        done.set()
        await asyncio.gather(*traffic)
    # Repair may finish a release that is in progress (unlist a lease whose slot was just
    # freed): harmless, the lease has ended. Anything else would reclaim something live.
    live = {lease.lease_id for lease in first_leases}
    assert [a for a in actions if a.kind != K.LEASE_UNLISTED or a.lease_id in live] == []
    for session, lease in zip(sessions, first_leases, strict=True):
        pin = await world.admission.get_pin(MODEL, session)
        assert pin is not None and list(pin.leases) == [lease.lease_id]
