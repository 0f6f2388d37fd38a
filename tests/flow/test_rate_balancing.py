"""Admission picks third-party deployments with the rate balancer, learning from edges' stats."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import nats
import pytest
from inproc import start_admission
from timing import eventually

from llmgw.config import config_from_dict
from llmgw.wire import (
    REQUEST_STATS_SUBJECT,
    AdmitReply,
    AdmitRequest,
    RequestEnded,
    admission_subject,
)

DEPLOYMENTS = ("east", "west", "north")


@pytest.fixture
async def admission(nats_url, unique_id):
    config = config_from_dict(
        {
            "nats": {"url": nats_url},
            "pinning": {"bucket": f"routing_{unique_id}"},
            "router": {"load_bucket": f"load_{unique_id}"},
            "admission": {"enabled": False},
            "balancer": {"window": "60s", "greediness": 0.5},
            "models": [{"name": "m1"}],
            "providers": [{"id": "tensorx", "kind": "unlimited", "models": [{"name": "m1"}]}],
            "endpoints": [
                {"id": d, "url": f"http://127.0.0.1:1/{d}", "provider": "tensorx", "models": ["m1"]}
                for d in DEPLOYMENTS
            ],
        },
        source="<test>",
        env={},
    )
    admission = await start_admission(config, nats_url, instance="admission", follow_load=False)
    nc = await nats.connect(nats_url)
    yield admission.service, nc
    await admission.stop()
    await nc.jetstream().delete_key_value(config.pinning.bucket)
    await nc.close()


async def picks(nc, n: int) -> Counter[str]:
    async def one() -> str:
        request = AdmitRequest(id=uuid.uuid4().hex, edge="e", model="m1", feature="chat", shard=0)
        msg = await nc.request(admission_subject(0), request.model_dump_json().encode(), timeout=5)
        return AdmitReply.model_validate_json(msg.data).target.endpoint

    return Counter(await asyncio.gather(*(one() for _ in range(n))))


async def test_deployments_are_chosen_by_their_learned_rates(admission):
    service, nc = admission
    before = await picks(nc, 90)
    assert set(before) == set(DEPLOYMENTS)  # nothing learned yet: everyone is tried
    now = time.time()
    for i in range(20):  # as edges would publish: east 3x faster than west, north failing
        for endpoint, latency, tokens, ok in (
            ("east", 1.0, 90, True),
            ("west", 3.0, 90, True),
            ("north", 0.5, 0, False),
        ):
            stats = RequestEnded(
                id=uuid.uuid4().hex,
                edge="e",
                model="m1",
                endpoint=endpoint,
                provider="tensorx",
                ended_at=now - i * 0.1,
                latency=latency * (1 + (i % 3) / 10),
                ok=ok,
                output_tokens=tokens,
                input_tokens=500 if ok else 0,
                outcome="success" if ok else "upstream_error",
            )
            await nc.publish(REQUEST_STATS_SUBJECT, stats.model_dump_json().encode())
    await eventually(lambda: service.rates.samples == 60, what="stats to reach admission")
    after = await picks(nc, 300)
    # north failed 20 times in a row: its breaker is open, it is not a candidate at all. Among
    # east and west the SLA (the median of their samples) lies between them: east ~1, west ~0.
    assert after["north"] == 0, after
    assert after["east"] > 250, after
    assert service.breakers.state("north", time.time()).value == "open"
