"""An engine's refusal for a prompt's length, through `llmgw up` with the shipped defaults (no
tokenizer configured): a prompt that the gateway's estimate lets through but the engine finds
too long is retried once with what the engine said, on its model's larger-window fallback
(`x-llmgw-fallback-from`), or refused 400 `context_length_exceeded` in the API's own shape when
nothing is larger; one engine call, no lease left, no breaker moved.

The cluster (tests/up/test_up_context_window.py's, other windows, no cap): llama-3.3-70b on
engine-1 and engine-2 (max_model_len 8192 each), its fallback qwen2.5-32b on engine-3 (32768),
each window the scraper's reading of the simulated engine. The simulated engines count a word
of four letters and its space as one token: 1.2 times the gateway's estimate of 6 bytes a
token, so a prompt estimated at 7000 tokens (asking for 8) fits 8192 by the estimate and is
8400 tokens to the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest
from test_up_context_window import Cluster, cluster, text
from timing import eventually
from up_harness import UpProcess

from llmgw.services.fleet.ops import admission_leases

pytestmark = pytest.mark.e2e

MODEL, FALLBACK = "llama-3.3-70b", "qwen2.5-32b"
WINDOWS = {"engine-1": 8192, "engine-2": 8192, "engine-3": 32768}
SMALL = {"engine-1", "engine-2"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = cluster(tmp_path_factory.mktemp("retry") / "cluster.yaml", WINDOWS, cap=None)
    up = UpProcess(config)
    try:
        running = Cluster(up, config)

        def reported() -> dict[str, Any]:
            return {e["endpoint"]: e["context_window"] for e in running.state()["endpoints"]}

        try:  # the scraper's first reports, with each engine's window
            asyncio.run(eventually(lambda: reported() == WINDOWS, 30, interval=0.5))
        except AssertionError as failure:
            raise AssertionError(f"{failure}: {reported()}") from None
        yield running
    finally:
        up.kill_everything()


def refused(gateway: Cluster, engines: set[str]) -> int:
    """Requests the simulated `engines` refused."""
    total = 0
    for engine in engines:
        total += httpx.get(f"{gateway.engines[engine]}/sim/state", timeout=10).json()["rejected"]
    return total


def request(path: str, model: str, content: str, **extra: Any) -> dict[str, Any]:
    """A request of `path`'s API asking for 8 tokens of output."""
    if path == "/responses":
        return {"model": model, "input": content, "max_output_tokens": 8, **extra}
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


def leases(gateway: Cluster) -> dict[str, int]:
    async def ask() -> dict[str, int]:
        nc = await nats.connect(gateway.nats)
        try:
            held = await admission_leases(nc)
        finally:
            await nc.close()
        assert held is not None, "no admission instance answered"
        return {endpoint: n for endpoint, n in held.items() if n}

    return asyncio.run(ask())


@pytest.mark.parametrize(
    ("path", "stream"),
    [
        ("/chat/completions", False),
        ("/chat/completions", True),
        ("/responses", False),
        ("/messages", False),
        ("/messages", True),
    ],
    ids=["chat", "chat-stream", "responses", "messages", "messages-stream"],
)
def test_a_prompt_the_engine_finds_too_long_runs_on_the_larger_window_fallback(
    gateway: Cluster, path: str, stream: bool
) -> None:
    calls, refusals = gateway.engine_calls(), refused(gateway, SMALL)
    routed = gateway.metric("llmgw_admission_window_routes_total", model=MODEL, served=FALLBACK)
    retried = gateway.metric("llmgw_edge_retries_total", outcome="context_length_exceeded")
    extra = {"stream": True} if stream else {}
    reply = gateway.post(path, request(path, MODEL, text(7000), **extra))
    assert reply.status_code == 200, reply.text[:300]
    assert reply.headers["x-llmgw-fallback-from"] == MODEL
    assert reply.headers["x-llmgw-endpoint"] == "engine-3"
    if stream:
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert "data:" in reply.text and "error" not in reply.text
    elif path == "/chat/completions":
        assert reply.json()["usage"]["prompt_tokens"] > WINDOWS["engine-1"]  # truly too long
    # One engine of llama took it in and refused it, then the fallback's served it.
    assert refused(gateway, SMALL) == refusals + 1
    assert gateway.engine_calls() == calls + 2
    after = gateway.metric("llmgw_admission_window_routes_total", model=MODEL, served=FALLBACK)
    assert after == routed + 1
    assert (
        gateway.metric("llmgw_edge_retries_total", outcome="context_length_exceeded") == retried + 1
    )


def test_nothing_larger_is_a_400_in_each_apis_shape_after_one_engine_call_and_no_breaker(
    gateway: Cluster,
) -> None:
    """qwen has no fallback: a prompt its engine refuses (33600 tokens to the engine, 28000 by
    the estimate) is refused by admission with what the engine said, after one engine call per
    request, and no lease is left. Three such refusals of engine-3 (`router.failure_threshold`,
    3 by default) leave its breaker closed: a short request still runs there."""
    calls = gateway.engine_calls()
    too_long = gateway.metric("llmgw_admission_rejections_total", reason="context_length_exceeded")
    for path in ("/chat/completions", "/responses", "/messages"):
        reply = gateway.post(path, request(path, FALLBACK, text(28_000)))
        assert reply.status_code == 400, (path, reply.text[:300])
        error = reply.json()
        if path == "/messages":  # Anthropic's shape
            assert error["type"] == "error"
            assert error["error"]["type"] == "invalid_request_error"
            message = error["error"]["message"]
        else:
            assert set(error["error"]) == {"message", "type", "code", "param"}
            assert (error["error"]["type"], error["error"]["code"]) == (
                "invalid_request_error",
                "context_length_exceeded",
            )
            assert error["error"]["param"] == ("input" if path == "/responses" else "messages")
            message = error["error"]["message"]
        # admission's words, with the window the engine named: not the engine's 400
        assert message.startswith("This model's maximum context length is 32768 tokens."), message
        assert "your request needs at least 32769 tokens" in message, message
    assert gateway.engine_calls() == calls + 3  # one engine call each
    assert leases(gateway) == {}
    assert (
        gateway.metric("llmgw_admission_rejections_total", reason="context_length_exceeded")
        == too_long + 3
    )
    assert gateway.metric("llmgw_admission_endpoint_breaker", endpoint="engine-3", state="closed")
    short = gateway.chat(FALLBACK, "hello")
    assert short.status_code == 200 and short.headers["x-llmgw-endpoint"] == "engine-3"
