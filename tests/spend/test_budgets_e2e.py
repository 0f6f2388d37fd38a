"""Budgets end to end: two edges (each running an admission instance) under `llmgw up` with the
shipped config, a tenant with an overflow budget and one without, traffic that overflows our two
engines. The third party's own count of what the tenant cost ends within one request's estimate
of the budget; after that, the tenant's overflow waits for our engines while the other tenant's
still goes to the third party. A tenant whose max_spend cannot fit a request even at our
engines' price gets 429 insufficient_quota, before admission (no lease, no spend), and so does a
key whose own max_spend cannot."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import httpx
import pytest
from spend_cluster import SpendCluster, start_cluster

pytestmark = pytest.mark.e2e

BUDGETED, FREE = "llama-3.3-70b", "qwen2.5-32b"  # one model per tenant: the bill tells them apart
PRICES = [
    {"provider": "tensorx", "model": BUDGETED, "input": 30, "cached_input": 15, "output": 60},
    {"provider": "tensorx", "model": FREE, "input": 30, "cached_input": 15, "output": 60},
    # our engines cost something for BUDGETED only: a max_spend too small for that refuses it
    {"provider": "iris", "model": BUDGETED, "input": 3, "cached_input": 3, "output": 6},
]
BUDGET = Decimal("0.1")
MAX_TOKENS = 160
SECONDS = 12.0
AFTER_BUDGET = 40  # requests of the budgeted tenant started after its last overflow ended
OTHERS_AFTER = 10  # the other tenant's requests sent to the third party in that time


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    budgets = [
        {"tenant": "team-a", "period": "daily", "max_overflow_spend": str(BUDGET)},
        {"tenant": "team-broke", "period": "monthly", "max_spend": "0.0001"},
    ]
    cluster = start_cluster(
        tmp_path_factory.mktemp("budgets"),
        {"prices": PRICES, "budgets": budgets, "cost_header": True},
    )
    try:
        cluster.add_edge()
        yield cluster
    finally:
        cluster.stop()


async def _worker(
    client: httpx.AsyncClient,
    api: str,
    key: str,
    model: str,
    done: Callable[[], bool],
    seen: list[dict[str, Any]],
    counter: itertools.count,
) -> None:
    while not done():
        index = next(counter)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Question {index}: what is a cache?"}],
            "max_tokens": MAX_TOKENS,
        }
        started = time.monotonic()
        response = await client.post(
            f"{api}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        seen.append(
            {
                "status": response.status_code,
                "provider": response.headers.get("x-llmgw-provider"),
                "started": started,
                "ended": time.monotonic(),
            }
        )


async def _traffic(cluster: SpendCluster, keys: dict[str, str]) -> dict[str, list[dict]]:
    seen: dict[str, list[dict]] = {"team-a": [], "team-b": []}
    until = time.monotonic() + SECONDS
    cap = until + 2 * SECONDS

    def done() -> bool:
        """SECONDS have passed and, since the budgeted tenant's last overflow ended, it has sent
        enough requests and the other tenant has sent enough to the third party (a loaded host
        runs the overflow more slowly: the budget runs out later in the window, and fewer
        requests follow in a fixed time), or a hard cap has passed."""
        now = time.monotonic()
        if now >= cap:
            return True
        if now < until:
            return False
        a = seen["team-a"]
        overflows = [r["ended"] for r in a if r["provider"] == "tensorx"]
        last = max(overflows, default=0.0)
        others = sum(r["started"] > last and r["provider"] == "tensorx" for r in seen["team-b"])
        return sum(r["started"] > last for r in a) >= AFTER_BUDGET and others >= OTHERS_AFTER

    counter = itertools.count()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        workers = []
        for index in range(48):  # team-a: more than our engines hold, on both edges
            api = cluster.apis[index % 2]
            workers.append(
                _worker(client, api, keys["team-a"], BUDGETED, done, seen["team-a"], counter)
            )
        for index in range(24):
            api = cluster.apis[index % 2]
            workers.append(
                _worker(client, api, keys["team-b"], FREE, done, seen["team-b"], counter)
            )
        await asyncio.gather(*workers)
    return seen


def test_an_overflow_budget_holds_across_two_edges_and_then_overflow_waits_for_our_engines(
    cluster: SpendCluster,
) -> None:
    keys = {tenant: cluster.key_for(tenant) for tenant in ("team-a", "team-b")}
    seen = asyncio.run(_traffic(cluster, keys))
    a, b = seen["team-a"], seen["team-b"]
    assert all(r["status"] == 200 for r in a + b), [r for r in a + b if r["status"] != 200][:5]
    # The tenant's third-party spend, as the third party counted it.
    spent = cluster.third_party_cost([BUDGETED])
    one = (Decimal(40) * 30 + Decimal(MAX_TOKENS) * 60) / 1_000_000  # one request's cost
    print(
        f"team-a on the third party: {spent} of {BUDGET} (a request: {one}); "
        f"{sum(r['provider'] == 'tensorx' for r in a)} of {len(a)} requests; team-b: "
        f"{sum(r['provider'] == 'tensorx' for r in b)} of {len(b)}"
    )
    assert spent <= BUDGET + one, spent
    assert spent >= BUDGET - 2 * one, spent  # at most a request's worth left at each edge
    # After the budget was used up, team-a ran on our engines only, and team-b still
    # overflowed to the third party.
    last_overflow = max(r["ended"] for r in a if r["provider"] == "tensorx")
    later_a = [r for r in a if r["started"] > last_overflow]
    later_b = [r for r in b if r["started"] > last_overflow]
    assert len(later_a) >= 30 and {r["provider"] for r in later_a} == {"iris"}
    assert sum(r["provider"] == "tensorx" for r in later_b) >= OTHERS_AFTER, later_b[:5]
    # Some of team-a's later requests waited for our engines (queued in flow control).
    waits = sorted(r["ended"] - r["started"] for r in later_a)
    assert waits[len(waits) // 2] > 0.5, waits[-5:]


def test_a_spend_budget_used_up_is_a_429_insufficient_quota_that_costs_nothing(
    cluster: SpendCluster,
) -> None:
    key = cluster.key_for("team-broke")
    for edge in range(len(cluster.apis)):
        response = cluster.chat(key, edge=edge, model=BUDGETED, max_tokens=64)
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
        assert "team-broke" in error["message"] and "max_spend" in error["message"]
        assert "x-llmgw-provider" not in response.headers  # never admitted: no lease taken
    # A key's own budget (`llmgw keys create --max-spend ... --budget-period ...`), for a tenant
    # without one: the same answer, naming the key.
    made = cluster.cli(
        "keys", "create", "--tenant", "team-c", "--max-spend", "0.0001", "--budget-period", "daily"
    )
    response = cluster.chat(made["secret"], edge=1, model=BUDGETED, max_tokens=64)
    assert response.status_code == 429, response.text
    assert f"API key {made['id']}" in response.json()["error"]["message"]
    time.sleep(2.5)  # two spend intervals: anything counted would be written down by now
    report = cluster.cli("spend", "--period", "total", "--by", "tenant")
    rows = [r for p in report["periods"] for r in p["rows"]]
    assert not [r for r in rows if r["tenant"] in ("team-broke", "team-c")]


def test_a_response_tells_its_client_what_it_cost(cluster: SpendCluster) -> None:
    """spend.cost_header: x-llmgw-cost is the response's usage at its provider's prices."""
    key = cluster.key_for("team-header")
    prices = {p["model"]: p for p in PRICES}
    seen = set()
    for index in range(12):
        response = cluster.chat(key, edge=index % 2, max_tokens=9)
        assert response.status_code == 200, response.text
        amount, currency = response.headers["x-llmgw-cost"].split()
        usage = response.json()["usage"]
        provider = response.headers["x-llmgw-provider"]
        expected = Decimal(0)
        if provider == "tensorx":
            price = prices[FREE]
            expected = (
                Decimal(price["input"]) * usage["prompt_tokens"]
                + Decimal(price["output"]) * usage["completion_tokens"]
            ) / 1_000_000
        assert (Decimal(amount), currency) == (expected.quantize(Decimal("0.000001")), "USD")
        seen.add(provider)
    assert "iris" in seen  # our engines: no price, no cost
    # A stream that asked for its usage finds the cost in it (its headers left before).
    for index in range(6):
        with httpx.stream(
            "POST",
            f"{cluster.apis[index % 2]}/chat/completions",
            json={
                "model": "qwen",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 9,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        ) as response:
            provider = response.headers["x-llmgw-provider"]
            text = "".join(response.iter_text())
        (chunk,) = [
            json.loads(line[len("data: ") :])
            for line in text.splitlines()
            if line.startswith("data: {") and '"usage"' in line
        ]
        usage = chunk["usage"]
        price = prices[FREE] if provider == "tensorx" else {"input": 0, "output": 0}
        expected = (
            Decimal(price["input"]) * usage["prompt_tokens"]
            + Decimal(price["output"]) * usage["completion_tokens"]
        ) / 1_000_000
        assert Decimal(usage["cost"]) == expected.quantize(Decimal("0.000001"))
        assert usage["cost_currency"] == "USD"
