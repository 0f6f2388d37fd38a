"""Releasing with the pin admission left behind: one read fewer, and still right when stale."""

from __future__ import annotations

import random

from routing_helpers import IRIS, LEASE_TIMEOUT, LIMITS, MODEL, SteppedClock

from llmgw.core.leases import AdmissionResult
from llmgw.state import MemoryKV, check_history
from llmgw.state.routing_state import RoutingState


class CountingKV(MemoryKV):
    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    async def get(self, key):
        self.gets += 1
        return await super().get(key)


async def _world():
    kv = CountingKV()
    state = RoutingState(
        kv, LIMITS, clock=SteppedClock(), rng=random.Random(5), lease_timeout=LEASE_TIMEOUT
    )
    await state.start()
    return kv, state


async def test_a_fresh_hint_saves_the_read_of_the_pin():
    kv, state = await _world()
    admitted = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    before = kv.gets
    await state.release_request_lease(admitted.lease, refresh_pin=True, pin=admitted.pin)
    assert kv.gets == before
    pin = await state.get_pin(MODEL, "s1")
    assert pin.leases == {}
    assert check_history(kv.history, LIMITS, LEASE_TIMEOUT) == []


async def test_a_stale_hint_costs_a_read_and_the_release_is_still_exact():
    kv, state = await _world()
    first = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    second = await state.try_admit_pinned_session_request(MODEL, "s1", pin=first.pin)
    assert second.result is AdmissionResult.ADMITTED  # the pin moved on: first.pin is stale
    await state.release_request_lease(first.lease, refresh_pin=True, pin=first.pin)
    pin = await state.get_pin(MODEL, "s1")
    assert set(pin.leases) == {second.lease.lease_id}
    await state.release_request_lease(second.lease, refresh_pin=True, pin=second.pin)
    assert (await state.get_pin(MODEL, "s1")).leases == {}
    assert check_history(kv.history, LIMITS, LEASE_TIMEOUT) == []
