"""Pins are written before the slots that name them: a creator paused for any length of time
can never make a pin that holds no pin slot (the race a time-based repair would have)."""

from __future__ import annotations

import random

from routing_helpers import GRACE, IRIS, LEASE_TIMEOUT, LIMITS, MODEL, SteppedClock, SteppedKV

from llmgw.core.leases import AdmissionResult, PinMatch
from llmgw.state import MemoryKV, check_history
from llmgw.state.routing_state import RoutingState


def _state(kv, clock, seed):
    return RoutingState(
        kv, LIMITS, clock=clock, rng=random.Random(seed), lease_timeout=LEASE_TIMEOUT
    )


async def test_a_creator_paused_past_every_timeout_cannot_pin_without_a_slot():
    inner = MemoryKV()
    clock = SteppedClock()
    slow_kv = SteppedKV(inner)
    slow = _state(slow_kv, clock, 1)
    reaper = _state(inner, clock, 2)
    other = _state(inner, clock, 3)
    for state in (slow, reaper, other):
        await state.start()

    async def pause_then_everyone_else_runs():
        # The slow creator stops after writing its pending pin and taking its pin slot;
        # far past every timeout the reaper repairs, and another instance pins the session.
        now = clock.advance(LEASE_TIMEOUT + GRACE + 1)
        await reaper.repair(now, GRACE)
        await reaper.repair(now, GRACE)
        admitted = await other.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
        assert admitted.result is AdmissionResult.ADMITTED

    slow_kv.on("create", "lease.", pause_then_everyone_else_runs)
    late = await slow.try_admit_unpinned_session_request(IRIS, MODEL, "s1")

    assert late.result is AdmissionResult.ALREADY_PINNED and late.lease is None
    pin = await other.get_pin(MODEL, "s1")
    assert pin is not None and not pin.pending
    usage = {(p.provider, p.model): p for p in (await reaper.usage()).pairs}[(IRIS, MODEL)]
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (1, 1, 1)
    assert check_history(inner.history, LIMITS, LEASE_TIMEOUT) == []


async def test_a_move_that_finds_the_target_full_puts_the_pin_back_with_its_slot():
    kv = MemoryKV()
    clock = SteppedClock()
    state = _state(kv, clock, 1)
    await state.start()
    first = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    await state.release_request_lease(first.lease, refresh_pin=True)
    # iris-b has one pin slot: fill it, then try to move s1 there.
    blocker = await state.try_admit_unpinned_session_request("iris-b", MODEL, "s2")
    assert blocker.result is AdmissionResult.ADMITTED
    pin = await state.get_pin(MODEL, "s1")

    moved = await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, "s1", "iris-b")

    assert moved.pin_match is PinMatch.MATCHED
    assert moved.admission.result is AdmissionResult.PIN_LIMIT_REACHED
    restored = await state.get_pin(MODEL, "s1")
    assert restored.id == pin.id and restored.pin_slot == pin.pin_slot and not restored.pending
    assert moved.admission.pin.revision == restored.revision  # usable as the next expectation
    # A repair pass in the middle of it all would not have freed the slot either.
    await state.repair(clock.advance(LEASE_TIMEOUT + GRACE + 1), GRACE)
    assert check_history(kv.history, LIMITS, LEASE_TIMEOUT) == []
    usage = {(p.provider, p.model): p for p in (await state.usage()).pairs}[(IRIS, MODEL)]
    assert usage.pin_slots_taken == 1
