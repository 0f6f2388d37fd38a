"""Endpoints whose models came from their engine follow its `GET /v1/models` (the reaper's
`ServedModelsFollower`), on a real nats-server and a real engine simulator that loads and
unloads LoRA adapters at run time through vLLM's API: an adapter loaded is served there, one
unloaded is no longer, models given by hand are never touched, and an engine that does not
answer or lists nothing of ours keeps what it had. An edge's notice (`ModelsStale`: the engine
answered 404 for a model it lists) has the list read at once, once for a burst."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from fleet_helpers import LOCAL_CONFIG, Leases
from inproc import stop_servers
from nats.aio.client import Client as NatsClient
from timing import eventually

from llmgw.config import Config, config_from_dict
from llmgw.config.fleet import fleet_bucket
from llmgw.core.fleet import EndpointState
from llmgw.fleet import FleetRecord
from llmgw.services.fleet.apply import apply_file
from llmgw.services.fleet.janitor import HeartbeatJanitor, heartbeat_token
from llmgw.services.fleet.ops import FleetOps, running_config
from llmgw.services.fleet.served import ServedModelsFollower
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server
from llmgw.state.fleet import FleetBucket
from llmgw.wire import MODELS_STALE_SUBJECT, ModelsStale

# The config names a model only an adapter loaded at run time serves: warned of, as expected.
pytestmark = pytest.mark.filterwarnings("ignore::llmgw.config.ConfigWarning")


def with_sql_adapter_model(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with a model `sql-assistant` (alias `sql-lora`, an adapter's name) that iris
    offers, as a config names a LoRA adapter it routes to."""
    values["models"].append({"name": "sql-assistant", "aliases": ["sql-lora"]})
    iris = next(p for p in values["providers"] if p["id"] == "iris")
    iris["models"].append({"name": "sql-assistant", "features": ["chat", "completions"]})
    return values


def local_values(nats_url: str, bucket: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    values["nats"] = {"url": nats_url, "connect_timeout": "1s"}
    values["pinning"] = {"bucket": bucket}
    values["router"] = {"load_bucket": f"load_{bucket}"}
    return values


@pytest.fixture
def config(nats_url: str, unique_id: str) -> Config:
    return config_from_dict(with_sql_adapter_model(local_values(nats_url, unique_id)), env={})


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[RunningServer]:
    """An engine serving the base model under the alias `llama` (vLLM's --served-model-name)."""
    server = await start_server(
        create_engine_app(EngineParams.zero_delay(served_models=["llama"], max_num_seqs=4))
    )
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def ops(fleet: FleetBucket, config: Config) -> FleetOps:
    return FleetOps(fleet, config, Leases())


@pytest_asyncio.fixture
async def follower(fleet: FleetBucket, config: Config) -> AsyncIterator[ServedModelsFollower]:
    async with httpx.AsyncClient(timeout=3.0) as client:
        yield ServedModelsFollower(
            fleet, lambda: running_config(fleet, config), interval=1.0, client=client
        )


async def lora(engine: RunningServer, action: str, name: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
    async with httpx.AsyncClient() as http:
        return await http.post(f"{engine.url}/v1/{action}_lora_adapter", json=body)


async def served_at(fleet: FleetBucket, endpoint_id: str) -> tuple[list[str], dict[str, str]]:
    record, _ = await fleet.get(endpoint_id)
    return list(record.endpoint.models), dict(record.endpoint.upstream_model)


async def test_an_adapter_loaded_at_run_time_is_served_there_and_one_unloaded_is_not(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer, follower: ServedModelsFollower
) -> None:
    added = await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
    assert added["models"] == ["llama-3.3-70b"] and added["models_from_engine"] is True
    await follower.sweep()
    assert follower.changed == 0  # what it serves is what the record says

    loaded = await lora(engine, "load", "sql-lora")
    assert loaded.status_code == 200, loaded.text
    await follower.sweep()
    assert await served_at(fleet, "engine-9") == (
        ["llama-3.3-70b", "sql-assistant"],
        {"llama-3.3-70b": "llama", "sql-assistant": "sql-lora"},
    )
    await follower.sweep()  # settled: no rewrite while the engine lists the same
    assert follower.changed == 1

    assert (await lora(engine, "unload", "sql-lora")).status_code == 200
    await follower.sweep()
    assert await served_at(fleet, "engine-9") == (["llama-3.3-70b"], {"llama-3.3-70b": "llama"})
    assert follower.changed == 2


async def test_models_given_by_hand_are_never_followed_and_an_update_of_models_stops_it(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer, follower: ServedModelsFollower
) -> None:
    by_hand = {"url": engine.url, "provider": "iris", "upstream_model": {"llama-3.3-70b": "llama"}}
    await ops.add({"id": "engine-8", **by_hand, "models": ["llama-3.3-70b"]})
    await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
    await ops.update("engine-9", {"models": ["llama-3.3-70b"]})  # the operator takes over
    assert (await fleet.get("engine-9"))[0].models_from_engine is False
    assert (await lora(engine, "load", "sql-lora")).status_code == 200
    await follower.sweep()
    assert follower.changed == 0
    for endpoint_id in ("engine-8", "engine-9"):
        assert (await served_at(fleet, endpoint_id))[0] == ["llama-3.3-70b"]


async def test_an_engine_that_does_not_answer_or_lists_nothing_of_ours_keeps_its_models(
    ops: FleetOps, fleet: FleetBucket, follower: ServedModelsFollower
) -> None:
    app = create_engine_app(EngineParams.zero_delay(served_models=["llama"], max_num_seqs=4))
    engine = await start_server(app)
    try:
        await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
        before = await fleet.get("engine-9")
        # An engine whose list holds nothing of ours for a moment (its base renamed, say).
        app.models[:] = ["gpt-9"]
        app._list_served()
        await follower.sweep()
        assert await fleet.get("engine-9") == before
    finally:
        await stop_servers([engine])
    await follower.sweep()  # nothing answers there now
    assert await fleet.get("engine-9") == before and follower.changed == 0


async def test_a_model_an_applied_config_adds_is_served_where_an_engine_already_lists_it(
    ops: FleetOps,
    fleet: FleetBucket,
    engine: RunningServer,
    follower: ServedModelsFollower,
    nats_client: NatsClient,
    nats_url: str,
    unique_id: str,
) -> None:
    """The cluster started without `sql-assistant`; the engine already serves the adapter.
    `llmgw config apply` adds the model: the next sweep matches against what the cluster runs
    on, so the adapter is served there without touching the endpoint."""
    started = config_from_dict(local_values(nats_url, unique_id), env={})
    follower_started = ServedModelsFollower(
        fleet, lambda: running_config(fleet, started), interval=1.0, client=follower._client
    )
    assert (await lora(engine, "load", "sql-lora")).status_code == 200
    await FleetOps(fleet, started, Leases()).add(
        {"id": "engine-9", "url": engine.url, "provider": "iris"}
    )
    await follower_started.sweep()
    assert (await served_at(fleet, "engine-9"))[0] == ["llama-3.3-70b"]
    values = with_sql_adapter_model(local_values(nats_url, unique_id))
    await apply_file(nats_client, config_from_dict(values, env={}), values, "<test>", wait=0.1)
    await follower_started.sweep()
    assert (await served_at(fleet, "engine-9"))[0] == ["llama-3.3-70b", "sql-assistant"]


async def added_with_the_adapter(ops: FleetOps, fleet: FleetBucket, engine: RunningServer) -> None:
    """engine-9 joined while serving the adapter; then it was unloaded there (the fleet does not
    know yet: its next read is an hour away)."""
    assert (await lora(engine, "load", "sql-lora")).status_code == 200
    await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
    assert (await served_at(fleet, "engine-9"))[0] == ["llama-3.3-70b", "sql-assistant"]
    assert (await lora(engine, "unload", "sql-lora")).status_code == 200


async def test_an_edges_notice_has_the_engines_list_read_at_once(
    ops: FleetOps,
    fleet: FleetBucket,
    engine: RunningServer,
    config: Config,
    nats_client: NatsClient,
) -> None:
    reads: list[str] = []
    async with httpx.AsyncClient(timeout=3.0) as client:
        follower = ServedModelsFollower(
            fleet,
            lambda: running_config(fleet, config),
            interval=3600.0,
            client=client,
            scope=fleet_bucket(config),
            on_read=reads.append,
        )
        await follower.listen(nats_client)
        await nats_client.flush()
        await added_with_the_adapter(ops, fleet, engine)
        ours = ModelsStale(
            edge="edge-1", scope=fleet_bucket(config), endpoint="engine-9", model="sql-assistant"
        )
        other_gateways = ours.model_copy(update={"scope": "another_gateways_fleet"})
        for notice in (other_gateways, ours):  # in this order: the first is ignored
            await nats_client.publish(MODELS_STALE_SUBJECT, notice.model_dump_json().encode())

        async def read_again() -> bool:
            return (await served_at(fleet, "engine-9"))[0] == ["llama-3.3-70b"]

        await eventually(read_again, 5, "the list read again")
        await follower.rereads_done()
    assert reads == ["model_unloaded"] and follower.notices == 1 and follower.changed == 1


async def test_a_burst_of_notices_is_one_read_and_one_during_the_read_is_one_more(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer, config: Config
) -> None:
    reads: list[str] = []

    def on_read(trigger: str) -> None:
        reads.append(trigger)
        if len(reads) == 1:  # a notice while the list is read: it may predate the change
            follower.stale("engine-9")

    async with httpx.AsyncClient(timeout=3.0) as client:
        follower = ServedModelsFollower(
            fleet, lambda: running_config(fleet, config), interval=3600.0, client=client,
            on_read=on_read,
        )  # fmt: skip
        await added_with_the_adapter(ops, fleet, engine)
        for _ in range(8):  # one burst: eight edges' notices
            follower.stale("engine-9")
        await follower.rereads_done()
    assert reads == ["model_unloaded", "model_unloaded"]
    assert (await served_at(fleet, "engine-9"))[0] == ["llama-3.3-70b"]
    assert follower.changed == 1  # the second read found the list as the first left it


class Raced(FleetBucket):
    """The fleet bucket as a hand change sees it: `between` runs once, right after its first
    read (another writer lands between the operator's read and write)."""

    between: Callable[[], Awaitable[None]] | None = None

    async def get(self, endpoint_id: str) -> tuple[FleetRecord, int]:
        got = await super().get(endpoint_id)
        if self.between is not None:
            between, self.between = self.between, None
            await between()
        return got


async def test_a_hand_update_that_races_a_follower_write_keeps_what_the_follower_wrote(
    ops: FleetOps,
    fleet: FleetBucket,
    engine: RunningServer,
    follower: ServedModelsFollower,
    config: Config,
) -> None:
    await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
    assert (await lora(engine, "load", "sql-lora")).status_code == 200
    raced = Raced(fleet.kv)
    raced.between = follower.sweep  # the adapter is followed while the operator changes weight
    await FleetOps(raced, config, Leases()).update("engine-9", {"weight": 50})
    record, _ = await fleet.get("engine-9")
    assert follower.changed == 1 and record.endpoint.weight == 50
    assert await served_at(fleet, "engine-9") == (
        ["llama-3.3-70b", "sql-assistant"],
        {"llama-3.3-70b": "llama", "sql-assistant": "sql-lora"},
    )
    assert record.models_from_engine  # the operator gave no models: it still follows


@pytest_asyncio.fixture
async def heartbeating() -> AsyncIterator[tuple[RunningServer, list[Callable[[], Awaitable[Any]]]]]:
    """An engine (the base as `llama`) whose `GET /v1/models` first runs the hooks given (a
    registrant's heartbeat landing while the follower reads the list: a slow sweep, a fast
    heartbeat)."""
    hooks: list[Callable[[], Awaitable[Any]]] = []
    app = create_engine_app(EngineParams.zero_delay(served_models=["llama"], max_num_seqs=4))

    async def engine_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            for hook in hooks:
                await hook()
        await app(scope, receive, send)

    server = await start_server(engine_app)
    try:
        yield server, hooks
    finally:
        await server.stop()


async def test_a_registrant_that_heartbeats_during_every_read_still_has_its_models_followed(
    ops: FleetOps,
    fleet: FleetBucket,
    follower: ServedModelsFollower,
    heartbeating: tuple[RunningServer, list[Callable[[], Awaitable[Any]]]],
) -> None:
    engine, hooks = heartbeating
    await ops.register({"id": "engine-9", "url": engine.url, "provider": "iris"}, 5)
    assert (await lora(engine, "load", "sql-lora")).status_code == 200
    hooks.append(lambda: ops.heartbeat("engine-9"))
    for _ in range(2):  # every read: a heartbeat lands while the list is read
        await follower.sweep()
    assert await served_at(fleet, "engine-9") == (
        ["llama-3.3-70b", "sql-assistant"],
        {"llama-3.3-70b": "llama", "sql-assistant": "sql-lora"},
    )
    assert follower.changed == 1


async def test_a_follower_write_is_no_heartbeat_of_a_silent_registrant(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer, follower: ServedModelsFollower
) -> None:
    """The janitor hears a registrant when its record changes; the follower's write of what
    the engine serves is the reaper's own, and must not put off the drain of a dead sidecar."""
    mono = [100.0]  # the reaper's monotonic clock, stepped
    janitor = HeartbeatJanitor(fleet, Leases(), clock=lambda: mono[0])
    await ops.register({"id": "engine-9", "url": engine.url, "provider": "iris"}, 2)
    await janitor.sweep()  # heard now; its sidecar is silent from here on
    mono[0] += 1.5
    assert (await lora(engine, "load", "sql-lora")).status_code == 200
    await follower.sweep()
    assert follower.changed == 1
    await janitor.sweep()
    mono[0] += 0.6  # silent for 2.1 s > its ttl of 2 s
    await janitor.sweep()
    record, _ = await fleet.get("engine-9")
    assert record.state is EndpointState.DRAINING and janitor.drained == 1
    assert janitor.silent_for("engine-9") == pytest.approx(2.1)
    await ops.heartbeat("engine-9")  # a heartbeat is still heard
    await janitor.sweep()
    assert janitor.silent_for("engine-9") == 0.0


async def test_an_endpoint_whose_only_model_was_an_adapter_is_drained_after_the_unload(
    ops: FleetOps, fleet: FleetBucket, follower: ServedModelsFollower
) -> None:
    """The engine's base is none of ours; only its adapter is. Unloaded, the engine still lists
    its base: the endpoint serves nothing of ours now (it keeps no model: no request is placed
    there to get the engine's 404), until the adapter is loaded again. An engine whose own base
    is renamed still keeps its models (the other test): only a listed base whose adapter left
    tells an unload."""
    app = create_engine_app(EngineParams.zero_delay(served_models=["base-x"], max_num_seqs=4))
    engine = await start_server(app)
    try:
        assert (await lora(engine, "load", "sql-lora")).status_code == 200
        added = await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
        assert added["models"] == ["sql-assistant"]
        assert (await lora(engine, "unload", "sql-lora")).status_code == 200
        serving, _ = await fleet.get("engine-9")
        await follower.sweep()
        record, _ = await fleet.get("engine-9")
        assert record.state is EndpointState.DRAINING and record.unserved
        assert heartbeat_token(record) == heartbeat_token(serving)  # the janitor hears nothing
        await follower.sweep()  # settled: nothing more to write
        assert follower.changed == 1
        shown = await ops.show("engine-9")
        assert shown["state"] == "draining" and shown["unserved"] is True

        assert (await lora(engine, "load", "sql-lora")).status_code == 200
        await follower.sweep()
        record, _ = await fleet.get("engine-9")
        assert record.state is EndpointState.ACTIVE and not record.unserved
        assert await served_at(fleet, "engine-9") == (
            ["sql-assistant"],
            {"sql-assistant": "sql-lora"},
        )
        assert follower.changed == 2
    finally:
        await stop_servers([engine])
