"""One engine starts failing: retries hide it from clients, breakers move traffic, recovery is gradual."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
from rig import BODY
from timing import eventually


async def set_faults(url: str, **faults) -> None:
    async with httpx.AsyncClient() as http:
        (await http.post(url + "/sim/faults", json=faults)).raise_for_status()


async def run(stack, n: int) -> tuple[Counter[str], Counter[int]]:
    """n requests, each of its own session (so they spread over both engines)."""
    endpoints: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    async with httpx.AsyncClient(timeout=10) as client:
        for i in range(n):
            body = {**BODY, "user": f"user-{time.monotonic_ns()}-{i}"}
            response = await client.post(
                stack.edge_url + "/v1/chat/completions",
                json=body,
                headers={"x-llmgw-band": "platinum"},
            )
            statuses[response.status_code] += 1
            endpoints[response.headers.get("x-llmgw-endpoint", "-")] += 1
    return endpoints, statuses


@pytest.mark.parametrize(
    "stack",
    [{"enabled": False, "router": {"cooldown": "1s", "failure_threshold": 3}}],
    indirect=True,
)
async def test_a_failing_engine_is_hidden_from_clients_then_avoided_then_readmitted(stack):
    await stack.report_all(running=0, capacity=8)
    service = stack.admissions[0]
    await set_faults(stack.engines["engine-1"].url, error_rate=1.0)

    endpoints, statuses = await run(stack, 30)
    assert statuses == Counter({200: 30})  # every failure was retried on another endpoint
    assert endpoints["engine-1"] == 0
    # engine-1 saw only the failures that opened its breaker, not one in every few requests.
    failed_attempts = stack.edge_metrics.retries.labels("upstream_error")._value.get()
    assert 3 <= failed_attempts <= 5, failed_attempts
    assert service.breakers.state("engine-1", time.time()).value in ("open", "half_open")

    await set_faults(stack.engines["engine-1"].url, error_rate=0.0)  # it heals
    await eventually(
        lambda: service.breakers.available("engine-1", time.time()),
        timeout=3,
        what="the cooldown to end",
    )
    endpoints, statuses = await run(stack, 40)
    assert statuses == Counter({200: 40})
    assert endpoints["engine-1"] >= 5  # back in rotation after one successful probe
