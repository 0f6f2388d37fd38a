"""Short requests through `llmgw up` with the shipped defaults, on engines whose capacity nobody
configured (as users write their endpoints): flow control never queues them or sends them to
the third party while the engines report nothing waiting, however far the gateway's count of
its requests goes past what the scrapes saw running (requests that start and end between two
scrapes never show in the engines' running count)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_up_operability import READY
from timing import eventually
from up_harness import UpProcess, write_cluster_config

pytestmark = pytest.mark.e2e

MODEL = "llama-3.3-70b"
ENGINES = ("engine-1", "engine-2")
CONCURRENCY = 48  # far past the capacity the gateway starts from (scoring.target_inflight: 8)
REQUESTS = 960


def engines_without_capacity(path: Path) -> tuple[Path, dict[str, str]]:
    """config/local.yaml on free ports, its engines run outside `llmgw up` (no `simulate`
    block, no `capacity`: nothing configured about their batch). Returns the config and the
    engines' URLs."""
    config = write_cluster_config(path)
    data = yaml.safe_load(config.read_text())
    urls = {}
    for endpoint in data["endpoints"]:
        if endpoint["id"] in ENGINES:
            endpoint.pop("simulate")
            assert "capacity" not in endpoint
            urls[endpoint["id"]] = endpoint["url"]
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config, urls


def start_engine(url: str) -> subprocess.Popen[bytes]:
    """A zero-delay vLLM-like engine (it states no capacity) of 64 slots at `url`."""
    port = urlsplit(url).port
    settings = ["prefill_base=0", "prefill_per_token=0", "itl_base=0", "itl_per_running_seq=0"]
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "sim", "engine", "--port", str(port)]
        + ["--model", MODEL, "--model", "qwen2.5-32b", "--set", "max_num_seqs=64"]
        + [f"--set={s}" for s in settings],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def admission_metrics(admin: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The edge's admission metrics (admission runs in the edge: admission.colocated)."""
    text = httpx.get(f"{admin}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("llmgw_admission_")
        for s in family.samples
    }


def by_name(metrics: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (n, labels), value in metrics.items() if n == name}


async def short_requests(api: str, key: str) -> list[int]:
    """`REQUESTS` one-token completions, `CONCURRENCY` at a time, each client its own session
    (one request of it in flight at a time: the per-session limit never binds)."""
    statuses: list[int] = []
    body = {"model": MODEL, "prompt": "classify: ok", "max_tokens": 1}
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        todo = iter(range(REQUESTS))

        async def worker(user: int) -> None:
            headers = {"authorization": f"Bearer {key}", "x-session-id": f"user-{user}"}
            for _ in todo:
                response = await client.post(f"{api}/completions", json=body, headers=headers)
                statuses.append(response.status_code)

        await asyncio.gather(*(worker(user) for user in range(CONCURRENCY)))
    return statuses


def test_short_requests_past_the_scraped_running_count_never_wait_or_overflow(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config, urls = engines_without_capacity(tmp_path / "cluster.yaml")
    admin = "http://" + yaml.safe_load(config.read_text())["admin_listen"]
    engines = [start_engine(url) for url in urls.values()]
    try:
        up = start_up(config)
        api, key = up.wait_for(READY, timeout=90).groups()
        ages: dict[tuple[tuple[str, str], ...], float] = {}

        def scraped() -> bool:  # admission holds a scrape of both engines (not stale)
            nonlocal ages
            ages = by_name(admission_metrics(admin), "llmgw_admission_scrape_age_seconds")
            return set(ENGINES) <= {dict(k)["endpoint"] for k, v in ages.items() if v < 5}

        try:
            asyncio.run(eventually(scraped, 30, interval=0.2))
        except AssertionError as failure:
            raise AssertionError(f"{failure}: no scrape of the engines: {ages}") from None

        statuses = asyncio.run(short_requests(api, key))
        assert statuses == [200] * REQUESTS

        metrics = admission_metrics(admin)
        decisions = {
            dict(labels)["decision"]: value
            for labels, value in by_name(metrics, "llmgw_admission_flow_decisions_total").items()
            if value
        }
        # Every request granted at its arrival: none queued for a tick, none sent away.
        assert decisions == {"granted": REQUESTS}, decisions
        waited = by_name(metrics, "llmgw_admission_queue_wait_seconds_count")
        assert sum(waited.values()) == 0, waited
        placed = by_name(metrics, "llmgw_admission_placements_total")
        assert {dict(k)["provider"] for k, v in placed.items() if v} == {"iris"}, placed
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.wait(10)
