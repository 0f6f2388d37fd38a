"""RoutingState conformance: every result of every operation, once over MemoryKV and once over
NatsKV on a real nats-server. Each test ends by replaying the bucket's whole history through the
invariant checker (I2a-d, double grants, pin expiry under a lease): it must find nothing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from routing_helpers import (
    GRACE,
    IRIS,
    IRIS_B,
    LEASE_TIMEOUT,
    LIMITS,
    MODEL,
    PIN_INACTIVITY_TIMEOUT,
    TENSORX,
    Crash,
    SteppedClock,
    SteppedKV,
    crash,
    yield_to_other_tasks,
)

from llmgw.core.leasekeys import LeaseKind, LeaseSlotValue, PinSlotValue
from llmgw.core.leases import (
    AdmissionResult,
    Lease,
    PairUsage,
    PinMatch,
    ReaperActionKind,
    ReleaseResult,
)
from llmgw.state import (
    HistoryRecorder,
    KVHistory,
    KVStore,
    MemoryHistory,
    MemoryKV,
    check_history,
    open_routing_bucket,
)
from llmgw.state.routing_state import RoutingState

R = AdmissionResult
WAIT = 5.0  # bound on one awaited event, never a sleep


@pytest_asyncio.fixture
async def nats_routing_bucket(
    nats_client: NatsClient, unique_id: str
) -> AsyncIterator[tuple[KVStore, KVHistory]]:
    js = nats_client.jetstream()
    name = f"routing_{unique_id}"
    # A deeper history than the product's 1 only so the recorder can never miss a write.
    store = await open_routing_bucket(js, name, history=16)
    recorder = await HistoryRecorder(js, name).start()
    try:
        yield store, recorder
    finally:
        await recorder.stop()
        await js.delete_key_value(name)


@pytest.fixture(params=["memory", "nats"])
def backend(request: pytest.FixtureRequest) -> tuple[KVStore, KVHistory]:
    if request.param == "memory":
        kv = MemoryKV(before_op=yield_to_other_tasks)
        return kv, MemoryHistory(kv)
    return request.getfixturevalue("nats_routing_bucket")


@dataclass
class World:
    kv: KVStore
    history: KVHistory
    clock: SteppedClock = field(default_factory=SteppedClock)
    states: list[RoutingState] = field(default_factory=list)

    async def state(self, seed: int = 1, kv: KVStore | None = None) -> RoutingState:
        state = RoutingState(
            kv or self.kv,
            LIMITS,
            clock=self.clock,
            rng=random.Random(seed),
            lease_timeout=LEASE_TIMEOUT,
            pin_inactivity_timeout=PIN_INACTIVITY_TIMEOUT,
            instance_id=f"edge{seed}",
        )
        await state.start()
        self.states.append(state)
        return state


@pytest_asyncio.fixture
async def world(backend: tuple[KVStore, KVHistory]) -> AsyncIterator[World]:
    kv, history = backend
    world = World(kv, history)
    try:
        yield world
    finally:
        for state in world.states:
            await state.close()
    entries = await history.sync(WAIT)
    violations = check_history(entries, LIMITS, LEASE_TIMEOUT)
    assert violations == [], "\n".join(map(str, violations))


async def usage_of(state: RoutingState, provider: str) -> PairUsage:
    usage = await state.usage()
    return next(p for p in usage.pairs if p.provider == provider and p.model == MODEL)


async def lease_value(kv: KVStore, lease: Lease) -> LeaseSlotValue | None:
    entry = await kv.get(lease.key)
    return None if entry is None else LeaseSlotValue.from_json(entry.value)


async def admit_new(state: RoutingState, session: str, provider: str = IRIS) -> Lease:
    admission = await state.try_admit_unpinned_session_request(provider, MODEL, session)
    assert admission.result == R.ADMITTED and admission.lease is not None
    return admission.lease


async def admit_temporary(state: RoutingState, provider: str = IRIS) -> Lease:
    admission = await state.try_admit_request_without_pin(provider, MODEL)
    assert admission.result == R.ADMITTED and admission.lease is not None
    return admission.lease


# ---- get_pin and new pins ---------------------------------------------------------------------


async def test_new_session_gets_a_pin_and_a_new_pin_lease_outside_the_reserve(world: World):
    state = await world.state()
    assert await state.get_pin(MODEL, "s1") is None

    admission = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")

    assert admission.result == R.ADMITTED
    pin, lease = admission.pin, admission.lease
    assert pin is not None and lease is not None
    assert (pin.provider, pin.model, pin.session) == (IRIS, MODEL, "s1")
    assert pin.pin_slot in (0, 1) and dict(pin.leases) == {lease.lease_id: lease.key}
    assert lease.kind == LeaseKind.NEW_PIN and lease.slot in (1, 2, 3)  # R = 1
    assert (lease.pin_id, lease.session, lease.provider) == (pin.id, "s1", IRIS)
    assert await state.get_pin(MODEL, "s1") == pin
    usage = await usage_of(state, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (1, 1, 1)


async def test_new_session_on_a_provider_without_limits_gets_a_lease_record(world: World):
    state = await world.state()
    admission = await state.try_admit_unpinned_session_request(TENSORX, MODEL, "s1")
    assert admission.result == R.ADMITTED
    assert admission.pin is not None and admission.pin.pin_slot is None
    assert admission.lease is not None and admission.lease.unlimited
    assert admission.lease.key.endswith(f".u{admission.lease.lease_id}")
    usage = await usage_of(state, TENSORX)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (1, 0, 1)


async def test_second_new_pin_of_a_session_is_already_pinned_and_gives_capacity_back(world: World):
    state = await world.state()
    first = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    second = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    assert (first.result, second.result) == (R.ADMITTED, R.ALREADY_PINNED)
    assert second.lease is None
    usage = await usage_of(state, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (1, 1, 1)


async def test_concurrent_new_pins_of_one_session_make_exactly_one_pin(world: World):
    states = [await world.state(seed) for seed in (1, 2, 3)]
    results = await asyncio.gather(
        *(
            s.try_admit_unpinned_session_request(provider, MODEL, "s1")
            for s, provider in zip(states, (IRIS, IRIS_B, TENSORX), strict=True)
        )
    )
    assert sorted(r.result for r in results).count(R.ADMITTED) == 1
    winner = next(r for r in results if r.result == R.ADMITTED)
    assert await states[0].get_pin(MODEL, "s1") == winner.pin
    assert all(r.result == R.ALREADY_PINNED for r in results if r is not winner)
    usage = (await states[0].usage()).pairs
    assert sum(p.leases for p in usage) == 1 and sum(p.pin_slots_taken for p in usage) <= 1


async def test_new_pin_beyond_max_pinned_sessions_is_refused(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    await admit_new(state, "s2")
    refused = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s3")
    assert (refused.result, refused.pin, refused.lease) == (R.PIN_LIMIT_REACHED, None, None)
    usage = await usage_of(state, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (2, 2, 2)


async def test_new_pin_without_an_unreserved_slot_is_refused_and_frees_its_pin_slot(world: World):
    state = await world.state()
    for _ in range(3):  # slots 1..3: all the unreserved ones
        await admit_temporary(state)
    refused = await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    assert refused.result == R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert await state.get_pin(MODEL, "s1") is None
    usage = await usage_of(state, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (0, 0, 3)


# ---- pinned requests --------------------------------------------------------------------------


async def test_request_of_an_unpinned_session_is_not_pinned(world: World):
    state = await world.state()
    admission = await state.try_admit_pinned_session_request(MODEL, "nobody")
    assert (admission.result, admission.pin, admission.lease) == (R.SESSION_NOT_PINNED, None, None)


async def test_pinned_request_takes_a_reserved_slot_and_is_listed_in_its_pin(world: World):
    state = await world.state()
    first = await admit_new(state, "s1")
    admission = await state.try_admit_pinned_session_request(MODEL, "s1")
    assert admission.result == R.ADMITTED
    lease, pin = admission.lease, admission.pin
    assert lease is not None and pin is not None
    assert lease.kind == LeaseKind.PINNED and lease.slot == 0  # prefers the reserve (R = 1)
    assert lease.pin_id == first.pin_id == pin.id
    assert set(pin.leases) == {first.lease_id, lease.lease_id}
    assert await state.get_pin(MODEL, "s1") == pin


async def test_pinned_request_on_a_provider_without_limits_gets_a_lease_record(world: World):
    state = await world.state()
    await admit_new(state, "s1", TENSORX)
    admission = await state.try_admit_pinned_session_request(MODEL, "s1")
    assert admission.result == R.ADMITTED and admission.lease is not None
    assert admission.lease.unlimited and admission.lease.kind == LeaseKind.PINNED
    assert admission.pin is not None and len(admission.pin.leases) == 2


async def test_pinned_request_with_the_pin_in_hand_skips_the_read_and_tolerates_staleness(
    world: World,
):
    state = await world.state()
    await admit_new(state, "s1")
    stale = await state.get_pin(MODEL, "s1")
    assert stale is not None
    fresh = await state.try_admit_pinned_session_request(MODEL, "s1", pin=stale)
    assert fresh.result == R.ADMITTED and fresh.pin is not None
    # `stale` is now one revision behind: the CAS fails, the pin is re-read, S is re-checked.
    refused = await state.try_admit_pinned_session_request(MODEL, "s1", pin=stale)
    assert refused.result == R.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert refused.pin == fresh.pin and (await usage_of(state, IRIS)).leases == 2
    moved = await state.try_compare_and_swap_pin_and_admit_request(fresh.pin, MODEL, "s1", TENSORX)
    assert moved.admission is not None and moved.admission.result == R.ADMITTED
    followed = await state.try_admit_pinned_session_request(MODEL, "s1", pin=stale)
    assert followed.result == R.ALREADY_PINNED and followed.pin == moved.admission.pin
    assert (await usage_of(state, IRIS)).leases == 2


async def test_pinned_requests_beyond_the_per_session_limit_are_refused(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    assert (await state.try_admit_pinned_session_request(MODEL, "s1")).result == R.ADMITTED
    refused = await state.try_admit_pinned_session_request(MODEL, "s1")  # S = 2
    assert refused.result == R.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert refused.pin is not None and len(refused.pin.leases) == 2 and refused.lease is None
    assert (await usage_of(state, IRIS)).leases == 2


async def test_pinned_request_without_any_free_slot_hits_the_global_limit(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    await admit_new(state, "s2")
    await admit_temporary(state)
    assert (await state.try_admit_pinned_session_request(MODEL, "s1")).result == R.ADMITTED
    refused = await state.try_admit_pinned_session_request(MODEL, "s2")
    assert refused.result == R.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert refused.pin is not None and refused.pin.session == "s2"
    assert (await usage_of(state, IRIS)).leases == 4


async def test_reserved_slots_serve_only_requests_of_existing_pins(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    await admit_temporary(state)
    await admit_temporary(state)  # unreserved slots 1..3 are now all taken
    assert (
        await state.try_admit_request_without_pin(IRIS, MODEL)
    ).result == R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert (
        await state.try_admit_unpinned_session_request(IRIS, MODEL, "s2")
    ).result == R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    pinned = await state.try_admit_pinned_session_request(MODEL, "s1")
    assert pinned.result == R.ADMITTED and pinned.lease is not None and pinned.lease.slot == 0
    usage = await usage_of(state, IRIS)
    assert usage.leases_by_kind == {"pinned": 1, "new_pin": 1, "temporary": 2}


async def test_pinned_request_follows_a_pin_moved_concurrently(world: World):
    other = await world.state(seed=2)
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    await admit_new(state, "s1")
    before = await state.get_pin(MODEL, "s1")
    assert before is not None

    async def move_pin() -> None:
        moved = await other.try_compare_and_swap_pin_and_admit_request(before, MODEL, "s1", TENSORX)
        assert moved.pin_match == PinMatch.MATCHED

    stepped.on("update", "pin.", move_pin)
    admission = await state.try_admit_pinned_session_request(MODEL, "s1")

    assert admission.result == R.ALREADY_PINNED and admission.lease is None
    assert admission.pin is not None and admission.pin.provider == TENSORX
    assert (await usage_of(state, IRIS)).leases == 1  # only the old pin's first lease


async def test_pinned_request_of_a_pin_expired_concurrently_is_not_pinned(world: World):
    reaper = await world.state(seed=2)
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    first = await admit_new(state, "s1")
    assert await state.release_request_lease(first, refresh_pin=False) == ReleaseResult.RELEASED
    world.clock.advance(PIN_INACTIVITY_TIMEOUT)

    async def expire() -> None:
        assert [a.kind for a in await reaper.expire_pins(world.clock.now)] == [
            ReaperActionKind.PIN_EXPIRED,
            ReaperActionKind.PIN_SLOT_FREED,
        ]

    stepped.on("update", "pin.", expire)
    admission = await state.try_admit_pinned_session_request(MODEL, "s1")

    assert (admission.result, admission.lease) == (R.SESSION_NOT_PINNED, None)
    usage = await usage_of(state, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (0, 0, 0)


async def test_pinned_request_retries_when_its_pin_gained_a_lease_concurrently(world: World):
    other = await world.state(seed=2)
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    await state.release_request_lease(await admit_new(state, "s1"), refresh_pin=False)

    async def concurrent_request() -> None:
        assert (await other.try_admit_pinned_session_request(MODEL, "s1")).result == R.ADMITTED

    stepped.on("update", "pin.", concurrent_request)
    admission = await state.try_admit_pinned_session_request(MODEL, "s1")

    assert admission.result == R.ADMITTED and admission.pin is not None
    assert len(admission.pin.leases) == 2
    assert await state.get_pin(MODEL, "s1") == admission.pin


async def test_pinned_request_rechecks_the_per_session_limit_after_a_conflict(world: World):
    other = await world.state(seed=2)
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    await admit_new(state, "s1")  # one lease; S = 2

    async def concurrent_request() -> None:
        assert (await other.try_admit_pinned_session_request(MODEL, "s1")).result == R.ADMITTED

    stepped.on("update", "pin.", concurrent_request)
    admission = await state.try_admit_pinned_session_request(MODEL, "s1")

    assert admission.result == R.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert admission.lease is None
    assert (await usage_of(state, IRIS)).leases == 2  # the refused request gave its slot back


# ---- repin ------------------------------------------------------------------------------------


async def test_repin_moves_the_pin_and_frees_the_old_pin_slot(world: World):
    state = await world.state()
    old_lease = await admit_new(state, "s1")
    old_pin = await state.get_pin(MODEL, "s1")
    assert old_pin is not None

    result = await state.try_compare_and_swap_pin_and_admit_request(old_pin, MODEL, "s1", IRIS_B)

    assert result.pin_match == PinMatch.MATCHED and result.admission is not None
    assert result.admission.result == R.ADMITTED
    new_pin, lease = result.admission.pin, result.admission.lease
    assert new_pin is not None and lease is not None
    assert (new_pin.provider, new_pin.pin_slot) == (IRIS_B, 0) and new_pin.id != old_pin.id
    assert dict(new_pin.leases) == {lease.lease_id: lease.key}
    assert (lease.provider, lease.kind, lease.slot) == (IRIS_B, LeaseKind.NEW_PIN, 1)
    assert await state.get_pin(MODEL, "s1") == new_pin
    old = await usage_of(state, IRIS)
    assert (old.pins, old.pin_slots_taken, old.leases) == (0, 0, 1)  # the old request runs on
    # Releasing the old request frees its slot and leaves the new pin alone.
    assert await state.release_request_lease(old_lease, refresh_pin=True) == ReleaseResult.RELEASED
    assert await state.get_pin(MODEL, "s1") == new_pin
    assert (await usage_of(state, IRIS)).leases == 0


async def test_repin_to_a_provider_without_limits(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None
    result = await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, "s1", TENSORX)
    assert result.pin_match == PinMatch.MATCHED and result.admission is not None
    assert result.admission.result == R.ADMITTED
    assert result.admission.lease is not None and result.admission.lease.unlimited
    assert (await usage_of(state, IRIS)).pin_slots_taken == 0


async def test_repin_from_a_stale_pin_does_not_match_and_gives_capacity_back(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    stale = await state.get_pin(MODEL, "s1")
    assert stale is not None
    assert (await state.try_admit_pinned_session_request(MODEL, "s1")).result == R.ADMITTED

    result = await state.try_compare_and_swap_pin_and_admit_request(stale, MODEL, "s1", IRIS_B)

    assert (result.pin_match, result.admission) == (PinMatch.NOT_MATCHED, None)
    target = await usage_of(state, IRIS_B)
    assert (target.pins, target.pin_slots_taken, target.leases) == (0, 0, 0)
    assert (await state.get_pin(MODEL, "s1")).provider == IRIS  # type: ignore[union-attr]


async def test_repin_without_pin_capacity_on_the_target_leaves_the_pin(world: World):
    state = await world.state()
    await admit_new(state, "other", IRIS_B)  # P = 1 on iris-b
    await admit_new(state, "s1")
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None
    result = await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, "s1", IRIS_B)
    assert result.pin_match == PinMatch.MATCHED and result.admission is not None
    assert result.admission.result == R.PIN_LIMIT_REACHED and result.admission.lease is None
    # The same pin again (written back after the pending move), at the revision handed back.
    current = await state.get_pin(MODEL, "s1")
    assert current is not None and current.value == pin.value
    assert result.admission.pin == current


async def test_repin_without_unreserved_capacity_on_the_target_frees_its_pin_slot(world: World):
    state = await world.state()
    await admit_temporary(state, IRIS_B)  # iris-b's only unreserved slot
    await admit_new(state, "s1")
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None
    result = await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, "s1", IRIS_B)
    assert result.pin_match == PinMatch.MATCHED and result.admission is not None
    assert result.admission.result == R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    current = await state.get_pin(MODEL, "s1")
    assert current is not None and current.value == pin.value
    target = await usage_of(state, IRIS_B)
    assert (target.pin_slots_taken, target.leases) == (0, 1)


# ---- temporary requests -----------------------------------------------------------------------


async def test_temporary_requests_use_unreserved_slots_until_they_run_out(world: World):
    state = await world.state()
    leases = [await admit_temporary(state) for _ in range(3)]
    assert sorted(lease.slot for lease in leases) == [1, 2, 3]  # type: ignore[type-var]
    assert all(lease.kind == LeaseKind.TEMPORARY and lease.pin_id is None for lease in leases)
    refused = await state.try_admit_request_without_pin(IRIS, MODEL)
    assert (refused.result, refused.lease) == (R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED, None)


async def test_temporary_request_to_a_provider_without_limits_needs_no_lease(world: World):
    state = await world.state()
    admission = await state.try_admit_request_without_pin(TENSORX, MODEL)
    assert (admission.result, admission.pin, admission.lease) == (R.ADMITTED, None, None)
    assert (await usage_of(state, TENSORX)).leases == 0


# ---- renew and release ------------------------------------------------------------------------


async def test_release_frees_the_slot_and_unlists_the_lease(world: World):
    state = await world.state()
    first = await admit_new(state, "s1")
    second = (await state.try_admit_pinned_session_request(MODEL, "s1")).lease
    assert second is not None
    world.clock.advance(5)

    assert await state.release_request_lease(first, refresh_pin=False) == ReleaseResult.RELEASED
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and set(pin.leases) == {second.lease_id}
    assert pin.refreshed_at == 1_000.0  # not refreshed
    value = await lease_value(world.kv, first)
    assert value is not None and not value.is_taken

    world.clock.advance(5)
    assert await state.release_request_lease(second, refresh_pin=True) == ReleaseResult.RELEASED
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and not pin.leases and pin.refreshed_at == 1_010.0
    assert (await usage_of(state, IRIS)).leases == 0


async def test_release_of_a_lease_record_deletes_it(world: World):
    state = await world.state()
    lease = await admit_new(state, "s1", TENSORX)
    assert await state.release_request_lease(lease, refresh_pin=True) == ReleaseResult.RELEASED
    assert await world.kv.get(lease.key) is None
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and not pin.leases
    assert await state.release_request_lease(lease, refresh_pin=True) == ReleaseResult.LOST


async def test_renew_moves_the_lease_forward_and_keeps_it_from_expiring(world: World):
    state = await world.state()
    lease = await admit_temporary(state)
    world.clock.advance(LEASE_TIMEOUT - 1)
    renewed = await state.renew_request_lease(lease)
    assert renewed is not None and renewed.revision > lease.revision
    assert renewed.renewed_at == world.clock.now and renewed.granted_at == lease.granted_at
    world.clock.advance(LEASE_TIMEOUT - 1)
    assert await state.expire_leases(world.clock.now) == []
    assert await state.renew_request_lease(lease) is None  # a stale revision is a lost lease
    assert await state.release_request_lease(renewed, False) == ReleaseResult.RELEASED


async def test_release_of_a_lost_lease_does_not_free_the_slot_granted_again(world: World):
    state = await world.state()
    lost = await admit_temporary(state, IRIS_B)  # iris-b has one unreserved slot
    world.clock.advance(LEASE_TIMEOUT)
    [expired] = await state.expire_leases(world.clock.now)
    assert (expired.kind, expired.lease_id) == (ReaperActionKind.LEASE_EXPIRED, lost.lease_id)
    regranted = await admit_temporary(state, IRIS_B)
    assert regranted.key == lost.key

    assert await state.release_request_lease(lost, refresh_pin=False) == ReleaseResult.LOST
    assert await state.renew_request_lease(lost) is None

    value = await lease_value(world.kv, regranted)
    assert value is not None and value.is_taken and value.lease_id == regranted.lease_id
    assert await state.renew_request_lease(regranted) is not None


async def test_release_of_a_lost_pinned_lease_leaves_the_pin_alone(world: World):
    state = await world.state()
    lease = await admit_new(state, "s1")
    world.clock.advance(LEASE_TIMEOUT)
    await state.expire_leases(world.clock.now)
    pinned = await state.try_admit_pinned_session_request(MODEL, "s1")
    assert pinned.result == R.ADMITTED and pinned.pin is not None
    assert await state.release_request_lease(lease, refresh_pin=True) == ReleaseResult.LOST
    assert await state.get_pin(MODEL, "s1") == pinned.pin  # not refreshed, lease still listed


# ---- reaper primitives ------------------------------------------------------------------------


async def test_expire_leases_reclaims_only_leases_past_their_timeout_and_unlists_them(world: World):
    state = await world.state()
    stale = await admit_new(state, "s1")
    fresh = (await state.try_admit_pinned_session_request(MODEL, "s1")).lease
    record = await admit_new(state, "s2", TENSORX)
    assert fresh is not None
    world.clock.advance(LEASE_TIMEOUT - 1)
    fresh = await state.renew_request_lease(fresh)
    assert fresh is not None
    assert await state.expire_leases(world.clock.now) == []
    world.clock.advance(1)

    actions = await state.expire_leases(world.clock.now)

    assert sorted((a.kind, a.lease_id) for a in actions) == sorted(
        [
            (ReaperActionKind.LEASE_EXPIRED, stale.lease_id),
            (ReaperActionKind.LEASE_UNLISTED, stale.lease_id),
            (ReaperActionKind.LEASE_EXPIRED, record.lease_id),
            (ReaperActionKind.LEASE_UNLISTED, record.lease_id),
        ]
    )
    assert await world.kv.get(record.key) is None
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and set(pin.leases) == {fresh.lease_id}
    assert (await usage_of(state, IRIS)).leases == 1


async def test_two_reapers_reclaim_each_expired_lease_once(world: World):
    reapers = [await world.state(seed) for seed in (1, 2)]
    leases = [await admit_temporary(reapers[0]) for _ in range(3)]
    world.clock.advance(LEASE_TIMEOUT)
    results = await asyncio.gather(*(r.expire_leases(world.clock.now) for r in reapers))
    expired = sorted(a.lease_id for actions in results for a in actions)  # type: ignore[type-var]
    assert expired == sorted(lease.lease_id for lease in leases)


async def test_idle_pin_expires_only_once_it_holds_no_lease_and_frees_its_pin_slot(world: World):
    state = await world.state()
    lease = await admit_new(state, "s1")
    world.clock.advance(PIN_INACTIVITY_TIMEOUT + LEASE_TIMEOUT)
    assert await state.expire_pins(world.clock.now) == []  # its (dead) lease is still listed
    await state.expire_leases(world.clock.now)

    actions = await state.expire_pins(world.clock.now)

    assert [(a.kind, a.pin_id) for a in actions] == [
        (ReaperActionKind.PIN_EXPIRED, lease.pin_id),
        (ReaperActionKind.PIN_SLOT_FREED, lease.pin_id),
    ]
    assert await state.get_pin(MODEL, "s1") is None
    usage = await usage_of(state, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (0, 0, 0)
    await admit_new(state, "s2")
    await admit_new(state, "s3")  # both pin slots are usable again


async def test_refreshed_pin_lives_for_the_inactivity_timeout_after_its_last_request(world: World):
    state = await world.state()
    lease = await admit_new(state, "s1")
    world.clock.advance(100)
    await state.release_request_lease(lease, refresh_pin=True)
    world.clock.advance(PIN_INACTIVITY_TIMEOUT - 1)
    assert await state.expire_pins(world.clock.now) == []
    world.clock.advance(1)
    assert [a.kind for a in await state.expire_pins(world.clock.now)] == [
        ReaperActionKind.PIN_EXPIRED,
        ReaperActionKind.PIN_SLOT_FREED,
    ]


async def test_repair_deletes_a_pending_pin_whose_creator_died_and_frees_its_slot(world: World):
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    reaper = await world.state(seed=2)
    stepped.on("update", "pin.", crash)  # dies just before activating its pending pin
    with pytest.raises(Crash):
        await state.try_admit_unpinned_session_request(IRIS, MODEL, "s1")
    pending = await reaper.get_pin(MODEL, "s1")
    assert pending is not None and pending.pending
    usage = await usage_of(reaper, IRIS)
    assert (usage.pin_slots_taken, usage.leases) == (1, 1)

    assert await reaper.repair(world.clock.now, GRACE) == []  # might still be in progress
    world.clock.advance(max(GRACE, LEASE_TIMEOUT))
    kinds = sorted(a.kind for a in await reaper.repair(world.clock.now, GRACE))
    assert kinds == [ReaperActionKind.ABANDONED_PIN_DELETED, ReaperActionKind.ORPHAN_PIN_SLOT_FREED]
    [expired] = await reaper.expire_leases(world.clock.now)  # no pin to unlist it from
    assert expired.kind == ReaperActionKind.LEASE_EXPIRED
    usage = await usage_of(reaper, IRIS)
    assert (usage.pins, usage.pin_slots_taken, usage.leases) == (0, 0, 0)
    assert await reaper.get_pin(MODEL, "s1") is None


async def test_repair_frees_the_pin_slot_of_an_expiry_that_died_after_deleting_the_pin(
    world: World,
):
    stepped = SteppedKV(world.kv)
    crashing_reaper = await world.state(seed=1, kv=stepped)
    state = await world.state(seed=2)
    await state.release_request_lease(await admit_new(state, "s1"), refresh_pin=False)
    world.clock.advance(PIN_INACTIVITY_TIMEOUT)
    stepped.on("update", "pslot.", crash)
    with pytest.raises(Crash):
        await crashing_reaper.expire_pins(world.clock.now)
    assert await state.get_pin(MODEL, "s1") is None
    assert (await usage_of(state, IRIS)).pin_slots_taken == 1

    [repaired] = await state.repair(world.clock.now, GRACE)

    assert repaired.kind == ReaperActionKind.ORPHAN_PIN_SLOT_FREED
    assert (await usage_of(state, IRIS)).pin_slots_taken == 0


async def test_repair_frees_the_old_pin_slot_of_a_repin_that_died_half_way(world: World):
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    await admit_new(state, "s1")
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None
    world.clock.advance(GRACE)
    stepped.on("update", f"pslot.{IRIS}.", crash)  # the old pin slot, after the pin moved
    with pytest.raises(Crash):
        await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, "s1", IRIS_B)
    assert (await state.get_pin(MODEL, "s1")).provider == IRIS_B  # type: ignore[union-attr]

    [repaired] = await state.repair(world.clock.now, GRACE)

    assert (repaired.kind, repaired.pin_id) == (ReaperActionKind.ORPHAN_PIN_SLOT_FREED, pin.id)
    assert (await usage_of(state, IRIS)).pin_slots_taken == 0
    assert (await usage_of(state, IRIS_B)).pin_slots_taken == 1


async def test_repin_leaves_its_old_pin_slot_alone_once_another_pin_holds_it(world: World):
    other = await world.state(seed=2)
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    await admit_new(state, "s1")
    await admit_new(state, "s3")  # iris's other pin slot
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None
    world.clock.advance(GRACE)

    async def repair_then_pin_another_session() -> None:
        # The pin has moved: to a repair the old pin slot is an orphan, and it is re-granted.
        [repaired] = await other.repair(world.clock.now, GRACE)
        assert repaired.kind == ReaperActionKind.ORPHAN_PIN_SLOT_FREED
        assert (await other.try_admit_unpinned_session_request(IRIS, MODEL, "s2")).result == (
            R.ADMITTED
        )

    stepped.on("update", f"pslot.{IRIS}.", repair_then_pin_another_session)
    result = await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, "s1", IRIS_B)

    assert result.admission is not None and result.admission.result == R.ADMITTED
    s2 = await state.get_pin(MODEL, "s2")
    assert s2 is not None and s2.pin_slot == pin.pin_slot
    assert (await usage_of(state, IRIS)).pin_slots_taken == 2  # s2's and s3's


async def test_repair_unlists_a_lease_whose_release_died_before_unlisting(world: World):
    stepped = SteppedKV(world.kv)
    state = await world.state(seed=1, kv=stepped)
    lease = await admit_new(state, "s1")
    stepped.on("get", "pin.", crash)  # the release's second step
    with pytest.raises(Crash):
        await state.release_request_lease(lease, refresh_pin=True)
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and lease.lease_id in pin.leases

    [repaired] = await state.repair(world.clock.now, GRACE)

    assert (repaired.kind, repaired.lease_id) == (ReaperActionKind.LEASE_UNLISTED, lease.lease_id)
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and not pin.leases
    world.clock.advance(PIN_INACTIVITY_TIMEOUT)
    assert len(await state.expire_pins(world.clock.now)) == 2  # now it can expire


async def test_repair_leaves_pins_slots_and_leases_of_healthy_sessions_alone(world: World):
    state = await world.state()
    await admit_new(state, "s1")
    await admit_new(state, "s2", TENSORX)
    assert (await state.try_admit_pinned_session_request(MODEL, "s1")).result == R.ADMITTED
    world.clock.advance(GRACE)
    assert await state.repair(world.clock.now, GRACE) == []


# ---- several instances ------------------------------------------------------------------------


async def test_an_instance_sees_capacity_taken_and_freed_by_another(world: World):
    first = await world.state(seed=1)
    second = await world.state(seed=2)
    leases = [await admit_temporary(first, IRIS) for _ in range(3)]
    async with asyncio.timeout(WAIT):
        for lease in leases:
            await second.mirror.wait_until_seen(lease.key, lease.revision)
    conflicts = second.cas_conflicts
    refused = await second.try_admit_request_without_pin(IRIS, MODEL)
    assert refused.result == R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert second.cas_conflicts == conflicts  # decided from its mirror, no blind attempt
    assert await first.release_request_lease(leases[0], False) == ReleaseResult.RELEASED
    entry = await world.kv.get(leases[0].key)
    assert entry is not None
    async with asyncio.timeout(WAIT):
        await second.mirror.wait_until_seen(entry.key, entry.revision)
    regranted = await admit_temporary(second, IRIS)
    assert regranted.key == leases[0].key and second.cas_conflicts == conflicts


async def test_a_stale_mirror_costs_a_conflict_never_a_double_grant(world: World):
    first = await world.state(seed=1)
    second = await world.state(seed=2)
    await second.mirror.close()  # second's mirror stops following the bucket
    taken = await admit_temporary(first, IRIS_B)  # iris-b's only unreserved slot
    refused = await second.try_admit_request_without_pin(IRIS_B, MODEL)
    assert refused.result == R.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert second.cas_conflicts == 1
    value = await lease_value(world.kv, taken)
    assert value is not None and value.lease_id == taken.lease_id


async def test_pin_slot_value_names_the_pin_that_holds_it(world: World):
    state = await world.state()
    lease = await admit_new(state, "s1")
    pin = await state.get_pin(MODEL, "s1")
    assert pin is not None and pin.pin_slot is not None
    [entry] = [
        e for e in await world.kv.list(f"pslot.{IRIS}.") if e.key.endswith(f".{pin.pin_slot}")
    ]
    slot = PinSlotValue.from_json(entry.value)
    assert (slot.is_taken, slot.pin_id, slot.session) == (True, lease.pin_id, "s1")
