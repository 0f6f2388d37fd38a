"""Two reaper loops on one bucket, in real time (lease timeout 1s, pin inactivity 2s, every
100ms): abandoned leases and idle pins are reclaimed exactly once each, announced exactly once,
and a pin whose lease keeps being renewed outlives its inactivity timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from reaper_helpers import IRIS, MODEL, TENSORX, WAIT, Connect, EventLog, session_id

from llmgw.config import Config
from llmgw.core.leasekeys import LeaseSlotValue
from llmgw.core.leases import AdmissionResult, Lease, ReaperActionKind, ReleaseResult
from llmgw.events import EventName, LeaseUnlisted, PinSlotFreed, ReaperCause
from llmgw.services.reaper.main import open_reaper
from llmgw.state import open_routing_bucket
from llmgw.state.routing_state import RoutingState
from llmgw.state.setup import open_routing_state


async def _new_pin(state: RoutingState, provider: str, session: str) -> Lease:
    admission = await state.try_admit_unpinned_session_request(provider, MODEL, session)
    assert admission.result == AdmissionResult.ADMITTED and admission.lease is not None
    return admission.lease


async def _keep_renewed(state: RoutingState, renewals: list[Lease], done: asyncio.Event) -> None:
    """What an edge does while its request runs: renew every 200ms (timeout 1s) until done."""
    while not done.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.2):
                await done.wait()
                return
        renewed = await state.renew_request_lease(renewals[-1])
        assert renewed is not None, "a renewed lease was reclaimed"
        renewals.append(renewed)


async def test_two_reapers_reclaim_each_abandoned_lease_and_idle_pin_exactly_once(
    config: Config, connect: Connect, event_log: EventLog
) -> None:
    # The only instance taking slots, on a new bucket: no slot mirror needed (see test_reaper_pass).
    admission = await open_routing_state(
        await connect(), config, instance_id="edge-test", follow_slots=False
    )
    kept_session = session_id(100)
    kept = await _new_pin(admission, IRIS, kept_session)  # first: the oldest pin of all
    renewals = [kept]
    request_done = asyncio.Event()
    renewer = asyncio.create_task(_keep_renewed(admission, renewals, request_done))

    # An edge dies holding these: nobody renews or releases them.
    abandoned_pins = {
        session_id(i): await _new_pin(admission, IRIS, session_id(i)) for i in range(3)
    }
    abandoned_pins[session_id(9)] = await _new_pin(admission, TENSORX, session_id(9))
    temporaries = []
    for _ in range(2):
        admitted = await admission.try_admit_request_without_pin(IRIS, MODEL)
        assert admitted.lease is not None
        temporaries.append(admitted.lease)
    abandoned = [*abandoned_pins.values(), *temporaries]

    reaper_connections = [await connect(), await connect()]
    reapers = []
    for n, nc in enumerate(reaper_connections):
        reaper, routing = await open_reaper(nc, config, instance=f"reaper-{n}")
        reapers.append((reaper, routing))
    stop = asyncio.Event()
    loops = [asyncio.create_task(reaper.run(stop)) for reaper, _ in reapers]
    try:
        await event_log.wait_until(
            lambda log: {e.session for e in log.named(EventName.PIN_EXPIRED)} >= set(abandoned_pins)
        )
        # The idle pins expired, so now >= their refreshed_at + 2s >= the kept pin's. Two
        # more passes of each reaper: at least one whole pass ran after that moment.
        for reaper, _ in reapers:
            async with asyncio.timeout(WAIT):
                await reaper.wait_for_passes(reaper.passes + 2)
    finally:
        stop.set()
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*loops)
        request_done.set()
        async with asyncio.timeout(WAIT):
            await renewer
    assert time.time() >= kept.granted_at + config.pinning.pin_inactivity_timeout
    events = await event_log.sync(*reaper_connections)

    expired = Counter(e.lease_id for e in events if e.event == EventName.LEASE_EXPIRED)
    assert expired == Counter({lease.lease_id: 1 for lease in abandoned})
    pins_expired = Counter(e.session for e in events if e.event == EventName.PIN_EXPIRED)
    assert pins_expired == Counter(dict.fromkeys(abandoned_pins, 1))
    unlisted = [e for e in events if isinstance(e, LeaseUnlisted)]
    assert sorted(e.lease_id for e in unlisted) == sorted(
        lease.lease_id for lease in abandoned_pins.values()
    )
    assert {e.cause for e in unlisted} == {ReaperCause.EXPIRY}
    freed = [e for e in events if isinstance(e, PinSlotFreed)]
    assert sorted(e.session for e in freed) == sorted(
        s for s, lease in abandoned_pins.items() if lease.provider == IRIS
    )
    assert {e.instance for e in events} <= {"reaper-0", "reaper-1"}
    assert kept_session not in {e.session for e in events}

    # Each change was counted by exactly one of the two reapers.
    counted = sum(
        reaper.metrics.registry.get_sample_value(
            "llmgw_reaper_actions_total", {"kind": ReaperActionKind.LEASE_EXPIRED.value}
        )
        or 0
        for reaper, _ in reapers
    )
    assert counted == len(abandoned)

    # The bucket agrees: slots free, unlimited lease records gone, the kept pin intact.
    kv = await open_routing_bucket(reaper_connections[0].jetstream(), config.pinning.bucket)
    for lease in abandoned:
        entry = await kv.get(lease.key)
        if lease.slot is None:
            assert entry is None
        else:
            assert entry is not None and not LeaseSlotValue.from_json(entry.value).is_taken
    pin = await admission.get_pin(MODEL, kept_session)
    assert pin is not None and list(pin.leases) == [kept.lease_id]
    usage = await admission.usage()
    iris = next(p for p in usage.pairs if p.provider == IRIS and p.model == MODEL)
    assert (iris.pins, iris.pin_slots_taken, iris.leases) == (1, 1, 1)

    released = await admission.release_request_lease(renewals[-1], refresh_pin=True)
    assert released == ReleaseResult.RELEASED
    for _, routing in reapers:
        await routing.close()
    await admission.close()
