"""A spend budget split across two edges, measured at engines that count their own tokens.

Under `llmgw up` with the shipped config and a second edge (each with its admission instance),
our engines priced at a tenth of the third party's. A key's `max_spend` fits about 30 of its
requests on our engines; a request's reservation is priced at the third party (about ten times
what it costs here) while the budget can fit that, and at our engines' price after. Sent one
at a time, alternating between the edges, the key is served until the money is spent: grants
move to the edge that has the request (loans), and a request the third-party estimate no
longer fits runs on our engines only (`no_overflow`) instead of a 429.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from decimal import Decimal
from typing import Any

import httpx
import pytest
from spend_cluster import SpendCluster, start_cluster

pytestmark = pytest.mark.e2e

MODEL = "qwen2.5-32b"  # no fallbacks: it is served as itself or not at all
PRICES = [  # per million tokens: the third party costs ten times what our engines do
    {"provider": "iris", "model": MODEL, "input": 2, "cached_input": 2, "output": 50},
    {"provider": "tensorx", "model": MODEL, "input": 20, "cached_input": 10, "output": 500},
]
MAX_TOKENS = 20  # each request of the split test writes all of them: each costs the same
AFFORDABLE = 30  # the split test's budget: this many of its requests' real cost


def _small_engine_pool(data: dict[str, Any]) -> None:
    """Our engines take two requests of MODEL at once: a third is overflow (or waits)."""
    (iris,) = [p for p in data["providers"] if p["id"] == "iris"]
    (pair,) = [m for m in iris["models"] if m["name"] == MODEL]
    pair["limits"] = {
        "max_pinned_sessions": 200,
        "max_global_in_flight_request_slots": 2,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
        "max_per_session_in_flight_request_slots": 2,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = start_cluster(
        tmp_path_factory.mktemp("budget-split"), {"prices": PRICES}, edit=_small_engine_pool
    )
    try:
        cluster.add_edge()
        yield cluster
    finally:
        cluster.stop()


def _cost(usage: dict[str, int], provider: str) -> Decimal:
    price = {p["provider"]: p for p in PRICES}[provider]
    return (
        Decimal(price["input"]) * usage["prompt_tokens"]
        + Decimal(price["output"]) * usage["completion_tokens"]
    ) / 1_000_000


def _engine_cost(cluster: SpendCluster) -> Decimal:
    """What our engines counted they served of MODEL, at their price (cached = input here)."""
    row = cluster.bill(cluster.engines()).get(MODEL)
    if row is None:
        return Decimal(0)
    return _cost(row, "iris")


def _budget_key(cluster: SpendCluster, tenant: str, max_spend: Decimal) -> str:
    made = cluster.cli(
        "keys",
        "create",
        "--tenant",
        tenant,
        "--max-spend",
        str(max_spend),
        "--budget-period",
        "daily",
    )
    return str(made["secret"])


def _one_request_cost(cluster: SpendCluster) -> Decimal:
    """What the split test's request costs on our engines (a key without a budget asks)."""
    probe = cluster.key_for("probe")
    response = cluster.chat(probe, model=MODEL, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert response.headers["x-llmgw-provider"] == "iris"
    return _cost(response.json()["usage"], "iris")


def test_a_budget_split_across_two_edges_serves_what_it_can_afford(cluster: SpendCluster) -> None:
    one = _one_request_cost(cluster)
    budget = one * AFFORDABLE
    key = _budget_key(cluster, "team-split", budget)
    before = _engine_cost(cluster)
    statuses, providers = [], []
    for index in range(AFFORDABLE + 10):
        response = cluster.chat(
            key, edge=index % 2, model=MODEL, max_tokens=MAX_TOKENS, ignore_eos=True
        )
        statuses.append(response.status_code)
        if response.status_code == 200:
            providers.append(response.headers["x-llmgw-provider"])
        else:
            assert response.status_code == 429, response.text
            assert response.json()["error"]["code"] == "insufficient_quota"
    served = statuses.count(200)
    spent = _engine_cost(cluster) - before
    print(f"served {served} of {len(statuses)}; engines counted {spent} of {budget} (one: {one})")
    assert statuses == [200] * served + [429] * (len(statuses) - served)  # served until spent
    assert served >= AFFORDABLE - 2, statuses
    assert set(providers) == {"iris"}
    assert spent <= budget + one, (spent, budget)


async def _free_traffic(
    cluster: SpendCluster, key: str, until: asyncio.Event, overflowed: asyncio.Event
) -> list[str]:
    """Requests of a key without a budget, four at a time on both edges, until `until`: more
    than our engines take, so some overflow to the third party (`overflowed` is set then)."""
    seen: list[str] = []
    counter = itertools.count()

    async def worker(client: httpx.AsyncClient, api: str) -> None:
        while not until.is_set():
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Question {next(counter)}"}],
                "max_tokens": 60,
            }
            response = await client.post(
                f"{api}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text
            seen.append(response.headers["x-llmgw-provider"])
            if seen[-1] == "tensorx":
                overflowed.set()

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(worker(client, cluster.apis[i % 2]) for i in range(4)))
    return seen


async def _home_run(cluster: SpendCluster, free: str, key: str) -> tuple[list[Any], list[str]]:
    until, overflowed = asyncio.Event(), asyncio.Event()
    traffic = asyncio.create_task(_free_traffic(cluster, free, until, overflowed))
    answers: list[Any] = []
    try:
        await asyncio.wait_for(overflowed.wait(), 60)  # our engines are full: overflow happens
        async with httpx.AsyncClient(timeout=60) as client:
            for index in range(3):
                started = time.monotonic()
                response = await client.post(
                    f"{cluster.apis[index % 2]}/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": MAX_TOKENS,
                    },
                    headers={"authorization": f"Bearer {key}"},
                )
                answers.append((response, time.monotonic() - started))
    finally:
        until.set()
        seen = await traffic
    return answers, seen


def test_a_request_the_third_party_estimate_does_not_fit_runs_home_instead_of_a_429(
    cluster: SpendCluster,
) -> None:
    """A key whose budget fits two requests at our engines' price, and none at the third
    party's: while our engines are full and other traffic overflows, its requests wait for our
    engines and are served there; the third, which not even our price fits, is a 429."""
    one = _one_request_cost(cluster)
    key = _budget_key(cluster, "team-home", one * Decimal("2.5"))
    free = cluster.key_for("team-free")
    answers, seen = asyncio.run(_home_run(cluster, free, key))
    print(f"home: {[(r.status_code, round(s, 2)) for r, s in answers]}; free: {seen}")
    first, second, third = (response for response, _ in answers)
    for response in (first, second):
        assert response.status_code == 200, response.text
        assert response.headers["x-llmgw-provider"] == "iris"
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "insufficient_quota"
    assert "tensorx" in seen  # the overflow was there to take; the key's requests kept off it
