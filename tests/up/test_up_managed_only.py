"""A fleet of our own engines only (no third party), through `llmgw up` with the shipped
defaults: new sessions beyond the unreserved share wait in their band's queue for a lease to
end, bounded by `admission.queue_ttl`, instead of a 503 `no_capacity` while engines have free
slots. The default band (gold) overflows, but with nowhere to overflow to it waits like a
batch band."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from test_up_operability import NATS, READY
from up_harness import REPO, UpProcess, write_cluster_config

from llmgw.serving import free_port

sys.path.insert(0, str(REPO / "benchmarks"))
from placement import start_admission, stop_process, until_serving

pytestmark = pytest.mark.e2e

SLOTS = 4  # per engine (max_num_seqs), two engines
G, R = 8, 4  # the pair's limits: the engines' slots, half of them kept for pinned sessions
MODEL = "llama-3.3-70b"


def managed_only(path: Path) -> Path:
    """config/local.yaml without its third party, on engines of 4 slots with G = 8, R = 4."""
    config = write_cluster_config(path)
    data = yaml.safe_load(config.read_text())
    data["providers"] = [p for p in data["providers"] if p["kind"] == "managed"]
    data["endpoints"] = [e for e in data["endpoints"] if e["provider"] == "iris"]
    data.pop("spend", None)  # its prices are the third party's
    for model in data["models"]:
        model.pop("fallbacks", None)
    for model in data["providers"][0]["models"]:
        model["limits"] = {
            "max_pinned_sessions": 200,
            "max_global_in_flight_request_slots": G,
            "global_in_flight_request_slots_reserved_for_pinned_sessions": R,
            "max_per_session_in_flight_request_slots": SLOTS,
        }
    for endpoint in data["endpoints"]:
        endpoint["simulate"].update(max_num_seqs=SLOTS, output_len_mean=24, output_len_max=24)
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config


@pytest.mark.parametrize("instances", [1, 3])
def test_new_sessions_past_the_unreserved_share_wait_for_our_engines_not_503(
    tmp_path: Path, start_up: Callable[..., UpProcess], instances: int
) -> None:
    """`instances` admission instances: the edge's, and more `llmgw admission` processes
    that split each limit with it."""
    config = managed_only(tmp_path / "managed.yaml")
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    joined = tmp_path / "admission.yaml"
    data = yaml.safe_load(config.read_text())
    data["nats"] = {"url": nats_url}
    joined.write_text(yaml.safe_dump(data, sort_keys=False))
    extra = [start_admission(joined, f"127.0.0.1:{free_port()}") for _ in range(instances - 1)]
    try:
        asyncio.run(until_serving(nats_url, instances))
        results = asyncio.run(_burst(api, key))
    finally:
        for process in extra:
            stop_process(process)
    refused = [r for r in results if r[0] != 200]
    assert not refused, refused[:5]
    assert {r[2] for r in results} == {"iris"}
    waits = sorted(r[1] for r in results)
    assert waits[-1] < QUEUE_TTL
    # They did not all fit at once: the later ones waited for earlier leases to end.
    assert waits[-1] > 2 * waits[0], waits


QUEUE_TTL = 30.0  # the shipped admission.queue_ttl


async def _burst(api: str, key: str) -> list[tuple[int, float, str, str]]:
    """4x the unreserved share of new sessions, one request each, all at once: each one's
    status, seconds, provider and the start of its body."""
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=60) as client:

        async def one(i: int) -> tuple[int, float, str, str]:
            started = time.monotonic()
            reply = await client.post(
                "/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"new conversation {i}"}],
                    "max_tokens": 24,
                },
                headers={"x-session-id": f"burst-{i}"},
            )
            return (
                reply.status_code,
                time.monotonic() - started,
                reply.headers.get("x-llmgw-provider", ""),
                reply.text[:300],
            )

        await one(-1)  # connections warm, one session served
        return await asyncio.gather(*(one(i) for i in range(4 * (G - R))))
