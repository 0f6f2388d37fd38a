"""A model's own `context_window` (for endpoints whose engines say nothing: here no scraper
runs) through a real edge, admission instance, NATS and simulated engines: a prompt too long
for it runs on the model's fallback, with or without prefix chains (the prompt's length
travels either way). An engine's refusal for a prompt's length is retried once, with what the
engine said or, when it names no window, the window admission knows for its endpoint."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import pytest
from inproc import HeaderRecorder, before_any_lease, start_admission, start_edge, stop_servers

from llmgw.config import Config
from llmgw.core.breaker import BreakerState
from llmgw.core.context import BYTES_PER_TOKEN
from llmgw.core.outcomes import Refusal
from llmgw.services.admission.service import AdmissionService
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.wire import AdmitRequest, ContextExceeded, ReplyStatus

WINDOW = 200  # m1's context_window: its endpoints say nothing of their own


def text(estimate: int) -> str:
    """Content the gateway estimates at `estimate` tokens at least."""
    return "abcd " * math.ceil(estimate * BYTES_PER_TOKEN / 5)


@dataclass
class Running:
    url: str
    received: dict[str, HeaderRecorder]  # per engine: what it was sent
    admission: AdmissionService


@contextlib.asynccontextmanager
async def running(
    make_config: Callable[..., Config],
    nats_url: str,
    unique_id: str,
    models: list[dict[str, Any]],
    max_model_len: int = 32768,  # the simulated engines' own window (the simulator's default)
    **overrides: Any,
) -> AsyncIterator[Running]:
    engines, received = {}, {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        params = EngineParams.zero_delay(seed=seed, max_model_len=max_model_len)
        received[name] = HeaderRecorder(create_engine_app(params, ["m1", "m2"]))
        engines[name] = await start_server(received[name])
    config = make_config(
        nats_url,
        {k: v.url for k, v in engines.items()},
        f"routing_{unique_id}",
        models=models,
        **overrides,
    )
    with before_any_lease(config):
        admission = await start_admission(
            config, nats_url, instance="admission-window", follow_load=False
        )
    edge = await start_edge(config, nats_url, edge_id="edge-window")
    try:
        yield Running(edge.url, received, admission.service)
    finally:
        await edge.stop()
        await admission.stop()
        nc = await nats.connect(nats_url)
        await nc.jetstream().delete_key_value(config.pinning.bucket)
        await nc.close()
        await stop_servers(engines.values())


WITH_FALLBACK = [{"name": "m1", "fallbacks": ["m2"], "context_window": WINDOW}, {"name": "m2"}]


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-chains", "prefix-off"])
async def test_a_prompt_over_the_models_window_runs_on_its_fallback(
    make_gateway_config: Callable[..., Config], nats_url: str, unique_id: str, prefix: bool
) -> None:
    overrides = {} if prefix else {"prefix": {"enabled": False}}
    async with running(
        make_gateway_config, nats_url, unique_id, WITH_FALLBACK, **overrides
    ) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:

            async def ask(content: str, **extra: Any) -> httpx.Response:
                body = {"model": "m1", "messages": [{"role": "user", "content": content}]}
                return await client.post("/v1/chat/completions", json={**body, **extra})

            short = await ask("hello", max_tokens=8)
            assert short.status_code == 200
            assert "x-llmgw-fallback-from" not in short.headers
            assert short.json()["model"] == "m1"

            long = await ask(text(WINDOW), max_tokens=8)
            assert long.status_code == 200, long.text
            assert long.headers["x-llmgw-fallback-from"] == "m1"
            assert long.json()["model"] == "m2"  # the engine was asked for the fallback

            # Short, but asking for more output than the window holds: vLLM's count.
            greedy = await ask("hello", max_tokens=WINDOW)
            assert greedy.status_code == 200
            assert greedy.headers["x-llmgw-fallback-from"] == "m1"
        assert sum(len(r.seen) for r in gateway.received.values()) == 3


async def test_only_an_edge_that_says_the_output_is_refused_for_its_length(
    make_gateway_config: Callable[..., Config], nats_url: str, unique_id: str
) -> None:
    """An edge from before context windows sends no `max_output` and could not read the
    refusal: its request that fits nowhere is placed as before (the engine judges)."""
    both = [
        {"name": "m1", "fallbacks": ["m2"], "context_window": WINDOW},
        {"name": "m2", "context_window": WINDOW},
    ]
    async with running(make_gateway_config, nats_url, unique_id, both) as gateway:
        ask = {
            "edge": "edge-old",
            "model": "m1",
            "feature": "chat",
            "shard": 0,
            "prompt_bytes": BYTES_PER_TOKEN * (WINDOW + 1),
        }
        new = await gateway.admission.decide(AdmitRequest(id="new", max_output=0, **ask))
        assert (new.status, new.refusal) == (
            ReplyStatus.REFUSED,
            Refusal.CONTEXT_LENGTH_EXCEEDED,
        )
        assert new.message is not None and "maximum context length is 200 tokens" in new.message
        old = await gateway.admission.decide(AdmitRequest(id="old", **ask))
        assert old.status is ReplyStatus.ADMITTED and old.served_model == "m1"
        assert old.lease is not None
        gateway.admission.ledger.release(old.lease.lease_id, 0.0, refresh=False)


async def test_a_models_tokenizer_counts_the_prompt_exactly_without_kv_events(
    make_gateway_config: Callable[..., Config], nats_url: str, unique_id: str
) -> None:
    """`tokenizer: engine` on a model whose engines send no KV cache events: the prompt's
    tokens are counted (the engine's /tokenize), so a prompt whose bytes estimate fits the
    window but whose tokens do not runs on the fallback, not on an engine that would refuse it."""
    models = [
        {"name": "m1", "fallbacks": ["m2"], "context_window": WINDOW, "tokenizer": "engine"},
        {"name": "m2"},
    ]
    dense = "a. " * WINDOW  # two tokens in three bytes: ~WINDOW / 2 by the bytes, 2 x WINDOW
    assert len(dense.encode()) // BYTES_PER_TOKEN < WINDOW
    async with running(make_gateway_config, nats_url, unique_id, models) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            body = {"model": "m1", "messages": [{"role": "user", "content": dense}]}
            answer = await client.post("/v1/chat/completions", json={**body, "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-llmgw-fallback-from"] == "m1"
    assert answer.json()["model"] == "m2"
    assert answer.json()["usage"]["prompt_tokens"] > WINDOW


async def test_an_engines_refusal_for_length_is_retried_once_and_never_counts_as_its_failure(
    make_gateway_config: Callable[..., Config], nats_url: str, unique_id: str
) -> None:
    """Engines of 200 tokens that admission knows nothing of: a prompt they find too long
    (220 tokens to them, 183 by the estimate) is refused by engine-1 (iris's first), retried
    once, on engine-2 (never engine-1 again), whose own 400 is the client's answer: no third
    attempt on the third party, however many `retries` the profile has left. Four such
    requests in a row leave both breakers closed (three endpoint failures open one)."""
    async with running(
        make_gateway_config, nats_url, unique_id, [{"name": "m1"}, {"name": "m2"}], 200
    ) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            for n in range(4):
                reply = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m1",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"{n} " + text(180)}],
                    },
                )
                assert reply.status_code == 400, reply.text
                assert reply.headers["x-llmgw-endpoint"] == "engine-2"
                error = reply.json()["error"]
                assert error["code"] == "context_length_exceeded"
                assert "maximum context length is 200 tokens" in error["message"]
        seen = {name: len(r.seen) for name, r in gateway.received.items()}
        assert seen == {"engine-1": 4, "engine-2": 4, "tensorx-1": 0}
        breakers = gateway.admission.breakers
        now = time.time()
        assert breakers.state("engine-1", now) is BreakerState.CLOSED
        assert breakers.state("engine-2", now) is BreakerState.CLOSED
        assert breakers.open_endpoints(now) == []


async def test_a_refusal_that_names_no_window_is_placed_beyond_the_endpoints_known_one(
    make_gateway_config: Callable[..., Config], nats_url: str, unique_id: str
) -> None:
    """An engine's refusal says its window (`window`), else admission takes the one it knows
    for that endpoint (here m1's `context_window`: 200); an endpoint of no known window teaches
    nothing more (only `exclude` keeps the retry off it)."""
    async with running(make_gateway_config, nats_url, unique_id, WITH_FALLBACK) as gateway:
        ask = {
            "edge": "edge-test",
            "model": "m1",
            "feature": "chat",
            "shard": 0,
            "prompt_bytes": BYTES_PER_TOKEN * 100,
            "max_output": 8,
        }

        async def served(name: str, exceeded: ContextExceeded | None) -> str | None:
            reply = await gateway.admission.decide(AdmitRequest(id=name, exceeded=exceeded, **ask))
            assert reply.status is ReplyStatus.ADMITTED and reply.lease is not None
            gateway.admission.ledger.release(reply.lease.lease_id, 0.0, refresh=False)
            return reply.served_model

        assert await served("fits", None) == "m1"
        unnamed = ContextExceeded(endpoint="engine-1", model="m1")
        assert await served("unnamed", unnamed) == "m2"
        # The engine's word, not the known window: a request that needs more than 250 tokens
        # fits none of m1's 200; one that needs more than 150 may (engine-1's config may be
        # wrong, or another endpoint larger: only `exclude` keeps it off engine-1).
        named = ContextExceeded(endpoint="engine-1", model="m1", window=250)
        assert await served("named", named) == "m2"
        smaller = ContextExceeded(endpoint="engine-1", model="m1", window=150)
        assert await served("smaller", smaller) == "m1"
        # m2 has no window anywhere: nothing is known beyond what the edge excludes
        unknown = ContextExceeded(endpoint="engine-1", model="m2")
        assert await served("unknown", unknown) == "m1"
