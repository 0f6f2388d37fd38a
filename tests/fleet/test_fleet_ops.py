"""Checked changes of the live fleet (`FleetOps`) and the admin HTTP API over them, on a real
nats-server, a real engine simulator and real HTTP: bad input gets a clear error (the API's
error shape) and changes nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
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
from llmgw.services.fleet.http import AdminGuard, add_fleet_routes
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
    add_fleet_routes(app, ops, AdminGuard(TOKEN))
    server = await start_server(app)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=ADMIN) as http:
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


TOKEN = "admin-token-for-the-tests-0123456789"
ADMIN = {"authorization": f"Bearer {TOKEN}"}

# Every admin route, each with a body that would change the fleet were it let through.
ADMIN_CALLS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/admin/endpoints", None),
    ("GET", "/admin/endpoints/engine-1", None),
    ("POST", "/admin/endpoints", {"probe": False, **spec("engine-9", "http://127.0.0.1:1")}),
    ("PATCH", "/admin/endpoints/engine-1", {"weight": 7, "probe": False}),
    ("DELETE", "/admin/endpoints/engine-1?force=true", None),
    ("POST", "/admin/endpoints/engine-1/drain", None),
    ("POST", "/admin/endpoints/engine-1/undrain", None),
    (
        "POST",
        "/admin/register",
        {"probe": False, "heartbeat_ttl": 10, **spec("engine-8", "http://127.0.0.1:1")},
    ),
    ("POST", "/admin/endpoints/engine-1/heartbeat", None),
]


@pytest.mark.parametrize(
    ("token", "headers", "status", "code"),
    [
        (TOKEN, {}, 401, "missing_admin_token"),
        (TOKEN, {"authorization": TOKEN}, 401, "missing_admin_token"),  # not a Bearer token
        (TOKEN, {"authorization": "Bearer"}, 401, "missing_admin_token"),
        (TOKEN, {"authorization": f"Bearer {TOKEN}x"}, 403, "invalid_admin_token"),
        (TOKEN, {"authorization": f"Bearer {TOKEN[:-1]}"}, 403, "invalid_admin_token"),
        (TOKEN, {"authorization": "Bearer guess"}, 403, "invalid_admin_token"),
        (None, ADMIN, 403, "admin_api_disabled"),  # no token configured: nobody may call it
    ],
)
async def test_the_admin_api_refuses_a_caller_without_its_token_and_changes_nothing(
    ops: FleetOps,
    fleet: FleetBucket,
    token: str | None,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    app = FastAPI()
    add_fleet_routes(app, ops, AdminGuard(token))
    server = await start_server(app)
    try:
        before = await snapshot(fleet)
        async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=headers) as http:
            for method, path, body in ADMIN_CALLS:
                refused = await http.request(method, path, json=body)
                assert refused.status_code == status, (method, path, refused.text)
                error = refused.json()["error"]
                assert set(error) == {"message", "type", "code", "param"}
                assert error["code"] == code, (method, path, error)
                assert TOKEN not in refused.text
                if status == 401:
                    assert refused.headers["www-authenticate"] == "Bearer"
        assert await snapshot(fleet) == before  # no write took effect
        # The same calls with the token go through (the guard, not the routes, refused them).
        if token is not None:
            async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=ADMIN) as http:
                listed = await http.get("/admin/endpoints")
                assert listed.status_code == 200, listed.text
                drained = await http.post("/admin/endpoints/engine-1/drain")
                assert drained.json()["state"] == "draining"
    finally:
        await server.stop()


class Stepped:
    """A clock a test steps: a registrant host's wall clock, or the reaper's monotonic one."""

    def __init__(self, now: float) -> None:
        self.now = now

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


SKEWS = [
    pytest.param(5 * 3600.0, id="registrant-5h-ahead"),
    pytest.param(-5 * 3600.0, id="registrant-5h-behind"),
]


async def state_of(fleet: FleetBucket, endpoint_id: str) -> EndpointState | None:
    record = (await fleet.fleet()).records.get(endpoint_id)
    return None if record is None else record.state


@pytest.mark.parametrize("skew", SKEWS)
async def test_a_registration_is_judged_silent_on_the_reapers_clock_whatever_the_registrants(
    fleet: FleetBucket, config: Config, leases: Leases, engine: RunningServer, skew: float
) -> None:
    """The registrant's host writes `heartbeat_at` by a clock hours off the reaper's (and
    stepping back an hour meanwhile): heartbeats keep it, and silence is counted on the
    reaper's own clock from when it saw the last heartbeat."""
    wall = Stepped(time.time() + skew)  # the registrant's host
    mono = Stepped(500.0)  # the reaper's monotonic clock
    ops = FleetOps(fleet, config, leases, wall=wall)
    janitor = HeartbeatJanitor(fleet, leases, clock=mono)
    await ops.register(spec("engine-9", engine.url), 2)
    await janitor.sweep()  # first seen: heard now
    for step in range(6):  # a heartbeat every 1.5 s for 9 s: kept all along
        mono.now += 1.5
        wall.now += 1.5 if step != 3 else -3600.0  # its clock steps back an hour once
        await ops.heartbeat("engine-9")
        await janitor.sweep()
        assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE
    mono.now += 1.9  # silent for 1.9 s of the reaper's clock: within its ttl
    wall.now += 7200.0  # whatever the registrant's clock says meanwhile
    await janitor.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE
    mono.now += 0.2  # silent for 2.1 s > ttl
    await janitor.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.DRAINING
    assert janitor.silent_for("engine-9") == pytest.approx(2.1)  # its drain is no heartbeat
    mono.now += 2.0  # silent for 4.1 s > 2 ttl, but a request still runs there
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
    assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE


async def test_a_restarted_reaper_counts_a_registration_as_heard_when_it_first_reads_it(
    fleet: FleetBucket, config: Config, leases: Leases, engine: RunningServer
) -> None:
    """A reaper that starts knows nothing older than its first read: a registration whose
    last heartbeat was written hours ago by its registrant's clock gets a whole ttl."""
    ops = FleetOps(fleet, config, leases, wall=lambda: time.time() - 3 * 3600.0)
    await ops.register(spec("engine-9", engine.url), 2)
    mono = Stepped(0.0)
    restarted = HeartbeatJanitor(fleet, leases, clock=mono)
    await restarted.sweep()
    mono.now += 2.0
    await restarted.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE
    mono.now += 0.1
    await restarted.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.DRAINING


class WriteBeforeChange:
    """The fleet bucket, but once `armed` with a write, the registrant makes it just before the
    janitor's change (a heartbeat, or registering again), as a write landing between the
    janitor's read and its CAS would."""

    def __init__(self, bucket: FleetBucket) -> None:
        self._bucket = bucket
        self.armed: Callable[[], Awaitable[object]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bucket, name)

    async def _land(self) -> None:
        if self.armed is not None:
            write, self.armed = self.armed, None
            await write()

    async def replace(self, record: Any, revision: int) -> int:
        await self._land()
        return await self._bucket.replace(record, revision)

    async def remove(self, endpoint_id: str, expected: Any = None) -> Any:
        await self._land()
        return await self._bucket.remove(endpoint_id, expected=expected)


async def test_a_heartbeat_that_lands_between_the_janitors_read_and_its_change_wins(
    fleet: FleetBucket, config: Config, engine: RunningServer
) -> None:
    ops = FleetOps(fleet, config, Leases(), wall=lambda: time.time() + 3600.0)
    await ops.register(spec("engine-9", engine.url), 2)
    mono, window = Stepped(0.0), WriteBeforeChange(fleet)
    janitor = HeartbeatJanitor(window, Leases(), clock=mono)  # type: ignore[arg-type]
    await janitor.sweep()
    mono.now += 2.5  # silent by what it read, but a heartbeat lands before the drain
    window.armed = lambda: ops.heartbeat("engine-9")
    await janitor.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE
    assert janitor.drained == 0 and janitor.silent_for("engine-9") == 2.5
    await janitor.sweep()  # and it counts: heard at this read
    assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE
    assert janitor.silent_for("engine-9") == 0.0

    mono.now += 2.5  # drained by silence
    await janitor.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.DRAINING
    mono.now += 2.5  # silent for 5 s > 2 ttl, no lease: removed, unless it registers again
    window.armed = lambda: ops.register(spec("engine-9", engine.url), 2)
    await janitor.sweep()
    assert await state_of(fleet, "engine-9") is EndpointState.ACTIVE
    assert (janitor.drained, janitor.removed) == (1, 0)


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


class CountedLeases(Leases):
    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def __call__(self) -> dict[str, int] | None:
        self.asked += 1
        return self.held


async def test_the_janitor_asks_for_leases_only_when_a_removal_is_due(
    fleet: FleetBucket, config: Config, engine: RunningServer
) -> None:
    """Asking every admission instance takes their answer window: a sweep that can only keep
    or drain does not, so drains keep to the sweep's interval."""
    ops = FleetOps(fleet, config, Leases())
    await ops.register(spec("engine-9", engine.url), 2)
    mono, leases = Stepped(0.0), CountedLeases()
    janitor = HeartbeatJanitor(fleet, leases, clock=mono)
    await janitor.sweep()
    mono.now += 2.5
    await janitor.sweep()  # drained by silence, no lease asked for
    assert await state_of(fleet, "engine-9") is EndpointState.DRAINING
    assert leases.asked == 0
    mono.now += 2.0  # 4.5 s > 2 ttl: removal is due, once no lease is left
    leases.held = {"engine-9": 1}
    await janitor.sweep()
    assert leases.asked == 1 and await state_of(fleet, "engine-9") is EndpointState.DRAINING
    leases.held = {}
    await janitor.sweep()
    assert janitor.removed == 1 and "engine-9" not in (await fleet.fleet()).records
