"""Cache-aware placement through `llmgw up` with the shipped config: new sessions that share a
tenant's system prompt start on the engine that already holds it, and a second admission
instance (a process of its own, deciding the sessions of its shards) sends them to the same
engine, learning where the prompt is from the prefix stream. `llmgw state` shows the prefix."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from test_up_operability import NATS, READY
from timing import eventually
from up_harness import REPO, UpProcess, llmgw_cli, write_cluster_config

from llmgw.serving import free_port

sys.path.insert(0, str(REPO / "benchmarks"))
from placement import start_admission, stop_process, until_serving

pytestmark = pytest.mark.e2e

MODEL = "llama-3.3-70b"


def system_prompt(tenant: str) -> str:
    """About 1,500 tokens of a tenant's own instructions."""
    return " ".join(
        f"{tenant} rule {i}: answer in the house style of {tenant}." for i in range(150)
    )


async def sessions(api: str, key: str, tenant: str, count: int) -> list[tuple[str, int, int]]:
    """`count` new sessions of `tenant`, one after the other: each one's engine, prompt tokens
    and cached prompt tokens."""
    placed = []
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=60) as client:
        for i in range(count):
            reply = await client.post(
                "/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": system_prompt(tenant)},
                        {"role": "user", "content": f"question {i} of {tenant}"},
                    ],
                    "max_tokens": 4,
                },
            )
            assert reply.status_code == 200, reply.text
            usage = reply.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            placed.append((reply.headers["x-llmgw-endpoint"], usage["prompt_tokens"], cached))
    return placed


@pytest.mark.parametrize("instances", [1, 2])
def test_sessions_sharing_a_prompt_start_where_it_is_cached(
    tmp_path: Path, start_up: Callable[..., UpProcess], instances: int
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml")
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    extra = []
    if instances > 1:
        joined = tmp_path / "admission.yaml"
        data = yaml.safe_load(config.read_text())
        data["nats"] = {"url": nats_url}
        joined.write_text(yaml.safe_dump(data, sort_keys=False))
        extra = [start_admission(joined, f"127.0.0.1:{free_port()}")]
    try:
        asyncio.run(until_serving(nats_url, instances))
        placed = {t: asyncio.run(sessions(api, key, t, 12)) for t in ("acme", "globex")}
    finally:
        for process in extra:
            stop_process(process)
    for tenant, runs in placed.items():
        engines = Counter(engine for engine, _, _ in runs)
        home, count = engines.most_common(1)[0]
        # The first conversation chose freely; every later one found the prompt where it went.
        assert count >= len(runs) - 1, (tenant, engines)
        hits = [cached / prompt for engine, prompt, cached in runs[1:] if engine == home]
        assert min(hits) > 0.8, (tenant, hits)  # the system prompt came from the cache
    state = llmgw_cli(config, "state", "--json", env={"LLMGW_NATS__URL": nats_url})
    assert state.returncode == 0, state.stderr
    prefixes = {e["endpoint"]: e for e in json.loads(state.stdout)["prefixes"]}
    for tenant, runs in placed.items():
        home = Counter(engine for engine, _, _ in runs).most_common(1)[0][0]
        top = prefixes[home]["top"]
        assert any(t["placements"] >= 11 for t in top), (tenant, top)


def test_engines_kv_events_show_a_prompt_cached_by_traffic_the_gateway_never_saw(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    """Engines with KV cache events (the simulator speaks vLLM's) and the model's tokens from
    the engines' /tokenize: a tenant's prompt that reached one engine directly, around the
    gateway, is known to be cached there (the scraper republishes the engine's events), so the
    tenant's new sessions start on that engine. Placement by what was sent cannot know it."""
    config = write_cluster_config(tmp_path / "cluster.yaml")
    data = yaml.safe_load(config.read_text())
    for endpoint in data["endpoints"]:
        if endpoint["provider"] == "iris":
            endpoint["kv_events"] = {
                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
            }
    for model in data["models"]:
        model["tokenizer"] = "engine"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    engines = {e["id"]: e["url"] for e in data["endpoints"] if e["provider"] == "iris"}
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)

    async def scenario() -> dict[str, list[str]]:
        placed: dict[str, list[str]] = {}
        async with httpx.AsyncClient(timeout=60) as client:
            for tenant, engine in (("initech", "engine-1"), ("umbrella", "engine-2")):
                direct = await client.post(  # around the gateway: only the engine knows
                    f"{engines[engine]}/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [
                            {"role": "system", "content": system_prompt(tenant)},
                            {"role": "user", "content": "warm up"},
                        ],
                        "max_tokens": 1,
                    },
                )
                assert direct.status_code == 200, direct.text
            await _until_held(nats_url, config, set(engines))
            for tenant in ("initech", "umbrella"):
                runs = await sessions(api, key, tenant, 4)
                placed[tenant] = [engine for engine, _, _ in runs]
        return placed

    placed = asyncio.run(scenario())
    assert placed == {"initech": ["engine-1"] * 4, "umbrella": ["engine-2"] * 4}, placed


async def _until_held(nats_url: str, config: Path, engines: set[str]) -> None:
    """Until `llmgw state` shows blocks held (by KV cache events) on every engine."""
    output = ""

    async def held_everywhere() -> bool:
        nonlocal output
        state = await asyncio.to_thread(
            llmgw_cli, config, "state", "--json", env={"LLMGW_NATS__URL": nats_url}
        )
        output = state.stdout
        held = {
            e["endpoint"]
            for e in json.loads(state.stdout or "{}").get("prefixes", [])
            if e["held_blocks"] > 0
        }
        return held >= engines

    try:
        await eventually(held_everywhere, 30, "blocks held on every engine", interval=0.5)
    except AssertionError as failure:
        raise AssertionError(f"{failure}: {output[-2000:]}") from None
