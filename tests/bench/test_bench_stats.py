"""Statistics: percentiles, TTFT/TPOT definitions, throughput windows, errors by status."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.services.bench.stats import RequestRecord, percentile, summarize

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpy_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


@given(st.lists(finite, min_size=1, max_size=100), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_bounded_and_monotone(values, q1, q2):
    low, high = sorted((q1, q2))
    assert min(values) <= percentile(values, low) <= percentile(values, high) <= max(values)
    assert percentile(values, 0) == min(values)
    assert percentile(values, 100) == max(values)


def test_percentile_rejects_no_values_and_bad_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ttft_and_tpot_follow_their_definitions():
    stream = RequestRecord(
        0, start=10.0, end=11.0, status=200, stream=True, first_token=10.2, output_tokens=9
    )
    assert stream.latency == pytest.approx(1.0)
    assert stream.ttft == pytest.approx(0.2)
    assert stream.tpot == pytest.approx(0.8 / 8)
    one_token = RequestRecord(1, 0.0, 1.0, 200, stream=True, first_token=0.5, output_tokens=1)
    assert one_token.ttft == pytest.approx(0.5)
    assert one_token.tpot is None
    whole = RequestRecord(2, 0.0, 1.0, 200, stream=False, output_tokens=9)
    assert whole.ttft is None and whole.tpot is None
    failed = RequestRecord(
        3, 0.0, 1.0, 500, error="http", stream=True, first_token=0.5, output_tokens=5
    )
    assert failed.ttft is None and failed.error_key == "500"
    broken = RequestRecord(4, 0.0, 1.0, None, error="connection")
    assert broken.error_key == "connection" and not broken.ok


def test_summary_counts_errors_by_status_and_throughput_over_the_window():
    records = [
        RequestRecord(
            i,
            start=float(i),
            end=i + 1.5,
            status=200,
            stream=True,
            first_token=i + 0.5,
            output_tokens=11,
            prompt_tokens=100,
            cached_tokens=20 * (i % 2),
            usage_reported=True,
        )
        for i in range(4)
    ] + [
        RequestRecord(4, 1.0, 2.0, 503, error="http"),
        RequestRecord(5, 1.0, 5.5, 429, error="http"),
        RequestRecord(6, 2.0, 2.5, 429, error="http"),
        RequestRecord(7, 2.0, 2.5, 200, error="incomplete"),
    ]
    summary = summarize(records)
    assert summary["requests"] == 8 and summary["ok"] == 4
    assert summary["errors"] == {"429": 2, "503": 1, "incomplete": 1}
    assert list(summary["errors"]) == ["429", "503", "incomplete"]  # most frequent first
    assert summary["error_rate"] == 0.5
    assert summary["duration_s"] == 5.5  # 0.0 .. 5.5, the failure included
    assert summary["throughput"]["requests_per_s"] == pytest.approx(4 / 5.5)
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(44 / 5.5)
    assert summary["tokens"] == {"prompt": 400, "output": 44, "cached": 40, "usage_reported": 4}
    assert summary["prefix_cache_hit_rate"] == pytest.approx(40 / 400)
    assert summary["latency_s"]["p50"] == pytest.approx(1.5)
    assert summary["ttft_s"]["p99"] == pytest.approx(0.5)
    assert summary["tpot_s"]["mean"] == pytest.approx(1.0 / 10)


def test_summary_of_no_records_and_of_only_failures():
    empty = summarize([])
    assert empty["requests"] == 0 and empty["latency_s"] is None
    assert empty["throughput"]["requests_per_s"] == 0.0
    failures = summarize([RequestRecord(0, 0.0, 1.0, None, error="timeout")])
    assert failures["ok"] == 0 and failures["errors"] == {"timeout": 1}
    assert failures["ttft_s"] is None and failures["prefix_cache_hit_rate"] is None


records = st.builds(
    RequestRecord,
    index=st.integers(0, 1000),
    start=st.floats(0, 100),
    end=st.floats(100, 200),
    status=st.sampled_from([200, 429, 500, None]),
    error=st.sampled_from([None, "http", "connection", "incomplete"]),
    stream=st.booleans(),
    first_token=st.one_of(st.none(), st.just(100.0)),
    output_tokens=st.integers(0, 50),
)


@given(st.lists(records, max_size=50))
def test_summary_invariants(items):
    summary = summarize(items)
    assert summary["ok"] + sum(summary["errors"].values()) == summary["requests"] == len(items)
    for key in ("latency_s", "ttft_s", "tpot_s"):
        dist = summary[key]
        if dist is not None:
            assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    if summary["ok"] == 0:
        assert summary["latency_s"] is None
