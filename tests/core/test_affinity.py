"""Consistent hashing with bounded loads: affinity while there is room, a hard cap on every replica."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.affinity import HashRing, bounded_load_choice

REPLICAS = ["engine-1", "engine-2", "engine-3"]


def test_a_session_stays_on_its_replica_while_it_has_room():
    ring = HashRing(REPLICAS)
    first = bounded_load_choice(ring, "session-42", {}, 1.25)
    for load in range(5):
        loads = dict.fromkeys(REPLICAS, load)
        assert bounded_load_choice(ring, "session-42", loads, 1.25) == first


def test_sessions_spread_over_the_replicas():
    ring = HashRing(REPLICAS)
    homes = Counter(bounded_load_choice(ring, f"s{i}", {}, 1.25) for i in range(3000))
    assert set(homes) == set(REPLICAS)
    assert min(homes.values()) > 600  # roughly a third each


def test_an_overloaded_replica_spills_to_the_next_on_the_ring():
    ring = HashRing(REPLICAS)
    home = bounded_load_choice(ring, "busy", {}, 1.25)
    loads = dict.fromkeys(REPLICAS, 2)
    loads[home] = 10  # bound = ceil(1.25 * 15 / 3) = 7
    spill = bounded_load_choice(ring, "busy", loads, 1.25)
    assert spill != home and spill == next(r for r in ring.walk("busy") if r != home)


def test_removing_a_replica_moves_only_its_sessions():
    sessions = [f"s{i}" for i in range(2000)]
    before = {s: bounded_load_choice(HashRing(REPLICAS), s, {}, 10) for s in sessions}
    after = {
        s: bounded_load_choice(HashRing(REPLICAS), s, {}, 10, candidates=REPLICAS[:2])
        for s in sessions
    }
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(before[s] == "engine-3" for s in moved)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 500), min_size=1, max_size=400),
    st.floats(min_value=1.0, max_value=3.0),
    st.integers(1, 5),
)
def test_no_replica_ever_exceeds_the_bound(keys, factor, replicas):
    names = [f"r{i}" for i in range(replicas)]
    ring = HashRing(names)
    loads: Counter[str] = Counter()
    for key in keys:
        chosen = bounded_load_choice(ring, f"k{key}", loads, factor)
        total = sum(loads.values())
        assert loads[chosen] + 1 <= math.ceil(factor * (total + 1) / replicas)
        loads[chosen] += 1


def test_weights_give_heavier_replicas_more_of_the_ring():
    ring = HashRing({"big": 2.0, "small": 1.0})
    homes = Counter(bounded_load_choice(ring, f"s{i}", {}, 100) for i in range(4000))
    assert homes["big"] > 1.5 * homes["small"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="load_factor"):
        bounded_load_choice(HashRing(REPLICAS), "k", {}, 0.5)
    with pytest.raises(ValueError, match="at least one"):
        HashRing([])
    assert bounded_load_choice(HashRing(REPLICAS), "k", {}, 1.25, candidates=["gone"]) is None
