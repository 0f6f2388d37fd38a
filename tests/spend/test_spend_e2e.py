"""Spend end to end, under `llmgw up` with the shipped config: what `llmgw spend` reports is what
the third party's own count of tokens costs at the configured prices, to the cent, with retries
(the third party answers some requests 500 or 429, some streams break before their first token)
and streams cut short (by the client, or by the third party after a few tokens)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from decimal import Decimal
from typing import Any

import httpx
import pytest
from spend_cluster import SpendCluster, start_cluster
from timing import eventually

pytestmark = pytest.mark.e2e

MODEL = "llama-3.3-70b"
# GPT-4's launch prices: large enough that a token more or less than the third party counted
# shows in the cents of a few hundred requests ($0.00006 an output token).
PRICES = [
    {"provider": "tensorx", "model": MODEL, "input": 30, "cached_input": 15, "output": 60},
    {"provider": "tensorx", "model": "qwen2.5-32b", "input": 10, "cached_input": 5, "output": 20},
]
REQUESTS = 90
CONCURRENCY = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = start_cluster(tmp_path_factory.mktemp("spend"), {"prices": PRICES})
    try:
        yield cluster
    finally:
        cluster.stop()


async def _one(
    client: httpx.AsyncClient, api: str, key: str, index: int, kind: str
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "llama",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": f"Request {index}: say something about caches."},
        ],
        "max_tokens": 24,
        "stream": kind != "whole",
    }
    headers = {"authorization": f"Bearer {key}"}
    if kind == "whole":
        response = await client.post(f"{api}/chat/completions", json=body, headers=headers)
        return {
            "status": response.status_code,
            "provider": response.headers.get("x-llmgw-provider"),
        }
    async with client.stream(
        "POST", f"{api}/chat/completions", json=body, headers=headers
    ) as response:
        events = 0
        async for chunk in response.aiter_bytes():
            events += chunk.count(b"data: ")
            if kind == "cut" and events >= 4:
                break  # the client hangs up mid-stream
        return {
            "status": response.status_code,
            "provider": response.headers.get("x-llmgw-provider"),
            "events": events,
        }


async def _traffic(api: str, key: str) -> list[dict[str, Any]]:
    kinds = ("whole", "stream", "cut")
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=60) as client:

        async def run(index: int) -> dict[str, Any]:
            async with gate:
                return await _one(client, api, key, index, kinds[index % 3])

        return await asyncio.gather(*(run(i) for i in range(REQUESTS)))


def _wait_for_third_party(cluster: SpendCluster, key: str) -> None:
    """Until the engines are reported unhealthy and requests go to the third party."""

    def third_party() -> bool:
        response = cluster.chat(key, messages=[{"role": "user", "content": "ping"}], max_tokens=1)
        return response.headers.get("x-llmgw-provider") == "tensorx"

    asyncio.run(eventually(third_party, 60, "requests going to the third party", interval=0.5))


def test_spend_equals_the_third_partys_own_count_to_the_cent_under_retries_and_cut_streams(
    cluster: SpendCluster,
) -> None:
    key = cluster.key_for("team-cost")
    for engine in cluster.engines():  # our engines down: every request goes to the third party
        cluster.set_faults(engine, unhealthy=True)
    _wait_for_third_party(cluster, key)
    east, west = cluster.third_parties()
    # Fault rates that retries cover without tripping the breakers (three failures in a row take
    # an endpoint out for router.cooldown: with both out, requests get 503 and too few run).
    cluster.set_faults(east, error_rate=0.08, rate_limit_rate=0.05, die_at_token=0, die_rate=0.05)
    cluster.set_faults(west, die_at_token=5, die_rate=0.1)
    before = cluster.third_party_bill().get(MODEL, {})
    assert not before, "llama reached the third party before the measured traffic"

    results = asyncio.run(_traffic(cluster.apis[0], key))
    for endpoint in cluster.third_parties():
        cluster.set_faults(endpoint, reset=True)

    elsewhere = [r for r in results if r["status"] == 200 and r["provider"] != "tensorx"]
    assert not elsewhere, elsewhere
    statuses = sorted(str(r["status"]) for r in results)
    # Most succeed (retries cover the faults); what is measured is the spend of those that ran,
    # so a loaded machine's few timeouts do not matter beyond this floor.
    assert statuses.count("200") >= REQUESTS * 0.4, sorted(Counter(statuses).items())
    bill = cluster.third_party_bill()[MODEL]
    assert bill["requests"] >= REQUESTS * 0.4, bill
    truth = cluster.third_party_cost([MODEL])
    # The edges publish their totals every spend.interval (1 s); admission writes them down.
    report: dict[str, Any] = {}

    def written_down() -> dict[str, Any] | None:
        nonlocal report
        report = cluster.cli("spend", "--period", "total", "--by", "provider,model")
        rows = [r for p in report["periods"] for r in p["rows"] if r["model"] == MODEL]
        return rows[0] if rows and rows[0]["requests"] >= bill["requests"] else None

    try:
        reported = asyncio.run(eventually(written_down, 60, interval=0.5))
    except AssertionError as failure:
        raise AssertionError(f"{failure}: {report}") from None
    print(f"third party's bill: {bill}, cost {truth}; llmgw spend: {reported}")
    spent = Decimal(reported["picos"]) / 10**12
    # Each attempt that delivered output is counted once: retries (500, 429, a stream dead
    # before its first token) deliver none and cost nothing, at the third party and here.
    assert reported["requests"] == bill["requests"]
    assert abs(spent - truth) < Decimal("0.005"), (spent, truth)
    assert truth > Decimal("0.05")  # the traffic was worth counting in cents

    # The key's spend today (every model it used) in `llmgw keys usage`, as `llmgw spend` says.
    by_key = cluster.cli("spend", "--period", "total", "--by", "key,tenant")
    (mine,) = [r for p in by_key["periods"] for r in p["rows"] if r["tenant"] == "team-cost"]
    usage = cluster.cli("keys", "usage")
    (row,) = [r for r in usage["keys"] if r["tenant"] == "team-cost"]
    assert row["spend_today"] == mine["cost"] and mine["picos"] >= reported["picos"]
    metrics = httpx.get(f"http://{cluster.config['admin_listen']}/metrics", timeout=10).text
    counted = sum(
        Decimal(m.group(1))
        for m in re.finditer(
            r'^llmgw_spend_cost_total\{model="llama-3.3-70b",provider="tensorx",tenant="team-cost"\} (\S+)$',
            metrics,
            re.MULTILINE,
        )
    )
    assert abs(counted - spent) < Decimal("0.000001")
