"""Flow control's pure core: queues with tenant round robin, the arrival gate, dispatch planning."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.engine_metrics import EngineDialect, EngineSample
from llmgw.core.flow import (
    BandPolicy,
    FlowQueues,
    GateDecision,
    PoolView,
    Waiter,
    gate,
    plan_dispatch,
)
from llmgw.core.saturation import EndpointLoad, SaturationSettings

SETTINGS = SaturationSettings(target_waiting=4, kv_ceiling=0.9, stale_after=10)
NOW = 1000.0
BANDS = [
    BandPolicy("platinum", 400, 1.0, overflow=True),
    BandPolicy("gold", 300, 0.85, overflow=True),
    BandPolicy("silver", 200, 0.6),
    BandPolicy("bronze", 100, 0.3),
]


def pool(
    capacities: list[int],
    running: list[int],
    waiting: list[int] | None = None,
    pending: list[int] | None = None,
) -> PoolView:
    waiting = waiting or [0] * len(capacities)
    pending = pending or [0] * len(capacities)
    loads, inflight = {}, {}
    for i, (cap, run, wait, extra) in enumerate(
        zip(capacities, running, waiting, pending, strict=True)
    ):
        sample = EngineSample(EngineDialect.VLLM, run, wait, 0.1)
        # Capacities as configured (stated): a count above one is queue.
        loads[f"e{i}"] = EndpointLoad(max(cap, run), sample, NOW - 1, stated=True)
        inflight[f"e{i}"] = run + wait + extra
    return PoolView(loads, inflight, NOW, SETTINGS)


def waiter(
    i: int, tenant: str = "t", band: str = "bronze", model: str = "m", at: float = NOW
) -> Waiter:
    return Waiter(f"r{i}", model, band, tenant, at)


# ---- queues -----------------------------------------------------------------------------------


def test_a_noisy_tenant_takes_one_place_in_the_rotation():
    queues = FlowQueues(BANDS, 10_000, 30)
    for i in range(1000):
        assert queues.offer(waiter(i, "noisy"))
    queues.offer(waiter(5000, "quiet"))
    queues.offer(waiter(5001, "quiet"))
    first_four = [queues.take("m", "bronze").tenant for _ in range(4)]
    assert first_four == ["noisy", "quiet", "noisy", "quiet"]
    assert queues.depth("bronze") == 998


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=120))
def test_rotation_serves_tenants_in_turn_and_each_tenant_in_order(arrivals):
    """With everything queued, the take order visits each tenant once per round, FIFO within."""
    queues = FlowQueues(BANDS, 10_000, 30)
    per_tenant: dict[str, list[str]] = {}
    for i, (tenant, _) in enumerate(arrivals):
        w = waiter(i, f"t{tenant}")
        queues.offer(w)
        per_tenant.setdefault(w.tenant, []).append(w.request_id)
    taken = []
    while (w := queues.take("m", "bronze")) is not None:
        taken.append(w)
    assert len(taken) == len(arrivals) and len(queues) == 0
    for tenant, ids in per_tenant.items():
        assert [w.request_id for w in taken if w.tenant == tenant] == ids
    # Round k (the k-th request of each tenant) finishes before round k+1 starts.
    seen: Counter[str] = Counter()
    rounds = []
    for w in taken:
        seen[w.tenant] += 1
        rounds.append(seen[w.tenant])
    assert rounds == sorted(rounds)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["offer", "take", "cancel", "expire"]),
            st.integers(0, 30),
            st.sampled_from(["bronze", "gold"]),
        ),
        max_size=150,
    )
)
def test_every_waiter_leaves_exactly_once_and_depth_stays_bounded(ops):
    capacity, ttl = 5, 3.0
    queues = FlowQueues(BANDS, capacity, ttl)
    clock = NOW
    queued: dict[str, Waiter] = {}
    left: list[str] = []
    for n, (op, x, band) in enumerate(ops):
        clock += 0.5
        if op == "offer":
            w = Waiter(f"r{n}", "m", band, f"t{x % 3}", clock)
            full = queues.depth(band) >= capacity
            assert queues.offer(w) is not full
            if not full:
                queued[w.request_id] = w
        elif op == "take":
            w = queues.take("m", band)
            if w is not None:
                left.append(w.request_id)
        elif op == "cancel":
            target = f"r{x}"
            w = queues.cancel(target)
            assert (w is not None) == (target in queued and target not in left)
            if w is not None:
                left.append(w.request_id)
        else:
            for w in queues.expire(clock):
                assert clock - w.enqueued_at >= ttl
                left.append(w.request_id)
        for b in ("bronze", "gold"):
            assert 0 <= queues.depth(b) <= capacity
        assert len(left) == len(set(left))
        assert len(queues) == len(queued) - len(left)
    assert all(queued[r].done for r in left)


# ---- the arrival gate ---------------------------------------------------------------------------


def test_an_unsaturated_pool_never_makes_anyone_wait():
    idle = pool([8, 8], [2, 3])
    for band in BANDS:
        assert gate(band, idle, waiting_at_or_above=0) is GateDecision.GRANTED
    assert gate(BANDS[3], idle, waiting_at_or_above=1) is GateDecision.QUEUED  # someone is ahead


def test_saturated_pool_overflows_interactive_bands_and_queues_batch_bands():
    busy = pool([8, 8], [8, 8], waiting=[4, 4])  # queue 4 each: saturation 1.0
    assert gate(BANDS[0], busy, 0) is GateDecision.GRANTED  # 1.0 is within platinum's ceiling
    assert gate(BANDS[1], busy, 0) is GateDecision.OVERFLOW
    assert gate(BANDS[3], busy, 0) is GateDecision.QUEUED
    assert gate(BANDS[3], None, 5) is GateDecision.GRANTED  # no managed pool: nothing to protect


def test_stale_endpoints_count_as_saturated_never_as_idle():
    stale = PoolView(
        {"e0": EndpointLoad(8, EngineSample(EngineDialect.VLLM, 0, 0, 0.0), NOW - 60, stated=True)},
        {"e0": 0},
        NOW,
        SETTINGS,
    )
    assert stale.saturation() == 1.0
    assert gate(BANDS[3], stale, 0) is GateDecision.QUEUED
    assert gate(BANDS[0], stale, 0) is GateDecision.GRANTED  # "up to the healthy limit"


def test_grants_not_yet_in_engine_metrics_count_so_a_burst_cannot_pass_en_masse():
    view = pool([8], [8])  # batch full, nothing queued: saturation 0
    granted = 0
    while view.saturation() <= BANDS[3].ceiling:
        view.assume_grant()
        granted += 1
    assert granted == 2  # queue 1 -> 0.25, queue 2 -> 0.5 > 0.3: the third waits


# ---- dispatch planning --------------------------------------------------------------------------

band_counts = st.fixed_dictionaries({b.name: st.integers(0, 6) for b in BANDS})


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 10), st.integers(0, 10), st.integers(0, 6)), min_size=1, max_size=3
    ),
    st.lists(band_counts, min_size=1, max_size=4),
)
def test_plan_respects_priority_ceilings_and_bounds_the_overshoot_of_several_instances(
    endpoints, instances
):
    """Every instance plans against the same view; together they stay within the headroom + N-1."""
    caps = [c for c, _, _ in endpoints]
    running = [min(c, r) for c, r, _ in endpoints]
    waiting = [w for _, _, w in endpoints]
    total = Counter()
    for mine in instances:
        total.update(mine)
    plans = []
    for mine in instances:
        remote = {b: total[b] - mine.get(b, 0) for b in total}
        plans.append(plan_dispatch(BANDS, pool(caps, running, waiting), mine, remote))
    # The global grants of each band, as one planner sees them (all see the same).
    reference = pool(caps, running, waiting)
    blocked = False
    for band in BANDS:
        want = total[band.name]
        grants = 0
        while not blocked and grants < want and reference.saturation() <= band.ceiling:
            reference.assume_grant()
            grants += 1
        given_out = sum(plan.get(band.name, 0) for plan in plans)
        with_waiters = sum(1 for mine in instances if mine.get(band.name))
        if blocked:
            assert given_out == 0, "a lower band dispatched while a higher band was held back"
        assert given_out <= grants + max(0, with_waiters - 1)
        for plan, mine in zip(plans, instances, strict=True):
            assert plan.get(band.name, 0) <= mine.get(band.name, 0)
            if grants and mine.get(band.name):
                assert plan.get(band.name, 0) >= 1, "an instance with waiters was starved"
        if want and grants < want:
            blocked = True


def test_without_a_managed_pool_everything_is_dispatched():
    assert plan_dispatch(BANDS, None, {"bronze": 3, "gold": 1}, {"bronze": 5}) == {
        "gold": 1,
        "bronze": 3,
    }


def test_a_single_instance_dispatches_exactly_the_headroom():
    view = pool([4, 4], [4, 4])
    plan = plan_dispatch(BANDS, view, {"bronze": 50}, {})
    # One queued per endpoint makes 0.25, not above bronze's 0.3, so one more goes (0.375); a
    # band flows while the pool is not above its ceiling, then waits.
    assert plan == {"bronze": 3}
    assert math.isclose(view.saturation(), 0.375)


@pytest.mark.parametrize("bad", [0, -1])
def test_queues_reject_nonsense_capacity(bad):
    with pytest.raises(ValueError, match="capacity"):
        FlowQueues(BANDS, bad, 30)


def test_endpoint_choice_weighs_inflight_by_each_endpoints_capacity():
    """Nothing queues anywhere; the big endpoint (capacity 8) with 4 in flight beats the small
    one (capacity 2) with 2: half full against full."""
    loads = {
        e: EndpointLoad(capacity, EngineSample(EngineDialect.VLLM, 0, 0, 0.0), NOW - 1, stated=True)
        for e, capacity in (("small", 2), ("big", 8))
    }
    view = PoolView(loads, {"big": 4, "small": 2}, NOW, SETTINGS)
    assert view.saturation() == 0
    assert view.score("small") == 1.0 and view.score("big") == 0.5
    assert view.least_saturated() == "big"


def test_take_matching_removes_only_what_it_wants_and_leaves_the_rest_in_place():
    queues = FlowQueues(BANDS, 100, 30)
    for i in range(6):
        queues.offer(waiter(i, f"t{i % 2}"))
    taken = queues.take_matching("m", "bronze", lambda w: int(w.request_id[1:]) % 3 == 0)
    assert sorted(w.request_id for w in taken) == ["r0", "r3"] and all(w.done for w in taken)
    assert len(queues) == 4 and queues.depth("bronze") == 4
    rest = [queues.take("m", "bronze").request_id for _ in range(4)]
    assert rest == ["r2", "r1", "r4", "r5"]  # t0 first, then turns; each tenant in order


def test_a_waiter_put_back_first_is_next_again_and_still_expires_when_it_first_would():
    queues = FlowQueues(BANDS, 3, 30)
    for i in range(3):
        queues.offer(waiter(i, f"t{i}", at=NOW + i))
    held = queues.take("m", "bronze")
    assert held is not None and held.request_id == "r0" and held.done
    queues.offer(waiter(3, "t3", at=NOW + 3))  # the band fills up again meanwhile
    assert queues.offer(held, first=True)  # back in, past the capacity: it was counted there
    assert not held.done and queues.depth("bronze") == 4 and "r0" in queues
    assert not queues.offer(waiter(4, "t4"))  # a new waiter still finds the band full
    assert queues.take("m", "bronze") is held  # next again, ahead of every other tenant
    queues.offer(held, first=True)
    expired = [w.request_id for w in queues.expire(NOW + 30)]
    assert expired == ["r0"]  # 30 s after it first arrived, not after it was put back
    assert [queues.take("m", "bronze").request_id for _ in range(3)] == ["r1", "r2", "r3"]


def test_a_new_band_table_keeps_the_waiters_of_kept_bands_and_returns_a_removed_bands():
    queues = FlowQueues(BANDS, 100, 30)
    for i in range(4):
        queues.offer(waiter(i, f"t{i % 2}", at=NOW + i))
    for i in range(4, 7):
        queues.offer(waiter(i, band="silver", at=NOW - i))
    lowered = BandPolicy("bronze", 100, 0.1)
    gone = queues.reband([*BANDS[:2], lowered, BandPolicy("iron", 50, 0.05)])
    assert [w.request_id for w in gone] == ["r6", "r5", "r4"] and all(w.done for w in gone)
    assert queues.band("silver") is None and queues.band("bronze") == lowered
    assert len(queues) == 4 and queues.depth("bronze") == 4 and queues.depth("iron") == 0
    assert queues.waiting("m") == {"bronze": 4}
    assert [queues.take("m", "bronze").request_id for _ in range(4)] == ["r0", "r1", "r2", "r3"]
    assert queues.offer(waiter(9, band="iron"))
    assert [w.request_id for w in queues.expire(NOW + 100)] == ["r9"]  # the others left
    with pytest.raises(ValueError):
        queues.offer(waiter(10, band="silver"))


def test_new_bounds_expire_by_the_new_ttl_and_refuse_past_the_new_capacity():
    queues = FlowQueues(BANDS, 4, 30)
    for i in range(4):
        queues.offer(waiter(i, f"t{i}", at=NOW + i))
    queues.resize(2, 10)
    assert len(queues) == 4 and not queues.offer(waiter(4, "t4"))  # over: kept, no more taken
    assert [w.request_id for w in queues.expire(NOW + 11)] == ["r0", "r1"]  # 10 s, not 30
    assert not queues.offer(waiter(5, "t5"))  # two left: at the new capacity
    assert queues.take("m", "bronze") is not None and queues.offer(waiter(6, "t6", at=NOW + 20))
    assert [w.request_id for w in queues.expire(NOW + 30)] == ["r3", "r6"]
    with pytest.raises(ValueError):
        queues.resize(0, 10)
    with pytest.raises(ValueError):
        queues.resize(2, 0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 10), st.integers(0, 12)), min_size=1, max_size=3),
    st.lists(st.integers(0, 2), min_size=4, max_size=4),
    band_counts,
)
def test_a_band_never_dispatches_into_its_headroom_and_stops_only_at_a_limit(
    endpoints, headrooms, waiting
):
    """A band with headroom h leaves more than h free batch slots per endpoint before each grant
    (so at least h after it), and waits only when its ceiling or its headroom stops it."""
    bands = [
        BandPolicy(b.name, b.priority, b.ceiling, b.overflow, headroom=h)
        for b, h in zip(BANDS, headrooms, strict=True)
    ]
    caps = [c for c, _ in endpoints]
    running = [r for _, r in endpoints]
    plan = plan_dispatch(bands, pool(caps, running), waiting, {})
    replay = pool(caps, running)
    reserved = len(caps)
    for band in bands:
        quota = plan.get(band.name, 0)
        for _ in range(quota):
            assert not replay.holds_back(band)
            replay.assume_grant()
        if band.headroom and quota:
            assert replay.free_slots() >= band.headroom * reserved
        if quota < waiting.get(band.name, 0):
            assert replay.holds_back(band), f"{band.name} waited with room left"
            break


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [([0, 0], GateDecision.QUEUED), ([3, 3], GateDecision.OVERFLOW)],
    ids=["room-for-one", "full-for-one"],
)
def test_an_overflow_band_behind_waiters_overflows_once_the_pool_has_no_room_for_it(
    waiting, expected
):
    """Waiters ahead that may not overflow (an overflow budget used up) hold the pool at its
    ceiling, never above it: an overflow band's arrival does not queue behind them when one
    more grant would pass the ceiling (queue 3 of 4 per endpoint: 0.75, one more: 1.0 > 0.85)."""
    gold = BANDS[1]
    view = pool([16, 16], [16, 16], waiting)
    assert not view.holds_back(gold)  # not above the ceiling: the old rule would queue it
    assert gate(gold, view, waiting_at_or_above=5) is expected
    assert gate(gold, view, waiting_at_or_above=0) is GateDecision.GRANTED
    assert gate(BANDS[2], view, waiting_at_or_above=5) is GateDecision.QUEUED  # silver waits


@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.integers(1, 20))
def test_full_for_is_exactly_whether_one_more_grant_would_pass_the_ceiling(running, ahead):
    view = pool([16] * len(running), running)
    gold = BANDS[1]
    expected = view.holds_back(gold) or (view.assume_grant() and view.saturation() > gold.ceiling)
    assert pool([16] * len(running), running).full_for(gold) is expected


def learned_pool(capacity: int, running: int, waiting: int, inflight: int) -> PoolView:
    """One endpoint whose capacity nobody stated (learned from what was seen)."""
    sample = EngineSample(EngineDialect.VLLM, running, waiting, 0.1)
    load = EndpointLoad(max(capacity, running), sample, NOW - 1)
    return PoolView({"e0": load}, {"e0": inflight}, NOW, SETTINGS)


@given(st.integers(1, 64), st.integers(0, 64), st.integers(0, 10_000))
def test_a_pool_whose_engine_reports_none_waiting_lets_every_ceiling_band_through(
    capacity, running, inflight
):
    """Its capacity only learned, no count of the gateway's holds a ceiling band back."""
    view = learned_pool(capacity, running, 0, inflight)
    for band in BANDS:
        assert gate(band, view, 0) is GateDecision.GRANTED
    assert plan_dispatch(BANDS, view, {"bronze": 50}, {}) == {"bronze": 50}


@given(st.integers(1, 64), st.integers(0, 64), st.integers(0, 200), st.integers(1, 3))
def test_a_band_with_headroom_probes_twice_a_learned_capacity_and_no_further(
    capacity, running, inflight, headroom
):
    bronze = BandPolicy("bronze", 100, 0.3, headroom=headroom)
    view = learned_pool(capacity, running, 0, inflight)
    slots = 2 * max(capacity, running)
    assert view.free_slots() == max(0, slots - inflight)
    assert view.holds_back(bronze) is (slots - inflight <= headroom)
    # Some waiting: the reading says the batch is full, the learned capacity is what counts.
    waited = learned_pool(capacity, running, 1, inflight)
    assert waited.free_slots() == max(0, max(capacity, running) - inflight)
