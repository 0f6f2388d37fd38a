"""The provider simulator: its pure pieces and its HTTP behaviour (drift, limits, pacing)."""

from __future__ import annotations

import asyncio
import time

import pytest
from sim_helpers import Serve, content_of, read_sse
from timing import eventually

from llmgw.services.sim.apps import create_provider_app
from llmgw.services.sim.params import ProviderParams
from llmgw.services.sim.provider_model import RateSchedule, TokenBucket, token_times

MODEL = "vendor-model"


def schedule(**params: object) -> RateSchedule:
    return RateSchedule(ProviderParams.model_validate(params))


@pytest.mark.parametrize(
    ("params", "elapsed", "rate"),
    [
        ({"tokens_per_second": 10}, 99.0, 10.0),
        ({"tokens_per_second": 10, "drift": [{"at": 5, "tokens_per_second": 40}]}, 4.9, 10.0),
        ({"tokens_per_second": 10, "drift": [{"at": 5, "tokens_per_second": 40}]}, 5.0, 40.0),
        (
            {
                "drift": [{"at": 0, "tokens_per_second": 20}, {"at": 10, "tokens_per_second": 40}],
                "drift_mode": "linear",
            },
            5.0,
            30.0,
        ),
        (
            {
                "drift": [{"at": 0, "tokens_per_second": 20}, {"at": 10, "tokens_per_second": 40}],
                "drift_mode": "linear",
            },
            50.0,
            40.0,
        ),
        (
            {
                "drift": [
                    {"at": 0, "tokens_per_second": 20},
                    {"at": "10s", "tokens_per_second": 40},
                ],
                "drift_period": "20s",
            },
            25.0,
            20.0,
        ),
    ],
    ids=["constant", "before-step", "at-step", "linear-midpoint", "linear-holds-last", "periodic"],
)
def test_rate_schedule(params: dict, elapsed: float, rate: float) -> None:
    assert schedule(**params).rate_at(elapsed) == pytest.approx(rate)


def test_token_times_follow_the_rate_in_force_at_each_token() -> None:
    rates = schedule(tokens_per_second=10, drift=[{"at": 0.25, "tokens_per_second": 100}])
    times = token_times(rates, origin=0.0, first_at=0.1, count=5)
    assert times == pytest.approx([0.1, 0.2, 0.3, 0.31, 0.32])
    instant = token_times(schedule(tokens_per_second=0), 0.0, 1.0, 3)
    assert instant == [1.0, 1.0, 1.0]


def test_token_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket.full(rate=2.0, capacity=2.0, now=0.0)
    assert bucket.try_take(0.0) == 0.0
    assert bucket.try_take(0.0) == 0.0
    assert bucket.try_take(0.0) == pytest.approx(0.5)
    assert bucket.try_take(0.25) == pytest.approx(0.25)
    assert bucket.try_take(0.5) == 0.0


async def _stream_rate(client, max_tokens: int) -> float:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=request) as response:
        chunks, done, arrivals = await read_sse(response)
    assert done
    times = [at for chunk, at in zip(chunks, arrivals, strict=True) if content_of(chunk)]
    assert len(times) == max_tokens
    return (len(times) - 1) / (times[-1] - times[0])


async def test_drift_changes_the_observed_token_rate(serve: Serve) -> None:
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    params = ProviderParams(
        tokens_per_second=400,
        base_latency=0,
        input_tokens_per_second=0,
        drift=[{"at": 100, "tokens_per_second": 50}],
    )
    client = await serve(create_provider_app(params, [MODEL], clock=clock))
    fast = await _stream_rate(client, 21)
    offset[0] = 100.0  # jump past the drift point instead of waiting for it
    assert (await client.get("/sim/state")).json()["tokens_per_second"] == 50
    slow = await _stream_rate(client, 11)
    assert fast > 3 * slow
    assert slow < 80


async def test_requests_per_second_limit_answers_429_with_retry_after(serve: Serve) -> None:
    params = ProviderParams.zero_delay(requests_per_second=0.5, burst=2, retry_after=1)
    client = await serve(create_provider_app(params, [MODEL]))
    request = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    statuses = [(await client.post("/v1/completions", json=request)) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    limited = statuses[2]
    assert int(limited.headers["retry-after"]) >= 2  # one request per 2 s refills the bucket
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert (await client.get("/sim/state")).json()["rate_limited"] == 1


async def test_max_concurrent_limit_answers_429_while_a_request_is_in_flight(serve: Serve) -> None:
    params = ProviderParams(tokens_per_second=20, base_latency=0, max_concurrent=1)
    client = await serve(create_provider_app(params, [MODEL]))
    request = {"model": MODEL, "prompt": "x", "max_tokens": 5}
    first = asyncio.create_task(client.post("/v1/completions", json=request))

    async def in_flight() -> bool:
        return (await client.get("/sim/state")).json()["in_flight"] == 1

    await eventually(in_flight)
    second = await client.post("/v1/completions", json=request)
    assert second.status_code == 429
    assert "retry-after" in second.headers
    assert (await first).status_code == 200
    third = await client.post("/v1/completions", json=request)
    assert third.status_code == 200


async def test_provider_paces_ttft_and_reports_usage(serve: Serve) -> None:
    params = ProviderParams(base_latency="150ms", input_tokens_per_second=0, tokens_per_second=0)
    client = await serve(create_provider_app(params, [MODEL]))
    started = time.monotonic()
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "ignore_eos": True,
        },
    )
    assert time.monotonic() - started >= 0.15
    body = response.json()
    assert body["usage"]["completion_tokens"] == 4
    assert (await client.get("/metrics")).status_code == 404
    assert (await client.get("/health")).text == "ok"
