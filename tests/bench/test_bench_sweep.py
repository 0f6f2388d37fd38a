"""Knee detection and the recommendations, on synthetic saturation curves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.services.bench.sweep import (
    LevelPoint,
    doubling_levels,
    find_knee,
    latency_ratio_reached,
    recommend,
)


def engine_curve(levels, capacity, *, rate=100.0, base=0.2, metrics=True):
    """An ideal batching engine: throughput min(c, R) x rate, latency by Little's law."""
    return [
        LevelPoint(
            concurrency=c,
            throughput=min(c, capacity) * rate,
            latency=base * max(1.0, c / capacity),
            running_max=min(c, capacity) if metrics else None,
        )
        for c in levels
    ]


def test_doubling_levels_end_at_the_maximum():
    assert doubling_levels(1, 16) == [1, 2, 4, 8, 16]
    assert doubling_levels(1, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert doubling_levels(3, 3) == [3]
    with pytest.raises(ValueError):
        doubling_levels(0, 4)


def test_knee_of_an_eight_slot_engine_is_eight_and_target_waiting_half_of_it():
    points = engine_curve(doubling_levels(1, 64), capacity=8)
    assert find_knee(points) == 3
    rec = recommend(points)
    assert (rec.knee_concurrency, rec.knee_running, rec.batch_capacity) == (8, 8, 8)
    assert rec.capacity_source == "metrics"
    # latency = 1.5 x the knee's at concurrency 12: a queue of 4
    assert rec.target_waiting == 4
    assert rec.weight == 100
    assert rec.notes == []


@given(st.integers(0, 9), st.sampled_from([1.25, 1.5, 2.0, 3.0]), st.booleans())
def test_knee_of_a_power_of_two_engine_is_its_capacity(exponent, factor, metrics):
    capacity = 2**exponent
    points = engine_curve(doubling_levels(1, 2048), capacity=capacity, metrics=metrics)
    rec = recommend(points, latency_factor=factor)
    assert rec.knee_concurrency == rec.knee_running == capacity
    assert rec.capacity_source == ("metrics" if metrics else "client")
    # Past the knee latency grows linearly in the queue, so the interpolation is exact.
    assert rec.target_waiting == max(1, round((factor - 1) * capacity))
    assert rec.weight == 100


@given(st.integers(1, 1000), st.booleans())
def test_knee_is_within_a_doubling_of_any_capacity(capacity, metrics):
    points = engine_curve(doubling_levels(1, 4096), capacity=capacity, metrics=metrics)
    rec = recommend(points)
    # The knee is the first level whose doubling adds under 10%: at or just below R, or the
    # first level above it.
    assert capacity / 1.1 <= rec.knee_concurrency < 2 * capacity
    assert rec.knee_running == (
        min(capacity, rec.knee_concurrency) if metrics else rec.knee_concurrency
    )
    assert rec.target_waiting >= 1 and rec.weight == 100


def test_linear_levels_scale_the_threshold_with_the_step():
    points = engine_curve(range(1, 17), capacity=8)
    assert points[find_knee(points)].concurrency == 8


def test_no_knee_while_throughput_keeps_growing():
    points = engine_curve(doubling_levels(1, 32), capacity=1000)
    assert find_knee(points) is None
    rec = recommend(points)
    assert rec.target_waiting is None and rec.weight is None
    assert rec.batch_capacity == 32 and rec.capacity_source == "metrics"
    assert "no knee" in rec.notes[0] and "32" in rec.notes[0]


def test_flat_throughput_without_rising_latency_is_not_a_knee():
    points = [LevelPoint(c, 100.0, 0.2) for c in (1, 2, 4, 8)]
    assert find_knee(points) is None


def test_small_growth_with_rising_latency_is_a_knee():
    points = [LevelPoint(1, 100.0, 0.2), LevelPoint(2, 195.0, 0.2), LevelPoint(4, 205.0, 0.4)]
    assert find_knee(points) == 1
    # 205 / 195 is 5% more for twice the load: below the default 10%, above a 2% threshold
    assert find_knee(points, threshold=0.02) is None


def test_weight_is_relative_to_the_reference_throughput():
    points = engine_curve(doubling_levels(1, 32), capacity=4, rate=50.0)  # knee: 200 tok/s
    assert recommend(points, reference_throughput=400.0).weight == 50
    assert recommend(points, reference_throughput=100.0).weight == 200
    assert recommend(points, reference_throughput=1e9).weight == 1  # never 0


def test_target_waiting_is_a_lower_bound_when_latency_never_reaches_the_factor():
    points = engine_curve([1, 2, 4, 8], capacity=4)  # 8 doubles latency; factor 3 not reached
    rec = recommend(points, latency_factor=3.0)
    assert rec.target_waiting == 4
    assert "at least 4" in rec.notes[0]
    assert not latency_ratio_reached(points, 2, 3.0)
    assert latency_ratio_reached(points, 2, 2.0)


def test_an_engine_that_batched_past_the_knee_gets_a_note():
    # Throughput flattens at 8 although the engine ran up to 32 at once (compute bound).
    points = [
        LevelPoint(4, 400.0, 0.2, 4),
        LevelPoint(8, 700.0, 0.23, 8),
        LevelPoint(16, 720.0, 0.44, 16),
        LevelPoint(32, 730.0, 0.88, 32),
    ]
    rec = recommend(points)
    assert rec.knee_concurrency == 8 and rec.knee_running == 8 and rec.batch_capacity == 32
    assert any("target_inflight" in note for note in rec.notes)


def test_bad_parameters_are_refused():
    points = engine_curve([1, 2], capacity=1)
    with pytest.raises(ValueError):
        recommend(points, latency_factor=1.0)
    with pytest.raises(ValueError):
        recommend(points, reference_throughput=0.0)
    with pytest.raises(ValueError):
        find_knee([LevelPoint(2, 1.0, 1.0), LevelPoint(2, 1.0, 1.0)])
