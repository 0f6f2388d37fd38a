"""Checked changes of the live fleet (`FleetOps`) and the admin HTTP API over them, on a real
nats-server, a real engine simulator and real HTTP: bad input gets a clear error (the API's
error shape) and changes nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from fastapi import FastAPI
from fleet_helpers import Leases
from inproc import stop_servers
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from llmgw.config import Config, config_from_dict
from llmgw.core.fleet import EndpointState
from llmgw.services.fleet.apply import apply_file
from llmgw.services.fleet.http import add_fleet_routes
from llmgw.services.fleet.janitor import HeartbeatJanitor
from llmgw.services.fleet.ops import FleetError, FleetOps
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, free_port, start_server
from llmgw.state.fleet import FleetBucket


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[RunningServer]:
    server = await start_server(create_engine_app(EngineParams(max_num_seqs=4)))
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def ops(fleet: FleetBucket, config: Config, leases: Leases) -> FleetOps:
    return FleetOps(fleet, config, leases)


def spec(endpoint_id: str, url: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": endpoint_id,
        "url": url,
        "provider": "iris",
        "models": ["llama-3.3-70b"],
        **fields,
    }


async def snapshot(fleet: FleetBucket) -> dict[str, Any]:
    return {i: r.model_dump() for i, r in (await fleet.fleet()).records.items()}


BAD_SPECS = [
    pytest.param({"weight": 0}, "weight", "invalid_value", id="zero-weight"),
    pytest.param({"capacity": -1}, "capacity", "invalid_value", id="negative-capacity"),
    pytest.param({"url": "ftp://x"}, "url", "invalid_value", id="not-http"),
    pytest.param({"provider": "nobody"}, "provider", "invalid_value", id="unknown-provider"),
    pytest.param({"models": ["llama"]}, "models.0", "invalid_value", id="alias-not-model"),
    pytest.param({"models": ["gpt-9"]}, "models.0", "invalid_value", id="unknown-model"),
    pytest.param({"colour": "red"}, "colour", "invalid_value", id="unknown-field"),
    pytest.param({"id": "Not A Slug"}, "id", "invalid_value", id="bad-id"),
]


@pytest.mark.parametrize(("change", "param", "code"), BAD_SPECS)
async def test_a_bad_spec_is_refused_naming_the_field_and_nothing_is_written(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer, change, param, code
) -> None:
    before = await snapshot(fleet)
    with pytest.raises(FleetError) as refused:
        await ops.add({**spec("engine-9", engine.url), **change})
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, param)
    assert param.split(".")[0] in refused.value.message
    assert await snapshot(fleet) == before


async def test_a_duplicate_id_and_an_unreachable_url_are_refused_and_nothing_is_written(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer
) -> None:
    before = await snapshot(fleet)
    with pytest.raises(FleetError) as duplicate:
        await ops.add(spec("engine-1", engine.url))
    assert (duplicate.value.status, duplicate.value.code) == (409, "endpoint_exists")
    with pytest.raises(FleetError) as unreachable:
        await ops.add(spec("engine-9", f"http://127.0.0.1:{free_port()}"))
    assert (unreachable.value.status, unreachable.value.code) == (422, "unreachable")
    with pytest.raises(FleetError) as moved:
        await ops.update("engine-1", {"url": f"http://127.0.0.1:{free_port()}"})
    assert moved.value.code == "unreachable"
    assert await snapshot(fleet) == before
    added = await ops.add(spec("engine-9", engine.url, capacity=4))
    assert added["state"] == "active" and (await fleet.get("engine-9"))[0].endpoint.capacity == 4


async def test_remove_takes_only_a_drained_endpoint_once_no_lease_is_left_on_it(
    ops: FleetOps, fleet: FleetBucket, leases: Leases
) -> None:
    with pytest.raises(FleetError) as active:
        await ops.remove("engine-2")
    assert active.value.code == "not_draining"
    await ops.set_state("engine-2", EndpointState.DRAINING)
    leases.held = {"engine-2": 3}
    with pytest.raises(FleetError) as busy:
        await ops.remove("engine-2", wait=0.3)
    assert busy.value.code == "leases_left" and "3 request" in busy.value.message
    leases.held = None  # no admission instance answers: nobody can say it is done
    with pytest.raises(FleetError) as unknown:
        await ops.remove("engine-2")
    assert unknown.value.code == "admission_unavailable"
    assert "engine-2" in (await fleet.fleet()).records
    leases.held = {}
    assert (await ops.remove("engine-2"))["id"] == "engine-2"
    assert "engine-2" not in (await fleet.fleet()).records
    with pytest.raises(FleetError) as gone:
        await ops.remove("engine-2")
    assert (gone.value.status, gone.value.code) == (404, "endpoint_not_found")


async def test_the_admin_api_answers_the_apis_error_shape_and_changes_the_fleet(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer
) -> None:
    app = FastAPI()
    add_fleet_routes(app, ops)
    server = await start_server(app)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            before = await snapshot(fleet)
            for body in (b"{oops", b"[1]", b'{"id": "engine-9", "probe": "yes"}'):
                refused = await http.post("/admin/endpoints", content=body)
                assert refused.status_code == 400, refused.text
                assert set(refused.json()["error"]) == {"message", "type", "code", "param"}
            weightless = await http.post("/admin/endpoints", json=spec("engine-9", "x", weight=0))
            assert weightless.json()["error"]["param"] in ("url", "weight")
            assert await snapshot(fleet) == before
            added = await http.post("/admin/endpoints", json=spec("engine-9", engine.url))
            assert added.status_code == 201, added.text
            changed = await http.patch("/admin/endpoints/engine-9", json={"weight": 50})
            assert changed.json()["weight"] == 50
            assert (await http.post("/admin/endpoints/engine-9/drain")).json()["state"] == (
                "draining"
            )
            listed = (await http.get("/admin/endpoints")).json()["data"]
            assert {e["id"]: e["state"] for e in listed}["engine-9"] == "draining"
            assert (await http.delete("/admin/endpoints/engine-9")).status_code == 200
            missing = await http.get("/admin/endpoints/engine-9")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "endpoint_not_found"
    finally:
        await server.stop()


class Wall:
    """A stepped wall clock (heartbeats and their expiry)."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_registration_needs_a_heartbeat_and_cannot_take_over_an_endpoint(
    ops: FleetOps, fleet: FleetBucket, engine: RunningServer
) -> None:
    before = await snapshot(fleet)
    for ttl, message in ((None, "required"), (0.2, "between"), ("10", "between")):
        with pytest.raises(FleetError) as refused:
            await ops.register(spec("engine-9", engine.url), ttl)
        assert refused.value.param == "heartbeat_ttl" and message in refused.value.message
    with pytest.raises(FleetError) as taken:
        await ops.register(spec("engine-1", engine.url), 10)
    assert taken.value.code == "endpoint_exists"
    with pytest.raises(FleetError) as manual:
        await ops.heartbeat("engine-1")
    assert manual.value.code == "not_registered"
    assert await snapshot(fleet) == before


async def test_a_silent_registration_is_drained_after_its_ttl_then_removed_once_empty(
    fleet: FleetBucket, config: Config, leases: Leases, engine: RunningServer
) -> None:
    wall = Wall()
    ops = FleetOps(fleet, config, leases, wall=wall)
    janitor = HeartbeatJanitor(fleet, leases, clock=wall)
    await ops.register(spec("engine-9", engine.url), 2)
    wall.now += 1.5
    await ops.heartbeat("engine-9")  # alive: its ttl counts from here
    wall.now += 1.9
    await janitor.sweep()
    assert (await fleet.get("engine-9"))[0].state is EndpointState.ACTIVE
    wall.now += 0.2  # silent for 2.1 s > ttl
    await janitor.sweep()
    assert (await fleet.get("engine-9"))[0].state is EndpointState.DRAINING
    wall.now += 2.0  # silent for 4.1 s > 2 ttl, but a request still runs there
    leases.held = {"engine-9": 1}
    await janitor.sweep()
    assert "engine-9" in (await fleet.fleet()).records
    leases.held = None  # nobody can say: kept
    await janitor.sweep()
    assert "engine-9" in (await fleet.fleet()).records
    leases.held = {}
    await janitor.sweep()
    assert "engine-9" not in (await fleet.fleet()).records
    assert (janitor.drained, janitor.removed) == (1, 1)
    await ops.register(spec("engine-9", engine.url), 2)  # back: active again
    assert (await fleet.get("engine-9"))[0].state is EndpointState.ACTIVE


def model_list(*served: tuple[str, str | None]) -> Starlette:
    """A stand-in engine answering vLLM's `GET /v1/models` (served names, LoRA parents)."""
    body = {
        "object": "list",
        "data": [{"id": i, "object": "model", "owned_by": "vllm", "parent": p} for i, p in served],
    }

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(body)

    return Starlette(routes=[Route("/v1/models", models)])


async def test_an_endpoint_added_without_models_serves_what_its_engine_lists_under_our_names(
    ops: FleetOps, fleet: FleetBucket
) -> None:
    engine = await start_server(
        model_list(("llama", None), ("qwen2.5-32b", None), ("sql-lora", "llama"))
    )
    stranger = await start_server(model_list(("gpt-9", None)))
    try:
        before = await snapshot(fleet)
        with pytest.raises(FleetError) as nothing_ours:
            await ops.add({"id": "engine-8", "url": stranger.url, "provider": "iris"})
        assert (nothing_ours.value.code, nothing_ours.value.param) == ("no_models", "models")
        assert "gpt-9" in nothing_ours.value.message
        assert await snapshot(fleet) == before
        added = await ops.add({"id": "engine-9", "url": engine.url, "provider": "iris"})
        assert added["models"] == ["llama-3.3-70b", "qwen2.5-32b"]
        record, _ = await fleet.get("engine-9")
        assert record.endpoint.upstream_name("llama-3.3-70b") == "llama"  # the alias it serves
        assert record.endpoint.upstream_name("qwen2.5-32b") == "qwen2.5-32b"
    finally:
        await stop_servers([engine, stranger])


async def test_config_apply_seeds_a_new_providers_endpoints_and_endpoints_add_knows_it(
    fleet: FleetBucket, config: Config, engine: RunningServer, nats_client: Any, tmp_path: Any
) -> None:
    """A provider an applied config added: its endpoints in the file join the fleet with the
    apply, and `llmgw endpoints add` (run with the file the cluster started from) checks a new
    endpoint against the providers the cluster runs on, so it takes one of that provider."""
    values = config.model_dump(mode="json")
    values["providers"].append(
        {"id": "vela", "kind": "unlimited", "models": [{"name": "llama-3.3-70b"}]}
    )
    vela = {"id": "vela-1", "url": engine.url, "provider": "vela", "models": ["llama-3.3-70b"]}
    values["endpoints"].append(vela)
    await apply_file(nats_client, config_from_dict(values, env={}), values, "<test>", wait=0.1)
    assert (await fleet.get("vela-1"))[0].endpoint.provider == "vela"
    started = tmp_path / "started.yaml"  # the file as the cluster started: no vela
    started.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    add = ["add", "vela-2", "--url", engine.url, "--provider", "vela", "--models", "llama-3.3-70b"]
    command = [sys.executable, "-m", "llmgw", "endpoints", "--config", str(started), *add]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert (await fleet.get("vela-2"))[0].endpoint.provider == "vela"
