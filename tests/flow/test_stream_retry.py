"""Failures before the first byte are retried, streams included, across providers if need be.

Real misbehaving upstreams (tests/misbehaving.py: a raw socket server that sends headers then
closes, resets, sends garbage or an error event, or stalls) next to healthy simulated engines,
flow control on as shipped. The client is the official `openai` SDK (its own retries off) or
httpx; what it gets must be a complete stream, never a 200 cut short.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from inproc import Edge, start_edge, stop_servers
from misbehaving import MisbehavingServer
from rig import BODY, EDGE_LIMITS, MODEL, Rig, open_rig

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, free_port, start_server

FIRST_TOKEN = 1.0  # seconds: the stall mode costs one of these per attempt


@dataclass
class Stack:
    rig: Rig
    edge: Edge
    bad: MisbehavingServer
    engines: dict[str, RunningServer]

    @property
    def url(self) -> str:
        return self.edge.url

    def retries(self) -> float:
        return sum(
            sample.value
            for metric in self.edge.deps.metrics.retries.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )


async def open_stack(
    nats_url: str,
    unique_id: str,
    *,
    bad_mode: str,
    bad_endpoints: tuple[str, ...] = ("engine-1",),
    limits: dict[str, int] = EDGE_LIMITS,
    endpoints: dict[str, dict[str, Any]] | None = None,
) -> Stack:
    """engine-1 (priority 200: tried first) and any other `bad_endpoints` misbehave; the rest
    are simulated engines. An endpoint named with mode "refuse" listens nowhere."""
    bad = await MisbehavingServer(bad_mode if bad_mode != "refuse" else "close").start()
    engines: dict[str, RunningServer] = {}
    urls: dict[str, str] = {}
    for name in ("engine-1", "engine-2", "tensorx-1"):
        if name in bad_endpoints:
            urls[name] = f"http://127.0.0.1:{free_port()}" if bad_mode == "refuse" else bad.url
        else:
            engines[name] = await start_server(
                create_engine_app(EngineParams.zero_delay(), [MODEL])
            )
            urls[name] = engines[name].url
    rig = await open_rig(
        nats_url,
        unique_id,
        urls=urls,
        limits=limits,
        timeouts={"first_token": f"{FIRST_TOKEN}s", "total": "20s"},
        endpoints={"engine-1": {"priority": 200}, **(endpoints or {})},
    )
    await rig.report_all(running=0, capacity=8)
    edge = await start_edge(rig.config, nats_url, edge_id="edge-retry")
    return Stack(rig, edge, bad, engines)


async def close_stack(stack: Stack) -> None:
    await stack.edge.stop()
    await stack.rig.close()
    await stop_servers(stack.engines.values())
    await stack.bad.stop()


@pytest.fixture
async def make_stack(nats_url, unique_id) -> AsyncIterator[Any]:
    opened: list[Stack] = []

    async def make(**kwargs: Any) -> Stack:
        stack = await open_stack(nats_url, unique_id, **kwargs)
        opened.append(stack)
        return stack

    yield make
    for stack in opened:
        await close_stack(stack)


@pytest.mark.parametrize("mode", ["close", "reset", "garbage", "error_event", "stall"])
async def test_a_stream_that_fails_before_its_first_byte_reaches_the_client_complete(
    make_stack, mode
):
    stack = await make_stack(bad_mode=mode)
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="k", max_retries=0)
    started = time.monotonic()
    for n in range(4):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},  # exactly five tokens, then "length"
            stream=True,
            user=f"user-{mode}-{n}",
            extra_headers={"x-llmgw-band": "platinum"},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length", (mode, n, chunks[-1])
        assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) == 5
        assert stream.response.headers["x-llmgw-endpoint"] == "engine-2"
    await client.close()
    # The misbehaving engine was tried first every time until its breaker opened, and every
    # attempt it failed was retried: none reached the client.
    assert 1 <= stack.bad.requests <= stack.rig.config.router.failure_threshold
    assert stack.retries() == stack.bad.requests
    if mode != "stall":  # garbage is judged on arrival, not after the first-token timeout
        assert time.monotonic() - started < FIRST_TOKEN * 2


async def test_a_dead_provider_moves_the_retry_to_the_next_provider_and_opens_at_once(make_stack):
    """Both iris engines refuse connections: each refusal opens its endpoint's breaker at once,
    so after the second one iris is degraded and the first request's last retry moves the
    session's pin to the unlimited provider (nothing had reached the client); the session's
    next request goes there without a failed try."""
    stack = await make_stack(bad_mode="refuse", bad_endpoints=("engine-1", "engine-2"))
    service = stack.rig.admissions[0]
    body = {**BODY, "user": "one-session", "stream": True}
    async with httpx.AsyncClient(timeout=10) as http:
        first = await http.post(
            stack.url + "/v1/chat/completions", json=body, headers={"x-llmgw-band": "gold"}
        )
        assert first.status_code == 200 and first.text.rstrip().endswith("data: [DONE]")
        assert (first.headers["x-llmgw-provider"], first.headers["x-llmgw-route"]) == (
            "tensorx",
            "repinned",
        )
        assert stack.retries() == 2
        now = time.time()
        assert not service.breakers.available("engine-1", now)
        assert not service.breakers.available("engine-2", now)
        assert service.catalog.degraded("iris", MODEL, now)
        second = await http.post(
            stack.url + "/v1/chat/completions", json=body, headers={"x-llmgw-band": "gold"}
        )
    assert second.status_code == 200
    assert (second.headers["x-llmgw-provider"], second.headers["x-llmgw-route"]) == (
        "tensorx",
        "pinned",
    )
    assert stack.retries() == 2  # the second request went straight to the live provider


async def test_resets_count_against_the_endpoint_and_the_retry_leaves_the_provider(make_stack):
    """Resets are breaker failures one by one (a closed keep-alive connection looks the same),
    and the retries still leave for the next provider: no client error."""
    stack = await make_stack(bad_mode="reset", bad_endpoints=("engine-1", "engine-2"))
    service = stack.rig.admissions[0]
    async with httpx.AsyncClient(timeout=10) as http:
        for n in range(3):
            response = await http.post(
                stack.url + "/v1/chat/completions",
                json={**BODY, "user": f"reset-{n}"},
                headers={"x-llmgw-band": "gold"},
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-llmgw-provider"] == "tensorx"
    assert stack.bad.requests == 6  # both engines tried for each request
    assert not service.breakers.available("engine-1", time.time())  # three resets: open


async def test_a_retry_does_not_find_its_session_at_the_limit_because_of_its_own_failed_try(
    make_stack,
):
    """One request in flight per session: the retry names the failed attempt's lease, which is
    released before the retry is decided, so the retry stays on the session's pin (iris)
    instead of running elsewhere as if the session were at its limit."""
    limits = {**EDGE_LIMITS, "max_per_session_in_flight_request_slots": 1}
    stack = await make_stack(bad_mode="close", limits=limits)
    async with httpx.AsyncClient(timeout=10) as http:
        for n in range(3):
            response = await http.post(
                stack.url + "/v1/chat/completions",
                json={**BODY, "user": f"limited-{n}", "stream": True},
                headers={"x-llmgw-band": "platinum"},
            )
            assert response.status_code == 200
            assert response.text.rstrip().endswith("data: [DONE]")
            assert response.headers["x-llmgw-provider"] == "iris", response.headers
            assert response.headers["x-llmgw-endpoint"] == "engine-2"
    assert stack.bad.requests == 3 and stack.retries() == 3


async def test_endpoints_that_opted_in_get_the_bands_engine_priority(make_stack):
    """`priority_scheduling: true` on engine-1: the edge sends each band's priority (lower runs
    first in vLLM); engine-2 did not opt in and gets no `priority` field."""
    stack = await make_stack(
        bad_mode="echo", endpoints={"engine-1": {"priority": 200, "priority_scheduling": True}}
    )
    async with httpx.AsyncClient(timeout=10) as http:
        for band in ("platinum", "gold", "silver", "bronze"):
            response = await http.post(
                stack.url + "/v1/chat/completions",
                json={**BODY, "user": f"band-{band}"},
                headers={"x-llmgw-band": band},
            )
            assert response.status_code == 200
            assert response.headers["x-llmgw-endpoint"] == "engine-1"
    assert [body.get("priority") for body in stack.bad.bodies] == [0, 1, 2, 3]
