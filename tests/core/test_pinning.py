"""The seed's algorithm, branch by branch, over the real routing state on MemoryKV."""

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from llmgw.config.catalog import Limits
from llmgw.core.pinning import PinningRouter, Rejection, Route
from llmgw.core.requests import Feature
from llmgw.state import MemoryKV
from llmgw.state.checker import check_history
from llmgw.state.routing_state import RoutingState

MODEL = "m.1"
LIMITS = {
    ("a", MODEL): Limits(
        max_pinned_sessions=2,
        max_global_in_flight_request_slots=3,
        global_in_flight_request_slots_reserved_for_pinned_sessions=1,
        max_per_session_in_flight_request_slots=1,
    ),
    ("b", MODEL): Limits(
        max_pinned_sessions=1,
        max_global_in_flight_request_slots=2,
        global_in_flight_request_slots_reserved_for_pinned_sessions=0,
        max_per_session_in_flight_request_slots=2,
    ),
    ("c", MODEL): None,  # unlimited
}


@dataclass
class Catalog:
    order: list[str] = field(default_factory=lambda: ["a", "b", "c"])
    degraded_providers: set[str] = field(default_factory=set)
    unsupported: set[tuple[str, Feature]] = field(default_factory=set)

    def in_priority_order(self):
        return self.order

    def supports(self, provider, model, feature):
        return model == MODEL and (provider, feature) not in self.unsupported

    def degraded(self, provider, model):
        return provider in self.degraded_providers and provider != "c"

    def is_unlimited(self, provider):
        return provider == "c"


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


async def yield_between_ops(op, key):
    await asyncio.sleep(0)


@pytest.fixture
async def world():
    kv = MemoryKV(before_op=yield_between_ops)
    state = RoutingState(kv, LIMITS, clock=Clock(), rng=random.Random(7))
    await state.start()
    catalog = Catalog()
    yield kv, state, catalog, PinningRouter(state, catalog)
    await state.close()
    assert check_history(kv.history, LIMITS, lease_timeout=state.lease_timeout) == []


async def test_unsupported_everywhere_is_rejected_without_touching_state(world):
    kv, _, catalog, router = world
    catalog.unsupported = {(p, Feature.EMBEDDINGS) for p in "abc"}
    assert await router.place(MODEL, Feature.EMBEDDINGS, None) is Rejection.UNSUPPORTED
    assert await router.place("other", Feature.CHAT, "s1") is Rejection.UNSUPPORTED
    assert kv.history == []


async def test_requests_without_session_take_a_temporary_lease_on_the_first_provider(world):
    _, _, _, router = world
    placed = await router.place(MODEL, Feature.CHAT, None)
    assert (placed.provider, placed.route, placed.refresh_pin_on_success) == (
        "a",
        Route.UNPINNED,
        False,
    )
    assert placed.lease is not None and placed.lease.session is None


async def test_first_request_pins_then_follows_the_pin(world):
    _, state, _, router = world
    first = await router.place(MODEL, Feature.CHAT, "s1")
    assert (first.provider, first.route) == ("a", Route.NEW_PIN)
    await state.release_request_lease(first.lease, refresh_pin=True)
    second = await router.place(MODEL, Feature.CHAT, "s1")
    assert (second.provider, second.route) == ("a", Route.PINNED)
    assert second.pin.id == first.pin.id


async def test_pin_limit_sends_new_sessions_down_the_priority_list(world):
    _, _, _, router = world
    placed = [await router.place(MODEL, Feature.CHAT, f"s{i}") for i in range(4)]
    assert [p.provider for p in placed] == ["a", "a", "b", "c"]
    assert all(p.route is Route.NEW_PIN for p in placed)
    assert placed[3].lease is not None  # unlimited pins still take leases


async def test_per_session_limit_falls_back_temporarily_and_keeps_the_pin(world):
    _, state, _, router = world
    first = await router.place(MODEL, Feature.CHAT, "s1")
    extra = await router.place(MODEL, Feature.CHAT, "s1")  # a allows 1 per session
    assert (extra.provider, extra.route, extra.refresh_pin_on_success) == (
        "b",
        Route.TEMPORARY,
        False,
    )
    pin = await state.get_pin(MODEL, "s1")
    assert pin.id == first.pin.id and pin.provider == "a"


async def test_degraded_provider_moves_the_pin_once(world):
    _, state, catalog, router = world
    first = await router.place(MODEL, Feature.CHAT, "s1")
    await state.release_request_lease(first.lease, refresh_pin=True)
    catalog.degraded_providers.add("a")
    moved = await router.place(MODEL, Feature.CHAT, "s1")
    assert (moved.provider, moved.route) == ("b", Route.REPINNED)
    await state.release_request_lease(moved.lease, refresh_pin=True)
    again = await router.place(MODEL, Feature.CHAT, "s1")
    assert (again.provider, again.route) == ("b", Route.PINNED)
    assert (await state.get_pin(MODEL, "s1")).id == moved.pin.id


async def test_repin_skips_full_targets_and_rejects_when_nothing_is_left(world):
    _, state, catalog, router = world
    pinned = await router.place(MODEL, Feature.CHAT, "s1")
    await state.release_request_lease(pinned.lease, refresh_pin=True)
    taken_b = await router.place(MODEL, Feature.CHAT, "s2")
    taken_b2 = await router.place(MODEL, Feature.CHAT, "s3")  # fills a's second pin slot
    assert taken_b.provider == "a" and taken_b2.provider == "b"
    catalog.degraded_providers.add("a")
    moved = await router.place(MODEL, Feature.CHAT, "s1")
    assert (moved.provider, moved.route) == ("c", Route.REPINNED)  # b is out of pin slots
    catalog.order = ["a", "b"]
    await state.release_request_lease(moved.lease, refresh_pin=True)
    catalog.degraded_providers.add("b")
    assert await router.place(MODEL, Feature.CHAT, "s9") is Rejection.UNAVAILABLE


async def test_many_concurrent_first_requests_of_one_session_make_exactly_one_pin(world):
    _, state, _, router = world
    router.max_routing_attempts = 50
    results = await asyncio.gather(*(router.place(MODEL, Feature.CHAT, "hot") for _ in range(40)))
    pin = await state.get_pin(MODEL, "hot")
    placed = [r for r in results if not isinstance(r, Rejection)]
    new_pins = [r for r in placed if r.route is Route.NEW_PIN]
    assert len(new_pins) == 1 and new_pins[0].pin.id == pin.id
    # Everyone else followed the pin or, past its per-session limit, fell back temporarily.
    for r in placed:
        assert r.route in (Route.NEW_PIN, Route.PINNED, Route.TEMPORARY)
        if r.route is Route.PINNED:
            assert r.pin.id == pin.id


async def test_overflow_runs_on_an_unlimited_provider_and_leaves_the_pin_alone(world):
    kv, state, catalog, router = world
    first = await router.place(MODEL, Feature.CHAT, "s1")
    await state.release_request_lease(first.lease, refresh_pin=True)
    writes = len(kv.history)
    assert router.can_overflow(MODEL, Feature.CHAT)
    placed = await router.place_overflow(MODEL, Feature.CHAT)
    assert (placed.provider, placed.route, placed.lease, placed.refresh_pin_on_success) == (
        "c",
        Route.OVERFLOW,
        None,
        False,
    )
    assert len(kv.history) == writes  # no pin, no lease: nothing written
    assert (await state.get_pin(MODEL, "s1")).provider == "a"
    catalog.unsupported = {("c", Feature.CHAT)}
    assert not router.can_overflow(MODEL, Feature.CHAT)
    assert await router.place_overflow(MODEL, Feature.CHAT) is Rejection.UNAVAILABLE
