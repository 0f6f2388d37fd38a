"""The fleet bucket on a real nats-server: seeding, CAS changes, and the mirror every service
follows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from timing import eventually

from llmgw.config import Config, EndpointConfig, config_from_dict
from llmgw.config.fleet import fleet_bucket
from llmgw.core.fleet import EndpointState
from llmgw.fleet import (
    AppliedConfig,
    Fleet,
    FleetRecord,
    endpoint_key,
    live_config,
    restart_only_changes,
    take_live,
)
from llmgw.state.fleet import EndpointExists, FleetBucket, FleetMirror, open_fleet


@pytest_asyncio.fixture
async def bucket(nats_client: NatsClient, config: Config) -> AsyncIterator[FleetBucket]:
    opened = await open_fleet(nats_client, config)
    try:
        yield opened
    finally:
        with contextlib.suppress(Exception):
            await nats_client.jetstream().delete_key_value(fleet_bucket(config))


def engine(endpoint_id: str, port: int = 8999, **fields: object) -> EndpointConfig:
    return EndpointConfig.model_validate(
        {
            "id": endpoint_id,
            "url": f"http://127.0.0.1:{port}",
            "provider": "iris",
            "models": ["llama-3.3-70b"],
            **fields,
        }
    )


async def test_seeding_writes_the_files_endpoints_once_and_never_brings_back_a_removed_one(
    bucket: FleetBucket, config: Config
) -> None:
    assert await bucket.seed(config) == [e.id for e in config.endpoints]
    assert await bucket.seed(config) == []  # the same list seeded already
    await bucket.remove("engine-2")
    assert await bucket.seed(config) == []  # a restart with the same file: it stays removed
    fleet = await bucket.fleet()
    assert sorted(fleet.records) == ["engine-1", "tensorx-east", "tensorx-west"]
    assert {r.source for r in fleet.records.values()} == {"config"}


async def test_a_changed_file_updates_what_a_file_seeded_but_not_what_an_operator_added(
    bucket: FleetBucket, config: Config
) -> None:
    await bucket.seed(config)
    await bucket.set_state("engine-1", EndpointState.DRAINING)
    await bucket.add(FleetRecord(endpoint=engine("engine-9", capacity=4)))
    changed = config.model_copy(
        update={
            "endpoints": [
                *(
                    e.model_copy(update={"weight": 50}) if e.id == "engine-1" else e
                    for e in config.endpoints
                ),
                engine("engine-9", capacity=8),
            ]
        }
    )
    assert await bucket.seed(changed) == ["engine-1"]
    record, _ = await bucket.get("engine-1")
    assert record.endpoint.weight == 50 and record.state is EndpointState.DRAINING
    assert (await bucket.get("engine-9"))[0].endpoint.capacity == 4  # the operator's wins


async def test_add_refuses_an_id_the_fleet_holds_and_writes_nothing(
    bucket: FleetBucket, config: Config
) -> None:
    await bucket.seed(config)
    before = await bucket.kv.get(endpoint_key("engine-1"))
    with pytest.raises(EndpointExists):
        await bucket.add(FleetRecord(endpoint=engine("engine-1")))
    assert await bucket.kv.get(endpoint_key("engine-1")) == before


async def test_the_mirror_follows_every_change_within_a_second_as_whole_snapshots(
    bucket: FleetBucket, config: Config
) -> None:
    await bucket.seed(config)
    mirror = FleetMirror(bucket)
    seen: list[Fleet] = []
    mirror.on_change(seen.append)
    await mirror.start()
    try:
        assert sorted(mirror.fleet.records) == sorted(e.id for e in config.endpoints)
        await bucket.add(FleetRecord(endpoint=engine("engine-3")))
        started = time.monotonic()
        await eventually(
            lambda: "engine-3" in mirror.fleet.records, 1.0, "the new endpoint in the mirror"
        )
        assert time.monotonic() - started < 1.0
        await bucket.set_state("engine-3", EndpointState.DRAINING)
        await eventually(
            lambda: mirror.fleet.view().draining == {"engine-3"}, 1.0, "engine-3 draining"
        )
        await bucket.remove("engine-3")
        await eventually(lambda: "engine-3" not in mirror.fleet.records, 1.0, "engine-3 gone")
        await bucket.kv.put(endpoint_key("engine-4"), b"{not json")  # a broken record
        await bucket.add(FleetRecord(endpoint=engine("engine-5")))
        await eventually(lambda: "engine-5" in mirror.fleet.records, 1.0, "engine-5 arrives")
        assert "engine-4" not in mirror.fleet.records
        revisions = [f.revision for f in seen]
        assert revisions == sorted(revisions)  # snapshots in revision order, never mixed
    finally:
        await mirror.stop()


async def test_the_live_config_leaves_out_a_record_that_does_not_fit_the_config(
    bucket: FleetBucket, config: Config
) -> None:
    await bucket.seed(config)
    stranger = engine("engine-7").model_copy(update={"provider": "nobody"})
    await bucket.kv.put(endpoint_key("engine-7"), FleetRecord(endpoint=stranger).to_bytes())
    live = live_config(config, await bucket.fleet())
    assert [e.id for e in live.endpoints] == [e.id for e in config.endpoints]
    assert live.resolve_model("llama") == "llama-3.3-70b"  # lookups survive the copy


def test_an_applied_config_changes_its_live_fields_and_names_what_needs_a_restart(
    config: Config,
) -> None:
    values = config.model_dump(mode="json")
    values["providers"][0]["models"][0]["limits"]["max_global_in_flight_request_slots"] = 32
    values["providers"][1]["priority"] = 120
    values["admission"]["queue_capacity_per_band"] = 7
    values["admission"]["queue_ttl"] = "5s"
    values["admission"]["shards"] = 64  # needs a restart
    values["pinning"]["pin_inactivity_timeout"] = "90s"
    values["pinning"]["return_home"] = False
    values["pinning"]["lease_timeout"] = "7s"  # needs a restart
    values["spend"]["cost_header"] = True
    values["spend"]["prices"][0]["output"] = 99
    values["spend"]["currency"] = "EUR"  # needs a restart
    values["admission"]["bands"][-1]["saturation_ceiling"] = 0.25
    values["models"][0]["aliases"] = ["llama", "big"]
    values["models"][1]["fallbacks"] = ["llama-3.3-70b"]
    values["scoring"]["kv_ceiling"] = 0.5
    values["listen"] = "127.0.0.1:1"  # needs a restart
    values["timeouts"]["total"] = "9s"
    values["router"]["retries"] = 5
    values["router"]["session_header"] = "x-conversation"  # needs a restart
    applied = AppliedConfig(config=values, source="new.yaml")
    live = live_config(config, Fleet(applied=applied))
    limits = live.provider("iris").model("llama-3.3-70b").limits  # type: ignore[union-attr]
    assert limits is not None and limits.max_global_in_flight_request_slots == 32
    assert live.provider("tensorx").priority == 120
    assert live.admission.bands[-1].saturation_ceiling == 0.25
    assert live.admission.queue_capacity_per_band == 7 and live.admission.queue_ttl == 5
    assert live.admission.shards == config.admission.shards
    assert live.pinning.pin_inactivity_timeout == 90 and live.pinning.return_home is False
    assert live.pinning.lease_timeout == config.pinning.lease_timeout
    assert live.spend.cost_header and live.spend.prices[0].output == 99
    assert live.spend.currency == config.spend.currency
    assert live.resolve_model("big") == "llama-3.3-70b"
    assert live.models[1].fallbacks == ["llama-3.3-70b"] and live.scoring.kv_ceiling == 0.5
    assert live.timeouts.total == 9 and live.router.retries == 5
    assert live.listen == config.listen and live.router.session_header != "x-conversation"
    assert restart_only_changes(config, applied) == [
        "listen",
        "router",
        "admission",
        "pinning",
        "spend",
    ]


def test_profiles_without_the_running_default_profile_keep_it(config: Config) -> None:
    values = config.model_dump(mode="json")
    values["profiles"]["fast"] = {"retries": 0}
    values["router"]["default_profile"] = "fast"
    base = config_from_dict(values, env={})
    del values["profiles"]["fast"]
    values["router"]["default_profile"] = "chat"
    values["models"].append({"name": "mistral-7b", "routing_profile": "batch"})
    for provider in values["providers"]:
        provider["models"].append({"name": "mistral-7b", "features": ["chat"]})
    for endpoint in values["endpoints"]:
        endpoint["models"].append("mistral-7b")
    live = take_live(base, config_from_dict(values, env={}))
    assert live.resolve_model("mistral-7b") == "mistral-7b"
    assert live.profile_for_model("mistral-7b") == live.resolve_profile("batch")
    assert live.profiles["fast"].retries == 0  # `router` is read at start: its default stays


def test_an_applied_config_adds_and_removes_models_providers_and_pairs(config: Config) -> None:
    values = config.model_dump(mode="json")
    values["models"].append({"name": "mistral-7b", "aliases": ["mistral"]})
    values["models"] = [m for m in values["models"] if m["name"] != "qwen2.5-32b"]
    values["spend"]["prices"] = [p for p in values["spend"]["prices"] if "qwen" not in p["model"]]
    for model in values["models"]:
        model["fallbacks"] = []
    for provider in values["providers"]:
        provider["models"] = [m for m in provider["models"] if m["name"] != "qwen2.5-32b"]
    values["providers"].append(
        {
            "id": "vela",
            "kind": "unlimited",
            "priority": 40,
            "api_key_env": "VELA_KEY",
            "models": [{"name": "mistral-7b"}, {"name": "llama-3.3-70b"}],
        }
    )
    values["providers"][0]["kind"] = "unlimited"  # read at start
    values["providers"][1]["api_key_env"] = "TENSORX_NEW_KEY"
    values["providers"][1]["apis"] = ["chat_completions"]
    values["endpoints"] = [
        {**e, "models": [m for m in e["models"] if m != "qwen2.5-32b"]} for e in values["endpoints"]
    ]
    values["endpoints"].append(
        {
            "id": "vela-1",
            "url": "http://127.0.0.1:1",
            "provider": "vela",
            "models": ["mistral-7b", "llama-3.3-70b"],
        }
    )
    new = config_from_dict(values, env={"VELA_KEY": "k", "TENSORX_NEW_KEY": "k2"})
    applied = AppliedConfig(config=values, source="new.yaml")
    live = take_live(config, new)
    assert [p.id for p in live.providers] == [p.id for p in new.providers]
    assert live.provider("vela").api_key_env == "VELA_KEY"
    assert live.providers[0].kind == config.providers[0].kind
    assert live.provider("tensorx").api_key_env == "TENSORX_NEW_KEY"  # a key is read again
    assert live.provider("tensorx").apis == ["chat_completions"]
    assert live.resolve_model("mistral") == "mistral-7b"
    assert live.resolve_model("qwen2.5-32b") is None and live.resolve_model("qwen") is None
    assert all(p.model("qwen2.5-32b") is None for p in live.providers)
    assert restart_only_changes(config, applied) == ["providers"]  # iris's kind
    broken = AppliedConfig(config={**values, "providers": "nope"})
    assert live_config(config, Fleet(applied=broken)).providers == config.providers
