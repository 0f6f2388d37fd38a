"""200 concurrent first requests of one session, through 2 edges and 4 admission instances."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from mesh import MODEL, small_limits, start_mesh

from llmgw.core.leasekeys import PIN_PREFIX
from llmgw.state.checker import check_history
from llmgw.state.history import HistoryRecorder

pytestmark = pytest.mark.e2e


async def test_two_hundred_concurrent_first_requests_make_exactly_one_pin(
    nats_client, nats_url, unique_id
):
    bucket = f"first_{unique_id}"
    limits = small_limits(pinned=5, slots=8, reserved=2, per_session=2)
    mesh = await start_mesh(nats_url, bucket, limits=limits)
    recorder = await HistoryRecorder(nats_client.jetstream(), bucket).start()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the same opening"}],
        "max_tokens": 2,
    }
    try:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=400)) as http:
            responses = await asyncio.gather(
                *(
                    http.post(mesh.edges[i % 2].url + "/v1/chat/completions", json=body)
                    for i in range(200)
                )
            )
        for app in mesh.edge_apps:
            await app.edge.drain()
        entries = await recorder.sync(timeout=10)
    finally:
        await recorder.stop()
        await mesh.stop()
        await nats_client.jetstream().delete_key_value(bucket)

    assert [r.status_code for r in responses] == [200] * 200
    routes = Counter(r.headers["x-llmgw-route"] for r in responses)
    # One request created the pin; every other one followed it: on the pinned
    # provider while the session had slots there (2), else as a temporary
    # fallback elsewhere that left the pin as it was.
    assert routes["new_pin"] == 1, routes
    assert (
        routes["pinned"] >= 1 and routes["new_pin"] + routes["pinned"] + routes["temporary"] == 200
    )
    by_route = {(r.headers["x-llmgw-route"], r.headers["x-llmgw-provider"]) for r in responses}
    assert {p for route, p in by_route if route in ("new_pin", "pinned")} == {"a"}
    assert "a" not in {p for route, p in by_route if route == "temporary"}
    pin_writes = [e for e in entries if e.key.startswith(PIN_PREFIX) and not e.deleted]
    assert len({json.loads(e.value)["pin_id"] for e in pin_writes}) == 1
    assert {json.loads(e.value)["provider"] for e in pin_writes} == {"a"}
    assert check_history(entries, mesh.limits, mesh.config.pinning.lease_timeout) == []
