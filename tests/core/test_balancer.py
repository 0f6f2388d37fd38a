"""The rate balancer: its weights, and exploration, no NaN and the exploring cap beyond them."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmgw.core.balancer import (
    EPSILON_RATE,
    BalancerSettings,
    RateSample,
    RateWindows,
    _probability_above,
    choose,
    effective_rate,
    weights,
)

SETTINGS = BalancerSettings(window=60, input_to_output_token_ratio=250, greediness=0.5)


def test_effective_rate_weighs_input_tokens_by_the_ratio():
    sample = RateSample(at=0, latency=2.0, output_tokens=100, input_tokens=5000)
    assert effective_rate(sample, 250) == pytest.approx((100 + 20) / 2.0)
    assert effective_rate(RateSample(at=0, latency=1.0), 250) == EPSILON_RATE  # a failure


def test_the_window_forgets_old_samples():
    windows = RateWindows(SETTINGS)
    windows.add("a", RateSample(at=0, latency=1, output_tokens=10))
    windows.add("a", RateSample(at=30, latency=1, output_tokens=20))
    assert windows.rates("a", 59) == pytest.approx([10, 20], rel=1e-6)
    assert windows.rates("a", 61) == pytest.approx([20], rel=1e-6)
    assert windows.rates("a", 100) == []


def test_the_faster_deployment_gets_most_of_the_weight():
    rates = {"fast": [90, 100, 110, 95], "slow": [30, 35, 28, 33], "mid": [55, 60, 65, 50]}
    w = weights(rates, SETTINGS)
    assert w["fast"] > w["mid"] > w["slow"]
    assert w["slow"] < 0.01
    picks = Counter(choose(w, random.Random(1)) for _ in range(2000))
    assert picks["fast"] > 1000 and picks["slow"] < 40


@pytest.mark.parametrize("config", [BalancerSettings(window=0), BalancerSettings(greediness=0)])
def test_window_zero_or_greediness_zero_is_round_robin(config):
    rates = {"fast": [100.0], "slow": [1.0]}
    assert weights(rates, config) == {"fast": 1.0, "slow": 1.0}


def test_a_deployment_without_samples_is_explored_while_the_others_keep_their_weights():
    """A global bootstrap would give every deployment equal weight here; that forgets what it
    learned."""
    w = weights({"fast": [100, 110, 90], "slow": [10, 12, 11], "quiet": []}, SETTINGS)
    assert w["quiet"] == w["fast"] == max(w.values())
    assert w["slow"] < 0.01


def test_no_samples_anywhere_gives_equal_weights():
    assert weights({"a": [], "b": []}, SETTINGS) == {"a": 1.0, "b": 1.0}


def test_zero_variance_windows_give_finite_weights():
    w = weights({"a": [50.0, 50.0], "b": [20.0, 20.0], "c": [35.0]}, SETTINGS)
    assert all(math.isfinite(v) for v in w.values())
    assert w == {"a": 1.0, "b": 0.0, "c": 0.0}  # c is the median: exactly at the SLA, not above
    assert weights({"a": [7.0], "b": [7.0]}, SETTINGS) == {"a": 1.0, "b": 1.0}  # all equal


def test_failures_count_as_zero_rate_samples():
    w = weights({"failing": [EPSILON_RATE] * 3, "ok": [40.0, 50.0, 45.0, 42.0]}, SETTINGS)
    assert w["failing"] < 1e-6 < w["ok"]


def test_a_degraded_deployment_is_dropped_and_found_again_after_it_recovers():
    """a slows from 100 to 10 tokens/s for 10 s; once ignored, it is explored again."""
    rng = random.Random(3)
    windows = RateWindows(BalancerSettings(window=10))
    speed = {"a": 100.0, "b": 50.0}
    chosen_a = []
    for step in range(400):
        now = step * 0.1
        speed["a"] = 10.0 if 5 <= now < 15 else 100.0
        rates = windows.snapshot(speed, now)
        pick = choose(weights(rates, windows.settings), rng)
        tokens = rng.randint(20, 80)
        windows.add(pick, RateSample(at=now, latency=tokens / speed[pick], output_tokens=tokens))
        chosen_a.append((now, pick == "a"))

    def share(start: float, end: float) -> float:
        picks = [a for now, a in chosen_a if start <= now < end]
        return sum(picks) / len(picks)

    print(
        {span: round(share(*span), 2) for span in ((0, 5), (5, 10), (10, 15), (15, 25), (30, 40))}
    )
    assert share(0, 5) > 0.6  # the faster one, while healthy
    # Dropped once its slow samples outweigh the fast ones still in the window (the median
    # SLA adapts within about half a window).
    assert share(10, 15) < 0.5
    assert share(30, 40) > 0.6  # back as the favourite once healthy again


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0, max_value=1e6), min_size=2, max_size=8),
    st.floats(min_value=0, max_value=1e6),
)
def test_the_weight_is_the_normal_fits_survival_function(rates, sla):
    """The weight, P(rate > SLA) under a normal fit, against scipy's own norm.sf."""
    from scipy.stats import norm

    mu = math.fsum(rates) / len(rates)
    sigma = math.sqrt(math.fsum((x - mu) ** 2 for x in rates) / len(rates))
    assume(sigma > 1e-12 * max(1.0, abs(mu)))
    expected = float(norm.sf(sla, loc=mu, scale=sigma))
    assert _probability_above(rates, sla) == pytest.approx(expected, rel=1e-9, abs=1e-300)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]),
        st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=8),
        min_size=1,
    ),
    st.floats(min_value=0, max_value=1),
)
def test_weights_are_finite_non_negative_and_never_all_zero(rates, greediness):
    w = weights(rates, BalancerSettings(window=60, greediness=greediness))
    assert set(w) == set(rates)
    assert all(math.isfinite(v) and v >= 0 for v in w.values())
    assert any(v > 0 for v in w.values())
    choose(w, random.Random(0))  # always possible


def test_settings_are_validated():
    with pytest.raises(ValueError, match="greediness"):
        BalancerSettings(greediness=1.5)
    with pytest.raises(ValueError, match="window"):
        BalancerSettings(window=-1)
    with pytest.raises(ValueError, match="ratio"):
        BalancerSettings(input_to_output_token_ratio=0)


@settings(max_examples=40, deadline=None)
@given(
    max_exploring=st.integers(1, 4),
    workers=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    finish=st.lists(st.booleans(), max_size=80),
)
def test_an_unexplored_deployment_never_has_more_than_max_exploring_requests_in_flight(
    max_exploring, workers, seed, finish
):
    """Concurrent picks while an unexplored deployment's first sample is out. Each pick counts as in flight until a drawn `finish` ends one; the unexplored
    deployment's in-flight count never passes the cap, and the explored ones still get picks."""
    rng = random.Random(seed)
    rates = {"fast": [100.0, 110.0, 90.0], "slow": [60.0, 70.0, 65.0], "new": []}
    inflight = Counter()
    picks = Counter()
    steps = iter(finish)
    for _ in range(workers * 2):
        chosen = choose(weights(rates, SETTINGS, inflight, max_exploring), rng)
        inflight[chosen] += 1
        picks[chosen] += 1
        assert inflight["new"] <= max_exploring
        if next(steps, False):  # a request ends, never the exploration (its sample is slow)
            done = rng.choice([d for d in inflight if inflight[d] and d != "new"] or ["-"])
            if done != "-":
                inflight[done] -= 1
    assert picks["new"] <= max_exploring
    if workers * 2 > max_exploring:
        assert picks["fast"] + picks["slow"] >= workers * 2 - max_exploring
