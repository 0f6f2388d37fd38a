"""Properties of the pure routing-state rules: slot choice, slot ranges, expiry predicates."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.leasekeys import LeaseKind, LeaseSlotValue, PinValue
from llmgw.core.leases import (
    choose_slot,
    lease_is_expired,
    lease_slot_ranges,
    new_token,
    pin_is_idle_expired,
)


@dataclass(frozen=True)
class Limits:
    max_pinned_sessions: int
    max_global_in_flight_request_slots: int
    global_in_flight_request_slots_reserved_for_pinned_sessions: int
    max_per_session_in_flight_request_slots: int = 1


limits_strategy = st.integers(1, 40).flatmap(
    lambda g: st.builds(Limits, st.integers(0, 10), st.just(g), st.integers(0, g))
)


@given(
    st.integers(0, 60),
    st.integers(0, 60),
    st.sets(st.integers(0, 80)),
    st.sets(st.integers(0, 80)),
    st.integers(),
)
def test_choose_slot_picks_a_free_untried_index_in_range_or_none_only_if_none_exists(
    start, length, taken, tried, seed
):
    slots = range(start, start + length)
    chosen = choose_slot(taken, slots, tried, random.Random(seed))
    available = [i for i in slots if i not in taken and i not in tried]
    if chosen is None:
        assert available == []
    else:
        assert chosen in available


def test_choose_slot_spreads_choices_over_the_free_slots():
    rng = random.Random(7)
    picks = {choose_slot({0, 5}, range(0, 10), {9}, rng) for _ in range(400)}
    assert picks == {1, 2, 3, 4, 6, 7, 8}


@given(limits_strategy)
def test_only_pinned_leases_may_use_the_reserve_and_pinned_leases_prefer_it(limits):
    slots = limits.max_global_in_flight_request_slots
    reserved = limits.global_in_flight_request_slots_reserved_for_pinned_sessions
    pinned = [i for r in lease_slot_ranges(limits, LeaseKind.PINNED) for i in r]
    assert pinned == list(range(slots))  # reserve first, then the rest
    for kind in (LeaseKind.NEW_PIN, LeaseKind.TEMPORARY):
        assert [i for r in lease_slot_ranges(limits, kind) for i in r] == list(
            range(reserved, slots)
        )


@given(st.floats(0, 1e6), st.floats(0, 1e4), st.floats(0.1, 1e3))
def test_a_lease_expires_exactly_lease_timeout_after_its_last_renewal(renewed_at, age, timeout):
    lease = LeaseSlotValue.taken(
        "l1", LeaseKind.PINNED, session="s", pin_id="p", edge_id="e", granted_at=renewed_at
    )
    assert lease_is_expired(lease, renewed_at + age, timeout) == (
        renewed_at + age >= renewed_at + timeout
    )
    assert not lease_is_expired(LeaseSlotValue.free(), renewed_at + age, timeout)


@given(st.floats(0, 1e6), st.floats(0, 1e4), st.floats(0.1, 1e3), st.booleans())
def test_a_pin_expires_only_without_leases_after_its_inactivity_timeout(
    refreshed_at, age, timeout, has_lease
):
    pin = PinValue("p", "iris", "m", "s", 0, {"l1": "lease.k"} if has_lease else {}, refreshed_at)
    expired = pin_is_idle_expired(pin, refreshed_at + age, timeout)
    assert expired == (not has_lease and refreshed_at + age >= refreshed_at + timeout)


def test_new_tokens_are_safe_16_hex_digit_ids():
    rng = random.Random(1)
    tokens = {new_token(rng) for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) == 16 and int(t, 16) >= 0 for t in tokens)
