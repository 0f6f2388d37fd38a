"""Relaying to engines: streaming without buffering, and every upstream failure made clear."""

import json
import time

import httpx
import pytest

from llmgw.services.sim.params import EngineParams

CHAT_PATH = "/v1/chat/completions"


@pytest.fixture
def engine_params():
    # 40 ms between tokens: slow enough to see chunks arrive one by one.
    return EngineParams.zero_delay(itl_base="40ms")


def chat(max_tokens=8, stream=True, **extra):
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": "count slowly"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # the engine writes every token asked for: streams are timed and cut
        "stream": stream,
        **extra,
    }


async def set_faults(engine_url, **faults):
    async with httpx.AsyncClient() as http:
        response = await http.post(engine_url + "/sim/faults", json=faults)
        response.raise_for_status()


async def test_stream_chunks_reach_the_client_as_the_engine_produces_them(gateway):
    arrivals = []
    async with httpx.AsyncClient() as http:
        started = time.perf_counter()
        async with http.stream(
            "POST", gateway.url + CHAT_PATH, json=chat(max_tokens=10)
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert len(response.headers.get_list("content-type")) == 1
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.perf_counter() - started, line))
    assert arrivals[-1][1] == "data: [DONE]"
    # Ten tokens at 40 ms each take >= 0.36 s to generate; a buffering relay
    # would deliver the first one together with the last.
    first, last = arrivals[0][0], arrivals[-1][0]
    assert last - first >= 0.25, arrivals


async def test_an_unreachable_engine_is_retried_elsewhere_then_on_the_next_provider(gateway):
    await gateway.engines["engine-1"].stop()
    async with httpx.AsyncClient() as http:
        retried = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
        assert retried.status_code == 200  # nothing had reached the client: another endpoint
        assert retried.headers["x-llmgw-endpoint"] == "engine-2"
        retries = gateway.deps.metrics.retries.labels("upstream_unreachable")._value.get()
        assert retries == 1
        await gateway.engines["engine-2"].stop()
        # Every iris endpoint refused a connection (each breaker opened at once): iris is
        # degraded, and the retry moves the pin to the next provider; nothing reached the client.
        moved = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
        assert moved.status_code == 200
        assert moved.headers["x-llmgw-provider"] == "tensorx"
        assert moved.headers["x-llmgw-route"] == "repinned"
        # m2 has no other provider, and both its endpoints are known to refuse connections:
        # 503 with Retry-After at once, no upstream tried again.
        response = await http.post(
            gateway.url + CHAT_PATH, json={**chat(stream=False), "model": "m2"}
        )
    assert response.status_code == 503 and "retry-after" in response.headers
    # engine-1 was skipped (its breaker open) by the m1 request, engine-2 tried once: one retry.
    assert gateway.deps.metrics.retries.labels("upstream_unreachable")._value.get() == retries + 1


async def test_engine_that_dies_mid_stream_ends_with_an_sse_error_event(gateway):
    await set_faults(gateway.engines["engine-1"].url, die_at_token=3)
    async with httpx.AsyncClient() as http:
        response = await http.post(gateway.url + CHAT_PATH, json=chat(max_tokens=10))
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "upstream_broken_stream"


async def test_engine_stalling_after_headers_hits_the_first_token_timeout(gateway):
    await set_faults(gateway.engines["engine-1"].url, stall_after_headers="30s")
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=20) as http:
        response = await http.post(gateway.url + CHAT_PATH, json=chat(max_tokens=10))
    elapsed = time.monotonic() - started
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == "upstream_timeout"
    limits = gateway.config.timeouts
    assert elapsed < limits.first_token + limits.idle + 2


async def test_headers_that_do_not_come_in_time_are_retried_on_another_engine(gateway):
    await set_faults(
        gateway.engines["engine-1"].url, slow_headers="3s"
    )  # beyond response_header (2s)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=20) as http:
        response = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
    elapsed = time.monotonic() - started
    assert response.status_code == 200 and response.headers["x-llmgw-endpoint"] == "engine-2"
    limits = gateway.config.timeouts
    assert limits.response_header <= elapsed < limits.response_header + 2
    assert gateway.deps.metrics.retries.labels("upstream_timeout")._value.get() == 1


async def test_a_429_is_retried_on_another_engine(gateway):
    await set_faults(gateway.engines["engine-1"].url, rate_limit_rate=1.0, retry_after=7)
    async with httpx.AsyncClient() as http:
        response = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
    assert response.status_code == 200 and response.headers["x-llmgw-endpoint"] == "engine-2"


async def test_engine_429_passes_through_with_retry_after_when_every_engine_refuses(gateway):
    for engine in ("engine-1", "engine-2", "tensorx-1"):
        await set_faults(gateway.engines[engine].url, rate_limit_rate=1.0, retry_after=7)
    async with httpx.AsyncClient() as http:
        response = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"]["message"]


async def test_engine_500_becomes_502_with_the_engine_message(gateway):
    for engine in ("engine-1", "engine-2", "tensorx-1"):
        await set_faults(gateway.engines[engine].url, error_rate=1.0)
    async with httpx.AsyncClient() as http:
        response = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"


async def test_an_engine_refusing_the_gateways_key_is_retried_elsewhere_never_a_client_401(
    gateway,
):
    """A 401/403 from upstream is about the gateway's key for that provider (revoked, rotated):
    the attempt is the endpoint's failure, retried on another; where none is left the client
    gets a 502 naming the provider, never a 401 that would blame its own key."""
    await set_faults(gateway.engines["engine-1"].url, api_keys=["a-key-we-do-not-have"])
    async with httpx.AsyncClient() as http:
        retried = await http.post(gateway.url + CHAT_PATH, json=chat(stream=False))
        assert retried.status_code == 200 and retried.headers["x-llmgw-endpoint"] == "engine-2"
        for engine in ("engine-2", "tensorx-1"):
            await set_faults(gateway.engines[engine].url, api_keys=["a-key-we-do-not-have"])
        for stream in (False, True):
            response = await http.post(gateway.url + CHAT_PATH, json=chat(stream=stream))
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["code"] == "upstream_error"
            assert "refused the gateway's credentials (401)" in error["message"], error
    assert gateway.deps.metrics.retries.labels("upstream_error")._value.get() >= 1
