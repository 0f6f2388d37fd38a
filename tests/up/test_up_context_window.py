"""Context-window routing through `llmgw up`, with the shipped defaults: each engine's window
learned from its `GET /v1/models`, one capped by the config, a prompt placed only where it fits,
sent to its model's larger-window fallback when it fits no engine of its model, and answered
400 `context_length_exceeded` in each API's shape, before admission, when nothing fits.

The cluster (config/local.yaml, without its third party): llama-3.3-70b (falls back to
qwen2.5-32b) on engine-1 (max_model_len 1024) and engine-2 (4096); qwen2.5-32b on engine-3
(max_model_len 16384, but `context_window: 8192` in the config). No window but engine-3's cap
is configured: the others are the scraper's reading of the simulated engines.

Prompts are sized by the gateway's estimate (`llmgw.core.context.BYTES_PER_TOKEN`): the
simulated engines count a word of four letters and its space as one token, so their real count
is 1.2 times the estimate, and an estimate over a window is truly over it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_up_operability import READY
from timing import eventually
from up_harness import UpProcess, llmgw_cli, write_cluster_config

from llmgw.core.context import BYTES_PER_TOKEN

pytestmark = pytest.mark.e2e

MODEL, FALLBACK = "llama-3.3-70b", "qwen2.5-32b"
WINDOWS = {"engine-1": 1024, "engine-2": 4096, "engine-3": 16384}  # their max_model_len
CAP = 8192  # engine-3's context_window in the config: wins over its engine's 16384
ADMIN = r"^llmgw up: edge \S+, admin (\S+), NATS (\S+)$"


def text(estimate: int) -> str:
    """Content the gateway estimates at `estimate` tokens at least (5 bytes a word)."""
    return "abcd " * math.ceil(estimate * BYTES_PER_TOKEN / 5)


def cluster(path: Path, windows: dict[str, int] = WINDOWS, cap: int | None = CAP) -> Path:
    """config/local.yaml's managed engines, llama on engine-1 and engine-2, its fallback qwen on
    engine-3 (the third party's port), each simulated with its window of `windows`; `cap`:
    engine-3's `context_window` in the config."""
    config = write_cluster_config(path)
    data = yaml.safe_load(config.read_text())
    data["providers"] = [p for p in data["providers"] if p["kind"] == "managed"]
    data.pop("spend", None)  # its prices are the third party's
    engines = {e["id"]: e for e in data["endpoints"]}
    third = engines["tensorx-east"]  # its free port, for the fallback's engine
    engine3 = {**engines["engine-2"], "id": "engine-3", "url": third["url"]}
    engine3["simulate"] = {**engines["engine-2"]["simulate"], "seed": 3}
    data["endpoints"] = [engines["engine-1"], engines["engine-2"], engine3]
    for engine, model in (("engine-1", MODEL), ("engine-2", MODEL), ("engine-3", FALLBACK)):
        endpoint = next(e for e in data["endpoints"] if e["id"] == engine)
        endpoint["models"] = [model]
        endpoint["simulate"]["max_model_len"] = windows[engine]
    if cap is not None:
        engine3["context_window"] = cap
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config


class Cluster:
    def __init__(self, up: UpProcess, config: Path) -> None:
        self.config = config
        self.api, key = up.wait_for(READY, timeout=90).groups()
        self.admin, self.nats = up.wait_for(ADMIN).groups()
        self.headers = {"authorization": f"Bearer {key}"}
        data = yaml.safe_load(config.read_text())
        self.engines = {e["id"]: e["url"] for e in data["endpoints"]}

    def post(self, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        return httpx.post(
            f"{self.api}{path}", json=body, headers={**self.headers, **headers}, timeout=60
        )

    def chat(self, model: str, content: str, **extra: Any) -> httpx.Response:
        session = extra.pop("session", None)
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        headers = {"x-session-id": session} if session else {}
        return self.post("/chat/completions", {"max_tokens": 8, **body, **extra}, **headers)

    def state(self) -> dict[str, Any]:
        done = llmgw_cli(self.config, "state", "--json", env={"LLMGW_NATS__URL": self.nats})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def metric(self, name: str, **labels: str) -> float:
        metrics = httpx.get(f"{self.admin}/metrics", timeout=10).text
        return sum(
            s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def engine_calls(self) -> int:
        """Requests the simulated engines took in: finished, or refused by the engine."""
        total = 0
        for url in self.engines.values():
            state = httpx.get(f"{url}/sim/state", timeout=10).json()
            total += sum(state["finished"].values()) + state["rejected"]
        return total


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = cluster(tmp_path_factory.mktemp("window") / "cluster.yaml")
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


def test_each_engines_window_is_learned_from_its_model_list(gateway: Cluster) -> None:
    """`llmgw state` shows what the scraper read: max_model_len of each engine's /v1/models
    (engine-3's own 16384: the config's cap is admission's business, not the engine's)."""
    reported = {e["endpoint"]: e["context_window"] for e in gateway.state()["endpoints"]}
    assert reported == WINDOWS


def test_a_prompt_runs_only_on_the_engines_of_its_model_it_fits(gateway: Cluster) -> None:
    """New sessions spread over both engines of llama; those too long for engine-1's 1024
    tokens all run on engine-2 (without the filter about half would meet engine-1's 400)."""
    short = [gateway.chat(MODEL, "hi", session=f"short-{i}") for i in range(16)]
    assert all(r.status_code == 200 for r in short)
    longer = [gateway.chat(MODEL, text(2000), session=f"long-{i}") for i in range(8)]
    assert [r.status_code for r in longer] == [200] * 8, [r.text[:200] for r in longer]
    assert {r.headers["x-llmgw-endpoint"] for r in longer} == {"engine-2"}
    assert not any("x-llmgw-fallback-from" in r.headers for r in longer)
    # (new sessions are spread by their ring order: 16 of them all on engine-2 is a 2^-16 case)
    assert {r.headers["x-llmgw-endpoint"] for r in short} == {"engine-1", "engine-2"}


def test_a_prompt_too_long_for_its_model_runs_on_the_larger_window_fallback(
    gateway: Cluster,
) -> None:
    before = gateway.metric("llmgw_admission_window_routes_total", model=MODEL, served=FALLBACK)
    reply = gateway.chat(MODEL, text(5000))
    assert reply.status_code == 200, reply.text[:300]
    assert reply.headers["x-llmgw-fallback-from"] == MODEL
    assert reply.headers["x-llmgw-endpoint"] == "engine-3"
    assert reply.json()["usage"]["prompt_tokens"] > WINDOWS["engine-2"]  # truly too long there
    after = gateway.metric("llmgw_admission_window_routes_total", model=MODEL, served=FALLBACK)
    assert after == before + 1


def _requests(content: str, max_tokens: int) -> list[tuple[str, dict[str, Any], str]]:
    """One request per API, with the parameter OpenAI's error names."""
    return [
        (
            "/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": content}]},
            "messages",
        ),
        ("/completions", {"model": MODEL, "prompt": content}, "prompt"),
        ("/responses", {"model": MODEL, "input": content}, "input"),
        (
            "/messages",
            {"model": MODEL, "messages": [{"role": "user", "content": content}]},
            "messages",
        ),
    ]


@pytest.mark.parametrize(
    ("estimate", "max_tokens"),
    [(17_000, 16), (5000, 4000)],
    ids=["prompt-over-every-window", "prompt-and-max-tokens-over-the-cap"],
)
def test_nothing_fits_is_a_400_in_each_apis_shape_without_a_lease_or_an_engine_call(
    gateway: Cluster, estimate: int, max_tokens: int
) -> None:
    """The second case fits engine-3's learned 16384 and its cap of 8192 by its prompt alone:
    prompt plus max_tokens is what vLLM counts."""
    calls = gateway.engine_calls()
    placed = gateway.metric("llmgw_admission_placements_total")
    refused = gateway.metric("llmgw_admission_rejections_total", reason="context_length_exceeded")
    for path, body, param in _requests(text(estimate), max_tokens):
        output = "max_output_tokens" if path == "/responses" else "max_tokens"
        reply = gateway.post(path, {**body, output: max_tokens})
        assert reply.status_code == 400, (path, reply.text[:300])
        error = reply.json()
        if path == "/messages":  # Anthropic's shape
            assert error["type"] == "error"
            assert error["error"]["type"] == "invalid_request_error"
            assert "maximum context length" in error["error"]["message"]
        else:
            assert set(error["error"]) == {"message", "type", "code", "param"}
            assert error["error"]["code"] == "context_length_exceeded"
            assert (error["error"]["type"], error["error"]["param"]) == (
                "invalid_request_error",
                param,
            )
            assert re.search(r"maximum context length is 8192 tokens", error["error"]["message"])
    assert gateway.engine_calls() == calls  # no engine saw any of them
    assert gateway.metric("llmgw_admission_placements_total") == placed  # no lease
    assert (
        gateway.metric("llmgw_admission_rejections_total", reason="context_length_exceeded")
        == refused + 4
    )


def test_the_configured_window_wins_over_the_engines(gateway: Cluster) -> None:
    """engine-3's engine takes 16384 tokens; its `context_window: 8192` is what counts."""
    fits = gateway.chat(FALLBACK, text(6000))
    assert fits.status_code == 200 and fits.headers["x-llmgw-endpoint"] == "engine-3"
    calls = gateway.engine_calls()
    capped = gateway.chat(FALLBACK, text(9000))
    assert capped.status_code == 400, capped.text[:300]
    assert capped.json()["error"]["code"] == "context_length_exceeded"
    assert gateway.engine_calls() == calls


def test_a_pinned_session_that_outgrows_its_engine_moves_then_falls_back(
    gateway: Cluster,
) -> None:
    """A conversation that began on engine-1 moves to engine-2 under its pin when it outgrows
    1024 tokens, then to the fallback model once it outgrows llama's 4096."""
    session: str | None = None
    first: httpx.Response | None = None
    for i in range(16):  # a new session on engine-1 (sessions are spread by their ring order)
        first = gateway.chat(MODEL, "hello", session=f"grow-{i}")
        assert first.status_code == 200
        if first.headers["x-llmgw-endpoint"] == "engine-1":
            session = f"grow-{i}"
            break
    assert session is not None and first is not None
    headers = {"x-session-id": session}
    messages: list[dict[str, str]] = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
    ]

    def turn(content: str) -> httpx.Response:
        messages.append({"role": "user", "content": content})
        reply = gateway.post(
            "/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 8},
            **headers,
        )
        assert reply.status_code == 200, reply.text[:300]
        answer = reply.json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})
        return reply

    second = turn(text(2000))
    assert second.headers["x-llmgw-endpoint"] == "engine-2"
    assert second.headers["x-llmgw-route"] == "pinned"  # its pin stayed: iris fits it still
    third = turn(text(3000))
    assert third.headers["x-llmgw-endpoint"] == "engine-3"
    assert third.headers["x-llmgw-fallback-from"] == MODEL
