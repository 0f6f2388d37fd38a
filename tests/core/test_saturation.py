"""Saturation detector: stated and learned capacity, queue from waiting or excess inflight, KV
occupancy, staleness scored as saturated, pool mean."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from llmgw.core.engine_metrics import EngineDialect, EngineSample
from llmgw.core.saturation import (
    PROBE_FACTOR,
    STALE_SATURATION,
    EndpointLoad,
    SaturationSettings,
    batch_slots,
    endpoint_saturation,
    is_stale,
    pool_saturation,
    state,
    update,
)

SETTINGS = SaturationSettings(target_waiting=4, kv_ceiling=0.8, stale_after=10.0)

counts = st.integers(0, 10_000)
fractions = st.floats(0, 1)
times = st.floats(0, 1e6)
settings_strategy = st.builds(
    SaturationSettings,
    target_waiting=st.floats(0.1, 1000),
    kv_ceiling=st.floats(0.01, 1),
    stale_after=st.floats(0.01, 1000),
)


def sample(running: int = 0, waiting: int = 0, kv_usage: float = 0.0) -> EngineSample:
    return EngineSample(EngineDialect.VLLM, running, waiting, kv_usage)


def fresh(
    running: int = 0,
    waiting: int = 0,
    kv_usage: float = 0.0,
    capacity: int = 0,
    *,
    stated: bool = True,
) -> EndpointLoad:
    """An endpoint sampled at t=0 whose capacity is at least ``capacity``: stated (configured or
    said by its engine), or only learned."""
    base = EndpointLoad(capacity=capacity, stated=stated)
    return update(base, sample(running, waiting, kv_usage), 0.0)


@pytest.mark.parametrize(
    ("load", "inflight", "expected"),
    [
        (fresh(), 0, 0.0),
        (fresh(running=8, waiting=2), 10, 0.5),  # 2 beyond the 8 it runs / target 4
        (fresh(running=8, kv_usage=0.4), 8, 0.5),  # kv 0.4 / ceiling 0.8
        (fresh(running=8, waiting=2, kv_usage=0.72), 8, 0.9),  # the worse of the two
        # router inflight counts running requests too: only what exceeds capacity is queued
        (fresh(running=8), 10, 0.5),
        (fresh(running=8), 16, 2.0),  # burst of grants the engine has not seen yet
        # the engine held requests back with slots free (KV): it runs 5 at once, 3 of 8 wait
        (fresh(running=5, waiting=3, capacity=8), 8, 0.75),
        # the queue the scrape saw has drained since: the count says so (no phantom load)
        (fresh(running=8, waiting=4), 6, 0.0),
        (fresh(running=2, capacity=8), 8, 0.0),  # capacity is the high-water mark, not last running
        (fresh(), 4, 1.0),  # cold start: nothing learned, all inflight counts as queued
        # a learned capacity is a lower bound: while the engine says none wait, nothing queues
        (fresh(running=8, stated=False), 40, 0.0),
        (fresh(running=8, kv_usage=0.4, stated=False), 40, 0.5),  # KV still counts
        # once it says some wait, its slots are what it runs
        (fresh(running=8, waiting=2, stated=False), 12, 1.0),
    ],
    ids=[
        "idle",
        "waiting",
        "kv",
        "worse-of-both",
        "inflight-excess",
        "grant-burst",
        "engine-holding-back",
        "drained-since-the-scrape",
        "learned-capacity",
        "cold-start",
        "learned-none-waiting",
        "learned-none-waiting-kv",
        "learned-some-waiting",
    ],
)
def test_endpoint_saturation(load: EndpointLoad, inflight: int, expected: float) -> None:
    assert endpoint_saturation(load, 1.0, SETTINGS, inflight) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("load", "now", "expected"),
    [
        (EndpointLoad(), 0.0, STALE_SATURATION),  # never sampled
        (fresh(), 10.0, 0.0),  # exactly stale_after old is still fresh
        (fresh(), 10.5, STALE_SATURATION),
        (fresh(waiting=12), 11.0, 3.0),  # stale never reads better than the last sample
    ],
    ids=["never-sampled", "boundary", "stale", "stale-but-worse"],
)
def test_stale_endpoint_counts_as_saturated(
    load: EndpointLoad, now: float, expected: float
) -> None:
    assert endpoint_saturation(load, now, SETTINGS) == expected


def test_pool_saturation_is_the_mean_and_stale_endpoints_stay_in_it() -> None:
    loads = {"a": fresh(running=8, waiting=4), "b": fresh(running=8), "c": EndpointLoad()}
    # a: 1.0, b: 16 inflight - 8 capacity = 8 queued -> 2.0, c: stale -> 1.0
    assert pool_saturation(loads, 5.0, SETTINGS, {"b": 16}) == pytest.approx(4 / 3)
    assert pool_saturation(loads, 5.0, SETTINGS) == pytest.approx(2 / 3)


def test_empty_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="no endpoints"):
        pool_saturation({}, 0.0, SETTINGS)


def test_negative_inflight_is_rejected() -> None:
    with pytest.raises(ValueError, match="inflight"):
        endpoint_saturation(fresh(), 0.0, SETTINGS, -1)


@pytest.mark.parametrize("field", ["target_waiting", "kv_ceiling", "stale_after"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_settings_reject_non_positive_targets(field: str, bad: float) -> None:
    values = {"target_waiting": 4.0, "kv_ceiling": 0.9, "stale_after": 10.0, field: bad}
    with pytest.raises(ValueError, match=field):
        SaturationSettings(**values)


def test_settings_reject_kv_ceiling_above_the_whole_cache() -> None:
    with pytest.raises(ValueError, match="kv_ceiling"):
        SaturationSettings(target_waiting=4, kv_ceiling=1.5, stale_after=10)


@given(settings=settings_strategy, target=st.floats(-1e6, 0) | st.just(math.nan))
def test_settings_reject_any_non_positive_target_waiting(
    settings: SaturationSettings, target: float
) -> None:
    with pytest.raises(ValueError, match="target_waiting"):
        SaturationSettings(target, settings.kv_ceiling, settings.stale_after)


@given(
    settings=settings_strategy,
    running=counts,
    capacity=counts,
    inflight=counts,
    kv=fractions,
    waiting=counts,
    more=counts,
    now=times,
)
def test_monotonic_in_waiting(
    settings: SaturationSettings,
    running: int,
    capacity: int,
    inflight: int,
    kv: float,
    waiting: int,
    more: int,
    now: float,
) -> None:
    base = EndpointLoad(capacity=capacity)
    low = update(base, sample(running, waiting, kv), 0.0)
    high = update(base, sample(running, waiting + more, kv), 0.0)
    assert endpoint_saturation(low, now, settings, inflight) <= endpoint_saturation(
        high, now, settings, inflight
    )


@given(
    settings=settings_strategy,
    running=counts,
    waiting=counts,
    inflight=counts,
    kv=fractions,
    kv2=fractions,
    now=times,
)
def test_monotonic_in_kv_usage(
    settings: SaturationSettings,
    running: int,
    waiting: int,
    inflight: int,
    kv: float,
    kv2: float,
    now: float,
) -> None:
    low_kv, high_kv = sorted((kv, kv2))
    low = fresh(running, waiting, low_kv)
    high = fresh(running, waiting, high_kv)
    assert endpoint_saturation(low, now, settings, inflight) <= endpoint_saturation(
        high, now, settings, inflight
    )


@given(
    settings=settings_strategy,
    running=counts,
    waiting=counts,
    kv=fractions,
    inflight=counts,
    more=counts,
    now=times,
)
def test_monotonic_in_inflight(
    settings: SaturationSettings,
    running: int,
    waiting: int,
    kv: float,
    inflight: int,
    more: int,
    now: float,
) -> None:
    load = fresh(running, waiting, kv)
    assert endpoint_saturation(load, now, settings, inflight) <= endpoint_saturation(
        load, now, settings, inflight + more
    )


@given(
    settings=settings_strategy,
    running=counts,
    waiting=counts,
    kv=fractions,
    inflight=counts,
    sampled_at=times,
    age=st.floats(0, 1e6),
)
def test_stale_endpoint_is_at_least_saturated(
    settings: SaturationSettings,
    running: int,
    waiting: int,
    kv: float,
    inflight: int,
    sampled_at: float,
    age: float,
) -> None:
    load = update(EndpointLoad(), sample(running, waiting, kv), sampled_at)
    now = sampled_at + settings.stale_after + age
    assume(now - sampled_at > settings.stale_after)  # float rounding at the boundary
    assert is_stale(load, now, settings)
    stale = endpoint_saturation(load, now, settings, inflight)
    assert stale >= STALE_SATURATION
    assert stale >= endpoint_saturation(load, sampled_at, settings, inflight)


@given(
    settings=settings_strategy,
    steps=st.lists(st.tuples(counts, counts, fractions, times), max_size=20),
)
def test_capacity_only_grows_and_is_the_most_ever_running(
    settings: SaturationSettings, steps: list[tuple[int, int, float, float]]
) -> None:
    load = EndpointLoad()
    seen = 0
    for running, waiting, kv, now in steps:
        previous = load
        load = update(load, sample(running, waiting, kv), now)
        seen = max(seen, running)
        assert load.capacity >= previous.capacity
        assert load.capacity == seen


@given(first=times, second=times, running=counts)
def test_an_older_sample_teaches_capacity_but_does_not_replace_a_newer_one(
    first: float, second: float, running: int
) -> None:
    assume(second < first)
    newer = sample(waiting=1)
    load = update(update(EndpointLoad(), newer, first), sample(running=running), second)
    assert (load.sample, load.sampled_at) == (newer, first)
    assert load.capacity == running


@given(
    settings=settings_strategy,
    now=times,
    endpoints=st.lists(
        st.tuples(counts, counts, fractions, counts, st.booleans()), min_size=1, max_size=8
    ),
)
def test_pool_saturation_lies_between_its_endpoints(
    settings: SaturationSettings,
    now: float,
    endpoints: list[tuple[int, int, float, int, bool]],
) -> None:
    loads = {}
    inflight = {}
    for index, (running, waiting, kv, outstanding, sampled) in enumerate(endpoints):
        loads[f"e{index}"] = (
            update(EndpointLoad(), sample(running, waiting, kv), now) if sampled else EndpointLoad()
        )
        inflight[f"e{index}"] = outstanding
    each = [endpoint_saturation(loads[key], now, settings, inflight[key]) for key in loads]
    pool = pool_saturation(loads, now, settings, inflight)
    assert min(each) * (1 - 1e-12) <= pool <= max(each) * (1 + 1e-12)


# ---- stated and learned capacity ----------------------------------------------------------------


@given(
    settings=settings_strategy,
    running=counts,
    capacity=counts,
    inflight=counts,
    kv=fractions,
    now=st.floats(0, 10),
)
def test_a_learned_capacity_never_holds_back_an_engine_that_reports_none_waiting(
    settings: SaturationSettings,
    running: int,
    capacity: int,
    inflight: int,
    kv: float,
    now: float,
) -> None:
    """Whatever the gateway's count, a fresh reading of none waiting leaves only KV usage."""
    assume(now <= settings.stale_after)
    load = fresh(running, 0, kv, capacity, stated=False)
    assert endpoint_saturation(load, now, settings, inflight) == kv / settings.kv_ceiling


@given(
    settings=settings_strategy,
    running=counts,
    capacity=st.integers(1, 10_000),
    inflight=counts,
    now=st.floats(0, 10),
)
def test_a_stated_capacity_counts_what_exceeds_it_as_queue(
    settings: SaturationSettings, running: int, capacity: int, inflight: int, now: float
) -> None:
    assume(now <= settings.stale_after)
    load = fresh(running, 0, 0.0, capacity, stated=True)
    queue = max(0, inflight - max(capacity, running))
    assert endpoint_saturation(load, now, settings, inflight) == pytest.approx(
        queue / settings.target_waiting
    )


@given(
    settings=settings_strategy,
    running=counts,
    waiting=counts,
    capacity=counts,
    inflight=counts,
    kv=fractions,
    now=times,
)
def test_learning_never_makes_an_endpoint_look_busier_than_stating_the_same_capacity(
    settings: SaturationSettings,
    running: int,
    waiting: int,
    capacity: int,
    inflight: int,
    kv: float,
    now: float,
) -> None:
    learned = fresh(running, waiting, kv, capacity, stated=False)
    stated = fresh(running, waiting, kv, capacity, stated=True)
    assert endpoint_saturation(learned, now, settings, inflight) <= endpoint_saturation(
        stated, now, settings, inflight
    )
    if waiting or now > settings.stale_after:  # some wait, or stale: the same arithmetic
        assert endpoint_saturation(learned, now, settings, inflight) == endpoint_saturation(
            stated, now, settings, inflight
        )


@given(
    stated=st.booleans(),
    steps=st.lists(st.tuples(counts, counts, st.one_of(st.none(), counts), times), max_size=20),
)
def test_capacity_learns_the_gateways_count_only_when_none_waited_and_nobody_stated_it(
    stated: bool, steps: list[tuple[int, int, int | None, float]]
) -> None:
    load = EndpointLoad(capacity=1, stated=stated)
    expected = 1
    for running, waiting, gateway, now in steps:
        previous = load
        load = update(load, sample(running, waiting), now, gateway)
        expected = max(expected, running)
        if gateway is not None and waiting == 0 and not stated:
            expected = max(expected, gateway)
        assert load.capacity >= previous.capacity
        assert load.capacity == expected
        assert load.stated is stated


@given(capacity=counts, learned=counts, running=counts, waiting=counts, gateway=counts)
def test_a_stated_capacity_replaces_what_was_learned_and_stays_stated(
    capacity: int, learned: int, running: int, waiting: int, gateway: int
) -> None:
    assume(capacity >= 1)
    before = update(EndpointLoad(learned), sample(running, waiting), 1.0, gateway)
    told = state(before, capacity)
    assert (told.capacity, told.stated) == (capacity, True)
    assert (told.sample, told.sampled_at, told.reported_at) == (
        before.sample,
        before.sampled_at,
        before.reported_at,
    )
    after = update(told, sample(running, 0), 2.0, gateway)  # the gateway's count teaches nothing
    assert (after.capacity, after.stated) == (max(capacity, running), True)


def test_state_and_update_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="capacity"):
        state(EndpointLoad(), 0)
    with pytest.raises(ValueError, match="gateway"):
        update(EndpointLoad(), sample(), 0.0, -1)


@given(
    settings=settings_strategy,
    capacity=counts,
    running=counts,
    waiting=counts,
    stated=st.booleans(),
    now=times,
)
def test_batch_slots_probe_past_a_learned_capacity_only_while_none_wait(
    settings: SaturationSettings,
    capacity: int,
    running: int,
    waiting: int,
    stated: bool,
    now: float,
) -> None:
    load = fresh(running, waiting, 0.0, capacity, stated=stated)
    slots = batch_slots(load, now, settings)
    base = max(1, load.capacity)
    if not stated and waiting == 0 and now <= settings.stale_after:
        assert slots == PROBE_FACTOR * base
    else:
        assert slots == base
