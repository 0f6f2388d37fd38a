"""The saturation sweep against a small simulated engine, with and without its metrics."""

from __future__ import annotations

import random

import pytest
from bench_helpers import EXACT, MODEL, StartEngine, quick_engine, without_metrics

from llmgw.services.bench.client import RequestOptions
from llmgw.services.bench.distributions import Fixed
from llmgw.services.bench.protocol import api_urls
from llmgw.services.bench.runner import open_session
from llmgw.services.bench.sweep import doubling_levels
from llmgw.services.bench.sweep_runner import SweepSpec, run_sweep
from llmgw.services.bench.workload import WorkloadSpec

# 4 slots, 20 ms per token, 4 tokens per request: 60 ms a request (long against the client's
# own per-request work, which would otherwise leave slots idle at concurrency 4).
ENGINE = {"max_num_seqs": 4, "itl_base": 0.02, "prefill_base": 0.0}

pytestmark = pytest.mark.latency  # the knee is found by latency measured on the wall clock


async def sweep(url: str, *, metrics: bool):
    urls = api_urls(url)
    options = RequestOptions(
        url=urls.generation("chat"), model=MODEL, stream=False, extra_body=EXACT
    )
    workload = WorkloadSpec(prompt_tokens=Fixed(16), output_tokens=Fixed(4), run_id="sweep")
    spec = SweepSpec(
        levels=doubling_levels(1, 64),
        metrics_url=urls.metrics if metrics else None,
        metrics_interval=0.05,
    )
    async with open_session(10.0) as session:
        return await run_sweep(session, options, workload, spec, rng=random.Random(0))


async def test_sweep_finds_the_knee_at_max_num_seqs_with_engine_metrics(engine: StartEngine):
    sim = await engine(quick_engine(**ENGINE))
    outcome = await sweep(sim.url, metrics=True)
    rec = outcome.recommendation
    assert outcome.metrics["available"] is True
    # It stops once latency past the knee reached 1.5x (at 8: twice the knee's).
    assert [level["concurrency"] for level in outcome.levels] == [1, 2, 4, 8]
    assert rec.knee_concurrency == 4
    assert rec.batch_capacity == rec.knee_running == 4 and rec.capacity_source == "metrics"
    assert rec.target_waiting == 2  # 1.5 x the knee's latency at a queue of 2 (half of 4)
    assert rec.weight == 100
    at_eight = outcome.levels[-1]
    assert at_eight["engine"]["running_max"] == 4
    assert at_eight["engine"]["waiting_max"] >= 3  # the other four queued at the engine
    assert all(level["summary"]["errors"] == {} for level in outcome.levels)


async def test_sweep_without_engine_metrics_uses_client_side_measurements(engine: StartEngine):
    sim = await engine(quick_engine(**ENGINE), wrap=without_metrics)
    outcome = await sweep(sim.url, metrics=True)
    rec = outcome.recommendation
    assert outcome.metrics["available"] is False and "404" in outcome.metrics["reason"]
    assert all(level["engine"] is None for level in outcome.levels)
    assert rec.knee_concurrency == rec.knee_running == 4
    assert rec.batch_capacity is None and rec.capacity_source == "client"
    assert rec.target_waiting == 2


async def test_sweep_stops_at_a_failing_level(engine: StartEngine):
    sim = await engine(quick_engine(**ENGINE))
    await sim.faults(error_rate=1.0)
    outcome = await sweep(sim.url, metrics=False)
    assert [level["concurrency"] for level in outcome.levels] == [1]
    assert outcome.levels[0]["summary"]["errors"] == {"500": 16}
    assert outcome.recommendation.knee_concurrency is None
    assert "100% of its requests failed" in outcome.recommendation.notes[0]
