"""Following a Kubernetes Service's EndpointSlices into the live fleet, against a stand-in API
server that speaks the real list and watch JSON (discovery.k8s.io/v1: a list with its
resourceVersion, then newline-delimited watch events; an expired watch answers an ERROR event
with a 410 Status), on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
import yaml
from fleet_helpers import LOCAL_CONFIG, Leases, local_config
from nats.aio.client import Client as NatsClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from timing import eventually

from llmgw.config import Config, config_from_dict
from llmgw.config.fleet import KubernetesDiscovery, fleet_bucket
from llmgw.core.fleet import EndpointState
from llmgw.services.fleet.apply import apply_file
from llmgw.services.fleet.kubernetes import SliceWatcher
from llmgw.services.fleet.ops import FleetOps
from llmgw.services.reaper.main import serve
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server
from llmgw.state.fleet import FleetBucket, open_fleet

NAMESPACE = "llm"
SELECTOR = "kubernetes.io/service-name=vllm"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def endpoint(pod: str, ip: str, *, ready: bool = True, terminating: bool = False) -> dict:
    return {
        "addresses": [ip],
        "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
        "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": pod},
        "nodeName": "node-1",
    }


def endpoint_slice(name: str, *endpoints: dict) -> dict:
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": "vllm"},
        },
        "addressType": "IPv4",
        "endpoints": list(endpoints),
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
    }


class ApiServer:
    """EndpointSlices of one namespace: list, and watch from a resourceVersion."""

    def __init__(self) -> None:
        self.version = 100
        self.slices: dict[str, dict] = {}
        self.watches: list[asyncio.Queue[dict | None]] = []
        self.lists = 0
        self.app = Starlette(routes=[Route(PATH, self.endpointslices)])

    def change(self, kind: str, obj: dict) -> None:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        for queue in self.watches:
            queue.put_nowait({"type": kind, "object": obj})

    def expire(self) -> None:
        """The watch's version is too old now (etcd compacted it)."""
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410}
        status |= {"reason": "Expired", "message": "too old resource version"}
        for queue in self.watches:
            queue.put_nowait({"type": "ERROR", "object": status})

    async def endpointslices(self, request: Request) -> Response:
        if request.query_params.get("labelSelector") != SELECTOR:
            return JSONResponse({"kind": "EndpointSliceList", "items": []})
        if request.query_params.get("watch") not in ("1", "true"):
            self.lists += 1
            return JSONResponse(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.slices.values()),
                }
            )
        queue: asyncio.Queue[dict | None] = asyncio.Queue()
        self.watches.append(queue)

        async def events() -> AsyncIterator[bytes]:
            try:
                while (event := await queue.get()) is not None:
                    yield json.dumps(event).encode() + b"\n"
            finally:
                self.watches.remove(queue)

        return StreamingResponse(events(), media_type="application/json")


@pytest_asyncio.fixture
async def api() -> AsyncIterator[tuple[ApiServer, RunningServer]]:
    server = ApiServer()
    running = await start_server(server.app)
    try:
        yield server, running
    finally:
        for queue in server.watches:
            queue.put_nowait(None)
        await running.stop()


async def test_a_services_ready_engines_join_the_fleet_and_leave_it_drained(
    fleet: FleetBucket, config: Config, api: tuple[ApiServer, RunningServer]
) -> None:
    server, running = api
    server.change(
        "ADDED",
        endpoint_slice(
            "vllm-abc", endpoint("vllm-0", "10.0.0.1"), endpoint("vllm-1", "10.0.0.2", ready=False)
        ),
    )
    settings = KubernetesDiscovery(
        namespace=NAMESPACE,
        service="vllm",
        provider="iris",
        models=["llama-3.3-70b"],
        port_name="http",
        capacity=16,
    )
    leases = Leases()
    ops = FleetOps(fleet, config, leases)
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=running.url, timeout=httpx.Timeout(5, read=None)) as k8s:
        watcher = SliceWatcher(ops, settings, k8s, leases, interval=0.1)
        task = asyncio.create_task(watcher.run(stop))
        records: dict[str, Any] = {}

        async def refresh() -> None:
            records.clear()
            records.update((await fleet.fleet()).records)

        async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
            """`check` on the fleet as read afresh (named in the failure)."""

            async def poll() -> bool:
                await refresh()
                return bool(check())

            try:
                await eventually(poll, 6.0, what, interval=0.02)
            except AssertionError as failure:
                raise AssertionError(f"{failure}; fleet: {sorted(records)}") from None

        try:
            await until(lambda: "k8s-vllm-0" in records, "the ready pod joins")
            joined = records["k8s-vllm-0"]
            assert (joined.source, joined.endpoint.url) == ("kubernetes", "http://10.0.0.1:8000")
            assert joined.endpoint.capacity == 16 and "k8s-vllm-1" not in records
            await eventually(lambda: len(server.watches) == 1, 5, "the watch is open")
            server.change(
                "MODIFIED",
                endpoint_slice(
                    "vllm-abc", endpoint("vllm-0", "10.0.0.1"), endpoint("vllm-1", "10.0.0.2")
                ),
            )
            await until(lambda: "k8s-vllm-1" in records, "the pod that became ready joins")
            lists = server.lists
            server.expire()  # 410: the watcher lists again and watches from the new version
            server.change("ADDED", endpoint_slice("vllm-def", endpoint("vllm-2", "10.0.0.3")))
            await until(lambda: "k8s-vllm-2" in records, "a new slice's pod joins")
            assert server.lists > lists
            leases.held = {"k8s-vllm-0": 1}  # a request still runs on vllm-0
            server.change(
                "MODIFIED",
                endpoint_slice(
                    "vllm-abc",
                    endpoint("vllm-0", "10.0.0.1", ready=False, terminating=True),
                    endpoint("vllm-1", "10.0.0.2"),
                ),
            )
            await until(
                lambda: records["k8s-vllm-0"].state is EndpointState.DRAINING,
                "a terminating pod drains",
            )
            swept = watcher.reconciled
            # Sweeps go by (two whole ones after this point): its lease keeps it.
            await eventually(lambda: watcher.reconciled >= swept + 3, 5, "two more sweeps")
            await refresh()
            assert "k8s-vllm-0" in records
            leases.held = {}
            await until(lambda: "k8s-vllm-0" not in records, "removed once its lease ended")
            server.change("DELETED", endpoint_slice("vllm-def"))
            await until(lambda: "k8s-vllm-2" not in records, "a deleted slice's pod leaves")
            assert records["k8s-vllm-1"].state is EndpointState.ACTIVE
            assert records["engine-1"].source == "config"  # never touched
        finally:
            stop.set()
            for queue in server.watches:
                queue.put_nowait(None)
            await asyncio.wait_for(task, 5)


async def test_a_ready_pods_endpoint_the_model_follower_drained_is_left_drained(
    fleet: FleetBucket, config: Config
) -> None:
    """A pod that comes back ready is undrained; but one drained by the model follower (its
    engine serves none of our models now: `unserved`) is the follower's to undrain."""
    settings = KubernetesDiscovery(
        namespace=NAMESPACE, service="vllm", provider="iris", models=["llama-3.3-70b"]
    )
    leases = Leases()
    ops = FleetOps(fleet, config, leases)
    async with httpx.AsyncClient() as k8s:
        watcher = SliceWatcher(ops, settings, k8s, leases)
        watcher.slices = {"vllm-abc": {"k8s-vllm-0": "http://10.0.0.1:8000"}}
        await watcher.reconcile()
        drained = {"state": EndpointState.DRAINING, "unserved": True}
        await fleet.change("k8s-vllm-0", lambda r: r.model_copy(update=drained))
        await watcher.reconcile()
        record, _ = await fleet.get("k8s-vllm-0")
        assert record.state is EndpointState.DRAINING and record.unserved
        await ops.set_state("k8s-vllm-0", EndpointState.DRAINING)  # a drain by hand
        await watcher.reconcile()
        assert (await fleet.get("k8s-vllm-0"))[0].state is EndpointState.ACTIVE


async def test_the_reapers_watcher_matches_an_engines_models_against_the_applied_config(
    nats_client: NatsClient, nats_url: str, unique_id: str, api: tuple[ApiServer, RunningServer]
) -> None:
    """The cluster started without `sql-assistant`; `llmgw config apply` added it (alias
    `sql-lora`, an adapter's name). An engine behind the Service that serves the adapter joins
    with it: the reaper's watcher checks against the config the cluster runs on, as admission
    does, not the reaper's file."""
    server, running = api
    engine = await start_server(
        create_engine_app(EngineParams.zero_delay(served_models=["llama"], max_num_seqs=4))
    )
    discovery = {"namespace": NAMESPACE, "service": "vllm", "provider": "iris"}
    discovery |= {"port_name": "http", "api_server": running.url}
    fleet_section = {"kubernetes": discovery, "models_refresh": None}
    started = local_config(nats_url, unique_id, fleet=fleet_section)
    values = yaml.safe_load(LOCAL_CONFIG.read_text())
    values |= {"nats": {"url": nats_url, "connect_timeout": "1s"}, "fleet": fleet_section}
    values |= {"pinning": {"bucket": unique_id}, "router": {"load_bucket": f"load_{unique_id}"}}
    values["models"].append({"name": "sql-assistant", "aliases": ["sql-lora"]})
    iris = next(p for p in values["providers"] if p["id"] == "iris")
    iris["models"].append({"name": "sql-assistant", "features": ["chat", "completions"]})
    stop, ready = asyncio.Event(), asyncio.Event()
    reaper = None
    try:
        body = {"lora_name": "sql-lora", "lora_path": "/adapters/sql-lora"}
        async with httpx.AsyncClient() as http:
            loaded = await http.post(f"{engine.url}/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        applied = config_from_dict(values, env={})
        await apply_file(nats_client, applied, values, "<test>", wait=0.1)
        pod = endpoint("vllm-0", "127.0.0.1")
        slice_obj = endpoint_slice("vllm-abc", pod)
        slice_obj["ports"] = [{"name": "http", "port": int(engine.url.rsplit(":", 1)[1])}]
        server.change("ADDED", slice_obj)
        reaper = asyncio.create_task(serve(started, stop=stop, ready=ready))
        fleet = await open_fleet(nats_client, started)

        async def joined() -> bool:
            return "k8s-vllm-0" in (await fleet.fleet()).records

        await eventually(joined, 6.0, "the pod joins", interval=0.02)
        record, _ = await fleet.get("k8s-vllm-0")
        assert record.endpoint.models == ["llama-3.3-70b", "sql-assistant"]
        assert record.endpoint.upstream_model == {
            "llama-3.3-70b": "llama",
            "sql-assistant": "sql-lora",
        }
    finally:
        stop.set()
        for queue in server.watches:  # the watch sees its stop at its next line
            queue.put_nowait(None)
        if reaper is not None:
            async with asyncio.timeout(10):
                await reaper
        await engine.stop()
        with contextlib.suppress(Exception):
            await nats_client.jetstream().delete_key_value(fleet_bucket(started))
