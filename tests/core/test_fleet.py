"""The live fleet's pure decisions: which endpoints take new work, when one may be removed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.fleet import (
    EndpointState,
    FleetView,
    HeartbeatVerdict,
    RemoveVerdict,
    heartbeat_verdict,
    placeable,
    remove_verdict,
    seed_missing,
)

ids = st.lists(st.sampled_from([f"e{i}" for i in range(8)]), unique=True)
states = st.sampled_from(list(EndpointState))


@given(st.dictionaries(st.sampled_from([f"e{i}" for i in range(8)]), states), ids)
def test_only_active_endpoints_of_the_fleet_take_new_work_in_the_given_order(table, asked):
    view = FleetView(table)
    chosen = placeable(view, asked)
    assert chosen == [e for e in asked if table.get(e) is EndpointState.ACTIVE]
    assert not set(chosen) & view.draining


@given(states, st.integers(0, 50), st.booleans())
def test_an_endpoint_is_removed_only_drained_and_empty_unless_forced(state, leases, force):
    verdict = remove_verdict(state, leases, force=force)
    if force:
        assert verdict is RemoveVerdict.REMOVE
    elif state is EndpointState.ACTIVE:
        assert verdict is RemoveVerdict.NOT_DRAINING
    else:
        assert verdict is (RemoveVerdict.REMOVE if leases == 0 else RemoveVerdict.LEASES_LEFT)


def test_an_endpoint_the_fleet_does_not_hold_cannot_be_removed():
    assert remove_verdict(None, 0, force=True) is RemoveVerdict.UNKNOWN


@given(ids, ids)
def test_seeding_writes_exactly_the_configured_endpoints_the_fleet_lacks(configured, live):
    missing = seed_missing(configured, live)
    assert missing == [e for e in configured if e not in live]


@given(
    states,
    st.floats(0, 100),
    st.floats(0.1, 30),
    st.floats(0, 200),
    st.one_of(st.none(), st.integers(0, 5)),
)
def test_a_silent_registration_is_drained_after_its_ttl_and_removed_only_drained_and_empty(
    state, heartbeat_at, ttl, now, leases
):
    verdict = heartbeat_verdict(state, heartbeat_at, ttl, now, leases)
    silent = now - heartbeat_at
    if silent <= ttl:
        assert verdict is HeartbeatVerdict.KEEP
    elif state is EndpointState.ACTIVE:
        assert verdict is HeartbeatVerdict.DRAIN
    if verdict is HeartbeatVerdict.REMOVE:
        assert state is EndpointState.DRAINING and leases == 0 and silent > 2 * ttl
