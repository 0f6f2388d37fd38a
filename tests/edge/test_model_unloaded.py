"""A managed engine that answers 404 `model_not_found` for a model the fleet lists there (a LoRA
adapter unloaded before the reaper read its model list again): the request is retried where the
model is served, the attempt ends `model_unloaded` (no breaker counts it, it is no endpoint
failure), and the edge asks the reapers to read that engine's list again, once for a burst.
Real nats-server, admission, edge and simulated engines."""

from __future__ import annotations

import time

import httpx
import nats
import pytest_asyncio
from inproc import before_any_lease, start_admission, start_edge, stop_servers
from openai import AsyncOpenAI
from timing import eventually

from llmgw.config.fleet import fleet_bucket
from llmgw.core.breaker import BreakerState
from llmgw.services.edge.reporting import STALE_EVERY
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.wire import MODELS_STALE_SUBJECT, REQUEST_STATS_SUBJECT, ModelsStale, RequestEnded

REQUESTS = 5  # sequential, each a new session: more than router.failure_threshold (3)


@pytest_asyncio.fixture
async def unloaded(nats_url, unique_id, make_gateway_config):
    """`gateway_config`, where engine-1 (iris's preferred endpoint: priority 200) no longer
    serves m2: the fleet lists m2 there, the engine answers 404 `model_not_found` for it."""
    engines = {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        served = ["m1"] if name == "engine-1" else ["m1", "m2"]
        params = EngineParams.zero_delay().model_copy(update={"seed": seed})
        engines[name] = await start_server(create_engine_app(params, served))
    config = make_gateway_config(
        nats_url, {k: v.url for k, v in engines.items()}, f"routing_{unique_id}"
    )
    with before_any_lease(config):
        admission = await start_admission(config, nats_url, instance="adm-u", follow_load=False)
    edge = await start_edge(config, nats_url, edge_id="edge-u")
    try:
        yield config, edge, admission.service
    finally:
        await edge.stop()
        await admission.stop()
        nc = await nats.connect(nats_url)
        await nc.jetstream().delete_key_value(config.pinning.bucket)
        await nc.close()
        await stop_servers(engines.values())


async def test_a_model_the_engine_no_longer_serves_is_retried_where_it_is_served(unloaded):
    config, edge, admission = unloaded
    # The edge's own connection: what it publishes after these subscriptions reaches them, in
    # order (another connection's subscription may reach the server after a publish).
    nc = edge.nc
    seen: list[RequestEnded] = []
    notices: list[ModelsStale] = []

    async def on_stats(msg) -> None:
        seen.append(RequestEnded.model_validate_json(msg.data))

    async def on_notice(msg) -> None:
        notices.append(ModelsStale.model_validate_json(msg.data))

    subs = [
        await nc.subscribe(REQUEST_STATS_SUBJECT, cb=on_stats),
        await nc.subscribe(MODELS_STALE_SUBJECT, cb=on_notice),
    ]
    await nc.flush()
    client = AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0)
    served = []
    try:
        started = time.monotonic()
        for n in range(REQUESTS):
            raw = await client.chat.completions.with_raw_response.create(
                model="m2", max_tokens=2, messages=[{"role": "user", "content": f"question {n}"}]
            )
            served.append(raw.headers["x-llmgw-endpoint"])
            assert raw.parse().choices[0].message.content
        elapsed = time.monotonic() - started
        # Every attempt's end (the notices go out in the same flushes, after them).
        await eventually(lambda: len(seen) == 2 * REQUESTS)
        await nc.flush()
    finally:
        for sub in subs:
            await sub.unsubscribe()
    assert served == ["engine-2"] * REQUESTS
    first = [s for s in seen if s.endpoint == "engine-1"]
    assert [(s.outcome, s.status, s.ok) for s in first] == [("model_unloaded", 404, False)] * (
        REQUESTS
    )
    retried = edge.deps.metrics.registry.get_sample_value(
        "llmgw_edge_retries_total", {"outcome": "model_unloaded"}
    )
    assert retried == REQUESTS
    # Five 404s in a row: as endpoint failures they would have opened its breaker at three.
    assert admission.breakers.state("engine-1", time.time()) is BreakerState.CLOSED
    assert admission.breakers.open_endpoints(time.time()) == []
    # One notice for the burst (one more per STALE_EVERY seconds it lasted at most).
    assert 1 <= len(notices) <= 1 + int(elapsed / STALE_EVERY), (len(notices), elapsed)
    assert {(n.endpoint, n.model, n.scope, n.edge) for n in notices} == {
        ("engine-1", "m2", fleet_bucket(config), "edge-u")
    }
    # What engine-1 still serves is still sent there.
    raw = await client.chat.completions.with_raw_response.create(
        model="m1", max_tokens=2, messages=[{"role": "user", "content": "still here?"}]
    )
    assert raw.headers["x-llmgw-endpoint"] == "engine-1"


async def test_with_no_other_endpoint_for_the_model_the_client_gets_the_engines_404(unloaded):
    """engine-2 has left the fleet's choice (its breaker open): the retry finds nowhere else
    to go, and the client gets engine-1's own answer, as before the retry existed."""
    _, edge, admission = unloaded
    now = time.time()
    for _ in range(3):
        admission.breakers.record("engine-2", False, now)
    async with httpx.AsyncClient() as http:
        response = await http.post(
            edge.url + "/v1/chat/completions",
            json={"model": "m2", "max_tokens": 2, "messages": [{"role": "user", "content": "?"}]},
        )
    assert response.status_code == 404, response.text
    assert response.headers["x-llmgw-endpoint"] == "engine-1"
    assert response.json()["error"]["code"] == "model_not_found"
    assert admission.breakers.state("engine-1", time.time()) is BreakerState.CLOSED
