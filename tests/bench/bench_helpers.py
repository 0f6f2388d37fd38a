"""Helpers for the bench's HTTP tests: a request recorder, an engine without metrics, a runner."""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmgw.core.engine_metrics import parse_exposition
from llmgw.services.bench.client import RequestOptions
from llmgw.services.bench.distributions import Distribution, Fixed
from llmgw.services.bench.protocol import api_urls
from llmgw.services.bench.runner import LoadSpec, open_session, run_load
from llmgw.services.bench.stats import RequestRecord
from llmgw.services.bench.workload import WorkloadSpec
from llmgw.services.sim.params import EngineParams

MODEL = "sim-llama"
PROMPT = Fixed(32)
OUTPUT = Fixed(8)
# vLLM's field that makes each answer exactly max_tokens long (docs/bench.md): these tests count
# the tokens they asked for; without it the simulated model ends most answers on its own.
EXACT = {"ignore_eos": True}


@dataclass
class Engine:
    url: str
    app: Any

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            return await client.get(path)

    async def faults(self, **knobs: Any) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            response = await client.post("/sim/faults", json=knobs)
            response.raise_for_status()

    async def metric(self, name: str) -> float:
        """Sum of a metric's samples in the engine's /metrics."""
        text = (await self.get("/metrics")).text
        return sum(s.value for s in parse_exposition(text) if s.name == name)


StartEngine = Callable[..., Awaitable[Engine]]


@dataclass
class Recorder:
    """ASGI wrapper keeping the headers and JSON body of every generation request."""

    app: Any
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    body = json.loads(b"".join(chunks)) if chunks else None
                    self.requests.append({"path": scope["path"], "headers": headers, "body": body})
            return message

        await self.app(scope, recording_receive, send)


def without_metrics(app: Any) -> Any:
    """The engine as an upstream that exposes no /metrics (404), like many OpenAI servers."""

    async def wrapped(scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        await app(scope, receive, send)

    return wrapped


def quick_engine(**overrides: Any) -> EngineParams:
    """A small, fast engine: 2 ms per token, 1 ms prefill (overrides as keyword arguments)."""
    values = {
        "prefill_base": 0.001,
        "prefill_per_token": 0.0,
        "itl_base": 0.002,
        "itl_per_running_seq": 0.0,
    }
    return EngineParams.model_validate({**values, **overrides})


async def bench(
    url: str,
    *,
    concurrency: int | None = 4,
    rate: float | None = None,
    requests: int | None = 40,
    duration: float | None = None,
    stream: bool = True,
    api: str = "chat",
    prompt: Distribution = PROMPT,
    output: Distribution = OUTPUT,
    seed: int = 1,
    **workload: Any,
) -> list[RequestRecord]:
    """Run `run_load` against `url` with small defaults; the records."""
    urls = api_urls(url)
    options = RequestOptions(
        url=urls.generation(api), model=MODEL, api=api, stream=stream, extra_body=EXACT
    )
    spec = WorkloadSpec(prompt_tokens=prompt, output_tokens=output, run_id="t", **workload)
    if rate is not None:
        concurrency = None
    load = LoadSpec(
        concurrency=concurrency, rate=rate, requests=requests, duration=duration, arrival="fixed"
    )
    async with open_session(10.0) as session:
        return await run_load(session, options, spec, load, rng=random.Random(seed))
