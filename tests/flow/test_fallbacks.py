"""Model-level fallbacks: when every provider of a model is degraded or full, its fallbacks serve."""

from __future__ import annotations

import uuid

import pytest
from inproc import start_admission
from rig import admitted

from llmgw.config import config_from_dict
from llmgw.core.outcomes import Refusal
from llmgw.core.shards import shard_of
from llmgw.fleet import take_live
from llmgw.wire import AdmitRequest


@pytest.fixture
async def service(nats_url, unique_id):
    config = config_from_dict(
        {
            "nats": {"url": nats_url},
            "pinning": {"bucket": f"routing_{unique_id}"},
            "router": {"load_bucket": f"load_{unique_id}"},
            "admission": {"enabled": False},
            "models": [
                {"name": "big", "aliases": ["b"], "fallbacks": ["small"]},
                {"name": "small"},
            ],
            "providers": [
                {"id": "iris", "kind": "managed", "models": [{"name": "big"}, {"name": "small"}]}
            ],
            "endpoints": [
                {
                    "id": "gpu-big",
                    "url": "http://127.0.0.1:1/big",
                    "provider": "iris",
                    "models": ["big"],
                    "upstream_model": {"big": "big-fp8"},
                },
                {
                    "id": "gpu-small",
                    "url": "http://127.0.0.1:1/small",
                    "provider": "iris",
                    "models": ["small"],
                },
            ],
        },
        source="<test>",
        env={},
    )
    admission = await start_admission(config, nats_url, instance="admission", follow_load=False)
    yield admission.service
    await admission.stop()
    import nats

    nc = await nats.connect(nats_url)
    await nc.jetstream().delete_key_value(config.pinning.bucket)
    await nc.close()


def ask(model: str) -> AdmitRequest:
    session = uuid.uuid4().hex
    return AdmitRequest(
        id=uuid.uuid4().hex,
        edge="e",
        model=model,
        feature="chat",
        session=session,
        shard=shard_of(session, 32),
    )


async def test_a_degraded_model_is_served_by_its_fallback(service):
    first = await service.decide(ask("big"))
    assert (first.target.endpoint, first.served_model, first.target.upstream_model) == (
        "gpu-big",
        "big",
        "big-fp8",
    )
    service.health.set_healthy("gpu-big", False)
    fallback = await service.decide(ask("big"))
    assert admitted(fallback)
    assert (fallback.target.endpoint, fallback.served_model) == ("gpu-small", "small")
    assert service.metrics.fallbacks.labels("big", "small")._value.get() == 1
    service.health.set_healthy("gpu-small", False)
    nowhere = await service.decide(ask("big"))
    assert nowhere.refusal is Refusal.NO_CAPACITY


async def test_a_fallback_applied_live_serves_the_next_request(service):
    service.health.set_healthy("gpu-small", False)
    assert (await service.decide(ask("small"))).refusal is Refusal.NO_CAPACITY
    values = service.config.model_dump(mode="json")
    values["models"][1]["fallbacks"] = ["big"]
    service.follow_config(take_live(service.config, config_from_dict(values, env={})))
    fallback = await service.decide(ask("small"))
    assert (fallback.target.endpoint, fallback.served_model) == ("gpu-big", "big")
