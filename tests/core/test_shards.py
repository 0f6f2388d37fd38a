"""Shards: every session has one, every instance computes the same owner, and a change of members
moves as few shards as it can."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.shards import (
    SHARD_TRANSITIONS,
    IllegalShardStep,
    Member,
    ShardPhase,
    ShardStep,
    desired_owner,
    live_members,
    next_phase,
    plan_shards,
    shard_of,
)

members_st = st.lists(
    st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=6, unique=True
)


@given(session=st.text(), shards=st.integers(1, 256))
def test_every_session_has_one_shard_in_range(session, shards):
    shard = shard_of(session, shards)
    assert 0 <= shard < shards and shard_of(session, shards) == shard


def test_a_hex_session_id_uses_its_own_digits():
    assert shard_of("0000000a" + "f" * 24, 8) == 10 % 8


@given(members=members_st, shard=st.integers(0, 63))
def test_everyone_agrees_on_the_owner_whatever_the_order(members, shard):
    assert desired_owner(shard, members) == desired_owner(shard, list(reversed(members)))


@given(members=members_st, newcomer=st.text("xyz", min_size=1, max_size=3))
def test_a_joining_member_takes_shards_only_for_itself(members, newcomer):
    before = {s: desired_owner(s, members) for s in range(64)}
    after = {s: desired_owner(s, [*members, newcomer]) for s in range(64)}
    for shard in range(64):
        assert after[shard] in (before[shard], newcomer)


def _members(names, now=100.0, joined=0.0):
    return {n: Member(n, now, joined) for n in names}


@given(names=members_st, owned=st.dictionaries(st.integers(0, 15), st.text("abcdefgh", max_size=4)))
def test_a_plan_claims_only_free_shards_it_should_own_and_hands_over_only_its_own(names, owned):
    me = names[0]
    live = _members(names)
    owners = {s: o or None for s, o in owned.items()}
    plan = plan_shards(me, 16, owners, live, 100.0, settle=2.0, max_release=16)
    for shard in plan.claim:
        assert desired_owner(shard, names) == me and owners.get(shard) not in live
    for shard, target in plan.release:
        assert owners.get(shard) == me and target != me and target in live
    assert not set(plan.claim) & {s for s, _ in plan.release}


def test_a_stopping_member_hands_everything_to_the_others():
    live = _members(["a", "b"])
    owners = dict.fromkeys(range(8), "a")
    plan = plan_shards("a", 8, owners, live, 100.0, settle=2.0, max_release=8, stopping=("a",))
    assert plan.claim == () and sorted(s for s, _ in plan.release) == list(range(8))
    assert {t for _, t in plan.release} == {"b"}


def test_a_member_that_just_joined_is_not_handed_shards_yet():
    live = {"a": Member("a", 100.0, 0.0), "b": Member("b", 100.0, 99.5)}  # b joined 0.5 s ago
    owners = dict.fromkeys(range(8), "a")
    assert plan_shards("a", 8, owners, live, 100.0, settle=2.0, max_release=8).release == ()


def test_dead_members_are_not_live():
    members = [Member("a", 100.0, 0.0), Member("b", 90.0, 0.0)]
    assert set(live_members(members, 101.0, ttl=5.0)) == {"a"}


# ---- one shard's lifecycle -------------------------------------------------------------------


def _reachable(start: ShardPhase) -> set[ShardPhase]:
    seen, todo = {start}, [start]
    while todo:
        phase = todo.pop()
        for (source, _), target in SHARD_TRANSITIONS.items():
            if source is phase and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_phase_can_end() -> None:
    """No phase is a dead end: from each, some steps lead back to GONE (nothing held here)."""
    for phase in ShardPhase:
        assert ShardPhase.GONE in _reachable(phase), phase


@given(steps=st.lists(st.sampled_from(list(ShardStep)), max_size=60))
def test_random_steps_never_reach_an_illegal_state(steps: list[ShardStep]) -> None:
    """Any sequence of events, illegal ones refused: a shard is served only after it was taken
    in (RECEIVING), at most once per stay here, never again once it started leaving, and it
    leaves through LEAVING (its subscriptions drained) unless it never served."""
    phase = ShardPhase.GONE
    received = served = left = False
    for step in steps:
        try:
            after = next_phase(phase, step)
        except IllegalShardStep:
            assert (phase, step) not in SHARD_TRANSITIONS
            continue
        assert after is SHARD_TRANSITIONS[(phase, step)]
        if after is ShardPhase.SERVING:
            assert phase is ShardPhase.RECEIVING and received and not served and not left
            served = True
        if after is ShardPhase.RECEIVING:
            assert not received and not served
            received = True
        if after is ShardPhase.LEAVING:
            assert received
            left = True
        if after is ShardPhase.GONE:
            assert not served or left, "a served shard leaves through LEAVING"
            received = served = left = False
        phase = after
    assert _reachable(phase) >= {ShardPhase.GONE}


def test_an_illegal_step_is_refused() -> None:
    with pytest.raises(IllegalShardStep):
        next_phase(ShardPhase.SERVING, ShardStep.SERVE)
    with pytest.raises(IllegalShardStep):
        next_phase(ShardPhase.LEAVING, ShardStep.SERVE)
    with pytest.raises(IllegalShardStep):
        next_phase(ShardPhase.GONE, ShardStep.END)
