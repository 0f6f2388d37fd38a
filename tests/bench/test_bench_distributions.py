"""Length distributions: the string grammar, bounds, determinism, the lognormal's mean."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.services.bench.distributions import (
    DistributionError,
    Fixed,
    LogNormal,
    Uniform,
    parse_distribution,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fixed:128", Fixed(128)),
        ("128", Fixed(128)),
        ("uniform:64-512", Uniform(64, 512)),
        ("64-512", Uniform(64, 512)),
        (" uniform : 1 - 3 ", Uniform(1, 3)),
        ("lognormal:mean=200,sigma=0.6,max=2048", LogNormal(200, 0.6, 1, 2048)),
        ("LOGNORMAL:sigma=1,mean=50,min=10", LogNormal(50, 1.0, 10, None)),
    ],
)
def test_parses_the_documented_forms(text, expected):
    assert parse_distribution(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not an integer"),
        ("fixed:0", ">= 1"),
        ("fixed:x", "not an integer"),
        ("uniform:5-3", "1 <= A <= B"),
        ("uniform:5", "A-B"),
        ("lognormal:mean=200", "needs sigma"),
        ("lognormal:mean=200,sigma=0", "sigma must be > 0"),
        ("lognormal:mean=2,sigma=0.5,bogus=1", "once each"),
        ("lognormal:mean=2,sigma=0.5,mean=3", "once each"),
        ("lognormal:mean=20,sigma=0.5,min=10,max=5", "below min"),
        ("lognormal:mean=nan,sigma=0.5", "mean must be > 0"),
        ("zipf:1", "unknown distribution"),
    ],
)
def test_rejects_malformed_strings_saying_why(text, message):
    with pytest.raises(DistributionError, match=message):
        parse_distribution(text)


distributions = st.one_of(
    st.builds(Fixed, st.integers(1, 10**6)),
    st.integers(1, 10**5).flatmap(
        lambda low: st.builds(Uniform, st.just(low), st.integers(low, low + 10**5))
    ),
    st.builds(
        LogNormal,
        st.floats(1, 1e5),
        st.floats(0.01, 3),
        st.integers(1, 50),
        st.one_of(st.none(), st.integers(50, 10**6)),
    ),
)


@given(distributions, st.integers(0, 2**32))
def test_draws_stay_within_bounds_and_depend_only_on_the_rng(dist, seed):
    draws = [dist.sample(random.Random(seed)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(seed)
    for _ in range(50):
        value = dist.sample(rng)
        assert isinstance(value, int)
        assert value >= dist.low >= 1
        assert dist.high is None or value <= dist.high


@given(distributions)
def test_spec_round_trips(dist):
    assert parse_distribution(dist.spec) == dist


def test_lognormal_mean_is_the_mean_before_clipping():
    dist = parse_distribution("lognormal:mean=200,sigma=0.6")
    rng = random.Random(7)
    mean = statistics.fmean(dist.sample(rng) for _ in range(20000))
    assert mean == pytest.approx(200, rel=0.03)


def test_uniform_reaches_both_ends():
    dist = Uniform(3, 5)
    rng = random.Random(1)
    assert {dist.sample(rng) for _ in range(200)} == {3, 4, 5}
