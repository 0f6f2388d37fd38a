"""Cost-aware overflow in an admission instance: of two third parties of equal priority the
cheaper is placed first; a slower-than-allowed one goes after (the shipped config's providers
plus a cheaper twin of its third party)."""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path

import yaml
from inproc import start_admission

from llmgw.config import config_from_dict
from llmgw.core.placement import PlacementRequest, place
from llmgw.core.requests import Feature

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama-3.3-70b"


def _config(nats_url: str, min_speed: float):  # type: ignore[no-untyped-def]
    data = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    unique = uuid.uuid4().hex[:10]
    data["nats"] = {"url": nats_url}
    data["pinning"] = {"bucket": f"routing_{unique}"}
    data["router"] = {"load_bucket": f"load_{unique}"}
    twin = copy.deepcopy(next(p for p in data["providers"] if p["id"] == "tensorx"))
    twin["id"] = "cheapx"
    data["providers"].append(twin)  # the same priority (50) as tensorx
    endpoint = copy.deepcopy(next(e for e in data["endpoints"] if e["id"] == "tensorx-east"))
    endpoint.update(id="cheapx-1", provider="cheapx", url="http://127.0.0.1:9")
    endpoint.pop("simulate")
    data["endpoints"].append(endpoint)
    data["spend"]["prices"].append({"provider": "cheapx", "input": 0.1, "output": 0.4})
    data["spend"]["cheaper_overflow_min_speed"] = min_speed
    return config_from_dict(data, env={})


async def test_the_cheaper_third_party_of_equal_priority_takes_the_overflow(nats_url) -> None:
    config = _config(nats_url, 0.8)
    admission = await start_admission(config, nats_url, instance="cost", follow_load=False)
    try:
        catalog = admission.service.catalog
        snapshot, _ = catalog.snapshot(MODEL, Feature.CHAT, None, (), time.time())
        assert [p.id for p in snapshot.providers] == ["iris", "cheapx", "tensorx"]
        placed = place(snapshot, PlacementRequest(overflow=True, draw=0.5))
        assert placed.provider == "cheapx"
    finally:
        await admission.stop()


async def test_above_one_the_configs_order_stands(nats_url) -> None:
    config = _config(nats_url, 1.5)
    admission = await start_admission(config, nats_url, instance="order", follow_load=False)
    try:
        snapshot, _ = admission.service.catalog.snapshot(MODEL, Feature.CHAT, None, (), time.time())
        assert [p.id for p in snapshot.providers] == ["iris", "tensorx", "cheapx"]
    finally:
        await admission.stop()
