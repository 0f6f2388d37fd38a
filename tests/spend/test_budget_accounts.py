"""Budget accounts on a real nats-server: two edges' guards reserving concurrently from grants
that two admission instances write by CAS. The checker: settled spend plus what is still
reserved never passes the limit (estimates exact here), and the account's record equals what
the edges settled; every request either reserved or was refused, none twice."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from pathlib import Path

import nats
import pytest
import yaml
from timing import SteppedClock

from llmgw.config import config_from_dict
from llmgw.core.budget import Account, account_key, period_id
from llmgw.services.admission.spend import BudgetAccounts, open_spend_bucket
from llmgw.services.edge.budgets import _IDLE_PERIODS, BudgetGuard, BudgetRefused

REPO = Path(__file__).resolve().parents[2]
BODY = {"messages": [{"role": "user", "content": "what is a cache"}], "max_tokens": 100}


def _config(  # type: ignore[no-untyped-def]
    nats_url: str, bucket: str, max_spend: str, *, interval: str = "100ms", home_output: float = 2.4
):
    """The shipped config, tenant `t` with `max_spend`; our engines priced for llama-3.3-70b
    as the third party is, but `home_output` per million output tokens (equal by default:
    every estimate is the same wherever the request may run)."""
    data = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    data["nats"] = {"url": nats_url}
    data["spend"]["bucket"] = bucket
    data["spend"]["interval"] = interval
    data["spend"]["budgets"] = [{"tenant": "t", "period": "daily", "max_spend": max_spend}]
    data["spend"]["prices"].append(
        {"provider": "iris", "model": "llama-3.3-70b", "input": 0.60, "output": home_output}
    )
    return config_from_dict(data, env={})


@pytest.fixture
async def accounts(nats_url: str):
    bucket = f"spend_{uuid.uuid4().hex[:10]}"
    config = _config(nats_url, bucket, "0.01")
    connections, services = [], []
    for _ in range(2):  # two admission instances in one queue group
        nc = await nats.connect(nats_url)
        service = BudgetAccounts(nc, await open_spend_bucket(nc, config), ttl=30.0)
        await service.start()
        connections.append(nc)
        services.append(service)
    try:
        yield config, services
    finally:
        for service in services:
            await service.stop()
        with_js = connections[0].jetstream()
        await with_js.delete_key_value(bucket)
        for nc in connections:
            await nc.close()


async def test_two_edges_never_commit_past_the_limit_and_the_account_records_what_they_spent(
    accounts,
) -> None:
    config, services = accounts
    edges = []
    for index in range(2):
        nc = await nats.connect(config.nats.url)
        guard = BudgetGuard(nc, f"edge-{index}", config)
        await guard.start()
        edges.append((nc, guard))
    rng = random.Random(7)
    model = "llama-3.3-70b"
    settled: list[int] = []
    refused = 0
    in_flight: list[int] = []
    peak = 0

    async def one(guard: BudgetGuard) -> None:
        nonlocal refused, peak
        try:
            hold = await guard.reserve("t", model, BODY)
        except BudgetRefused:
            refused += 1
            return
        assert hold is not None and hold.parts
        estimate = hold.parts[0][1]
        in_flight.append(estimate)
        peak = max(peak, sum(settled) + sum(in_flight))
        await asyncio.sleep(rng.uniform(0, 0.02))
        in_flight.remove(estimate)
        hold.settle(estimate, third_party=True)  # it cost exactly its estimate
        settled.append(estimate)

    await asyncio.gather(*(one(edges[i % 2][1]) for i in range(300)))
    limit = 10_000_000_000  # $0.01 in picos
    estimate = settled[0]
    assert peak <= limit  # settled + reserved never passed it (no estimate error here)
    assert sum(settled) <= limit
    assert refused + len(settled) == 300
    # Below the limit, at most one request's worth is left at each edge.
    assert sum(settled) > limit - 2 * estimate, (sum(settled), estimate)
    for nc, guard in edges:
        await guard.stop()  # reports its spend and returns its grant
        await nc.close()
    nc = await nats.connect(config.nats.url)
    try:
        kv = await nc.jetstream().key_value(config.spend.bucket)
        key = account_key("spend", "tenant-t", period_id("daily", time.time()))
        account = Account.from_json((await kv.get(key)).value)
    finally:
        await nc.close()
    assert account.spent == sum(settled)
    assert all(h.grant == h.spent for h in account.holders.values())  # nothing held any more
    assert sum(s.writes for s in services) >= 2  # the grants were written by CAS


async def test_an_account_forgotten_while_idle_keeps_what_the_edge_spent(accounts) -> None:
    """An edge drops an idle account from memory; using it again, it starts from what the
    account says it spent there, so the limit still holds."""
    config, _ = accounts
    nc = await nats.connect(config.nats.url)
    try:
        guard = BudgetGuard(nc, "edge-forgetful", config)
        model = "llama-3.3-70b"
        hold = await guard.reserve("t", model, BODY)
        assert hold is not None
        estimate = hold.parts[0][1]
        hold.settle(estimate, third_party=True)
        await guard._sync(final=True)  # reports it and returns the grant
        guard._accounts.clear()  # forgotten, as after _IDLE_PERIODS without use
        limit = 10_000_000_000
        admitted = 0
        with contextlib.suppress(BudgetRefused):
            while True:
                again = await guard.reserve("t", model, BODY)
                assert again is not None
                again.settle(estimate, third_party=True)
                admitted += 1
        assert (admitted + 1) * estimate <= limit < (admitted + 2) * estimate
    finally:
        await nc.close()


async def test_an_account_unused_for_its_idle_periods_on_the_guards_clock_is_forgotten(
    accounts,
) -> None:
    """Idleness is read from the guard's injected clock: an account whose grant is what it
    spent stays in memory for `_IDLE_PERIODS` sync intervals without use, and is dropped after."""
    config, _ = accounts
    nc = await nats.connect(config.nats.url)
    try:
        clock = SteppedClock()
        guard = BudgetGuard(nc, "edge-idle", config, clock=clock)
        hold = await guard.reserve("t", "llama-3.3-70b", BODY)
        assert hold is not None
        hold.settle(hold.parts[0][1], third_party=True)
        await guard._sync(final=True)  # reported; the grant is what was spent
        kept = set(guard._accounts)
        assert kept
        allowance = guard.interval * _IDLE_PERIODS
        clock.advance(0.99 * allowance)
        await guard._sync()
        assert set(guard._accounts) == kept  # idle, but not for long enough: kept
        clock.advance(0.02 * allowance)
        await guard._sync()
        assert guard._accounts == {}
    finally:
        await nc.close()


async def test_an_applied_config_prices_a_new_model_and_its_third_partys_new_endpoints(
    accounts,
) -> None:
    """The guard follows the config the edge runs on: a model with no price reserves nothing
    (its spend counts as free) instead of failing the request; once an applied config prices
    it, the next reservation is priced, and a third party's endpoint that joined the fleet is
    one a request kept off third parties excludes."""
    config, _ = accounts
    nc = await nats.connect(config.nats.url)
    try:
        guard = BudgetGuard(nc, "edge-new-model", config)
        hold = await guard.reserve("t", "mistral-7b", BODY)
        assert hold is not None and [estimate for _, estimate in hold.parts] == [0]
        hold.release()

        data = config.model_dump(mode="json")
        data["models"].append({"name": "mistral-7b"})
        data["providers"][1]["models"].append({"name": "mistral-7b"})
        data["spend"]["prices"].append(
            {"provider": "tensorx", "model": "mistral-7b", "input": 1, "output": 4}
        )
        joined = {**data["endpoints"][-1], "id": "tensorx-west-2", "models": ["mistral-7b"]}
        data["endpoints"].append(joined)
        guard.follow(config_from_dict(data, env={}))
        hold = await guard.reserve("t", "mistral-7b", BODY)
        assert hold is not None
        [(_, estimate)] = hold.parts
        assert estimate >= 100 * 4_000_000  # 100 output tokens at 4 per million, in picos
        hold.release()
        assert "tensorx-west-2" in guard.third_party_endpoints["mistral-7b"]
    finally:
        await nc.close()


async def _started(config, name: str):  # type: ignore[no-untyped-def]
    nc = await nats.connect(config.nats.url)
    guard = BudgetGuard(nc, name, config)
    await guard.start()  # answers loans from here on
    return nc, guard


async def test_a_grant_moves_to_the_edge_that_has_the_request(accounts) -> None:
    """Requests one at a time, at one edge and then alternating between two edges that report
    only once a minute, each costing a fourth of its estimate: what an edge's grant holds idle
    is lent to the other when it is short, so every request the budget can fit is served, and
    a request that fits its edge's grant sends no message at all."""
    config, _ = accounts
    slow = _config(config.nats.url, config.spend.bucket, "0.01", interval="60s")
    edges = [await _started(slow, f"edge-{index}") for index in range(2)]
    model = "llama-3.3-70b"
    try:
        served, estimate = 0, 0
        with contextlib.suppress(BudgetRefused):
            for index in itertools.count():
                edge = 0 if index < 6 else index % 2  # edge-0 holds the larger grant
                nc, guard = edges[edge]
                sent = nc.stats["out_msgs"]
                hold = await guard.reserve("t", model, BODY)
                if index == 2:  # its second ask took room for a few more: no message now
                    assert nc.stats["out_msgs"] == sent
                assert hold is not None and not hold.no_overflow
                [(_, estimate)] = hold.parts
                hold.settle(estimate // 4, third_party=True)  # it cost a fourth of its estimate
                served += 1
        limit = 10_000_000_000
        # Served while what was spent left room for one more estimate, wherever that room was.
        assert served == (limit - estimate) // (estimate // 4) + 1, (served, estimate)
    finally:
        for nc, guard in edges:
            await guard.stop()
            await nc.close()


async def test_a_request_our_engines_can_afford_runs_home_instead_of_being_refused(
    accounts,
) -> None:
    """Our engines at a tenth of the third party's output price: while the budget fits a
    third-party estimate, that is reserved; after, our engines' estimate is, and the request
    is kept off third parties; when not even that fits, it is refused. An attempt placed on
    our engines holds no more than our engines' estimate."""
    config, _ = accounts
    cheap = _config(config.nats.url, config.spend.bucket, "0.001", home_output=0.24)
    nc = await nats.connect(cheap.nats.url)
    try:
        guard = BudgetGuard(nc, "edge-home", cheap)
        model = "llama-3.3-70b"
        hold = await guard.reserve("t", model, BODY)
        assert hold is not None and not hold.no_overflow and hold.home is not None
        [(account, worst)] = hold.parts
        home = hold.home
        assert home < worst
        hold.admitted(third_party=False)  # placed on our engines: only their price is held
        assert hold.parts == [(account, home)] and account.purse.reserved == home
        hold.settle(home, third_party=False)
        kinds = []
        with contextlib.suppress(BudgetRefused):
            while True:
                hold = await guard.reserve("t", model, BODY)
                assert hold is not None
                kinds.append("home" if hold.no_overflow else "any")
                [(_, estimate)] = hold.parts
                assert estimate == (home if hold.no_overflow else worst)
                hold.settle(estimate, third_party=False)
        limit = 1_000_000_000
        assert kinds[0] == "any" and "home" in kinds
        assert kinds == sorted(kinds, key=lambda kind: kind == "home")  # then home only
        assert account.purse.spent <= limit < account.purse.spent + home
    finally:
        await nc.close()
