"""An in-process gateway on real parts: nats-server, admission, edge and simulators on uvicorn.

`fake_edge` is the edge alone on uvicorn, its ports faked (tests/edge/fakes.py): for tests of
the HTTP layer that need an admission decision but nothing of NATS.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from fakes import FakeAdmission, FakeLeases, RecordingReporter, target
from inproc import (
    Admission,
    Edge,
    HeaderRecorder,
    before_any_lease,
    start_admission,
    start_edge,
    stop_servers,
)

from llmgw.config import Config, config_from_dict
from llmgw.services.admission.service import AdmissionService
from llmgw.services.edge.app import EdgeDeps, create_app
from llmgw.services.edge.main import close_edge_deps
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.upstream import new_pool
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, free_port, start_server
from llmgw.wire import Target


@dataclass
class Gateway:
    config: Config
    edge: Edge
    admission_handle: Admission | None
    engines: dict[str, RunningServer]
    received: dict[str, HeaderRecorder]  # per engine: the headers of what it was sent

    @property
    def url(self) -> str:
        return self.edge.url

    @property
    def admission(self) -> AdmissionService | None:
        handle = self.admission_handle
        return None if handle is None or handle.stopped else handle.service

    @property
    def deps(self) -> Any:
        return self.edge.deps

    @property
    def app(self) -> Any:
        return self.edge.app


def gateway_config(
    nats_url: str, engine_urls: dict[str, str], bucket: str = "llmgw_routing", **overrides: Any
) -> Config:
    """Two managed engines and an unlimited deployment serving `m1` (alias `small`) and `m2`."""
    data: dict[str, Any] = {
        "nats": {"url": nats_url},  # the shipped request_timeout (1 s): a loaded host answers late
        "router": {"max_body_bytes": 4096, "load_bucket": f"load_{bucket}"},
        "pinning": {"bucket": bucket, "lease_timeout": "3s"},
        # No scraper runs here: flow control is off unless a test turns it on (tests/flow).
        "admission": {"enabled": False},
        "timeouts": {
            "dial": "1s",
            "response_header": "2s",
            "first_token": "2s",
            "idle": "1s",
            "total": "10s",
        },
        "models": [
            {"name": "m1", "aliases": ["small"]},
            {"name": "m2"},
        ],
        "providers": [
            {
                "id": "iris",
                "kind": "managed",
                "models": [
                    {
                        "name": "m1",
                        "features": ["chat", "completions", "embeddings"],
                        "limits": {
                            "max_pinned_sessions": 8,
                            "max_global_in_flight_request_slots": 8,
                            "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
                            "max_per_session_in_flight_request_slots": 2,
                        },
                    },
                    {"name": "m2", "features": ["chat", "completions"]},
                ],
            },
            {"id": "tensorx", "kind": "unlimited", "priority": 10, "models": [{"name": "m1"}]},
        ],
        "endpoints": [
            {
                "id": "engine-1",
                "url": engine_urls["engine-1"],
                "provider": "iris",
                "models": ["m1", "m2"],
                "priority": 200,
            },
            {
                "id": "engine-2",
                "url": engine_urls["engine-2"],
                "provider": "iris",
                "models": ["m1", "m2"],
            },
            {
                "id": "tensorx-1",
                "url": engine_urls["tensorx-1"],
                "provider": "tensorx",
                "models": ["m1"],
            },
        ],
    }
    for key, value in overrides.items():
        data[key] = value
    return config_from_dict(data, source="<test>", env={})


@pytest.fixture
def make_gateway_config() -> Any:
    """`gateway_config` itself, for a test module that builds a gateway of its own."""
    return gateway_config


@pytest.fixture
def engine_params() -> EngineParams:
    """Simulator parameters of every engine in `gateway`; a test module may override this."""
    return EngineParams.zero_delay()


@pytest.fixture
def tracers() -> tuple[Any, Any]:
    """The (edge, admission) `llmgw.tracing.Tracing` of `gateway`; none by default."""
    return None, None


@pytest_asyncio.fixture
async def gateway(
    nats_url: str, engine_params: EngineParams, unique_id: str, tracers: tuple[Any, Any]
) -> AsyncIterator[Gateway]:
    """Edge + one admission instance + two simulated engines and a third 'deployment'."""
    engines, received = {}, {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        params = engine_params.model_copy(update={"seed": seed})
        received[name] = HeaderRecorder(create_engine_app(params, ["m1", "m2"]))
        engines[name] = await start_server(received[name])
    config = gateway_config(
        nats_url, {k: v.url for k, v in engines.items()}, f"routing_{unique_id}"
    )
    edge_tracing, admission_tracing = tracers
    with before_any_lease(config):
        admission = await start_admission(
            config,
            nats_url,
            instance="admission-test",
            follow_load=False,
            tracing=admission_tracing,
        )
    edge = await start_edge(config, nats_url, edge_id="edge-test", tracing=edge_tracing)
    gw = Gateway(config, edge, admission, engines, received)
    try:
        yield gw
    finally:

        async def stop_gateway() -> None:
            await edge.stop()  # first: its releases reach the instance
            await admission.stop()
            import nats

            nc = await nats.connect(nats_url)
            await nc.jetstream().delete_key_value(config.pinning.bucket)
            await nc.close()

        # The engines stop meanwhile: each stop is a uvicorn shutdown of ~0.15 s.
        await asyncio.gather(stop_gateway(), stop_servers(engines.values()))


def unused_url() -> str:
    """An http URL on a loopback port nobody listens on."""
    return f"http://127.0.0.1:{free_port()}"


@dataclass
class FakeEdge:
    """The edge on uvicorn over fake ports: `admission` decides (by its script), `leases` and
    `reporter` record. No NATS, no admission instance."""

    config: Config
    server: RunningServer
    deps: EdgeDeps
    admission: FakeAdmission
    leases: FakeLeases
    reporter: RecordingReporter

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def fake_target() -> Target:
    """Where `fake_edge` admits every request: by default an engine nobody listens on (a module
    whose requests must reach one overrides this)."""
    return target("iris", "engine-1", unused_url(), "m1")


@pytest_asyncio.fixture
async def fake_edge(fake_target: Target) -> AsyncIterator[FakeEdge]:
    """`gateway_config`'s edge with a `FakeAdmission` that admits every request to
    `fake_target` (a test may change `admission.script`)."""
    urls = {"engine-1": fake_target.url, "engine-2": unused_url(), "tensorx-1": unused_url()}
    config = gateway_config(unused_url().replace("http", "nats"), urls)
    admission, leases, reporter = FakeAdmission(fake_target), FakeLeases(), RecordingReporter()
    deps = EdgeDeps(
        admission=admission,
        leases=leases,
        reporter=reporter,
        upstream=new_pool(config.timeouts),
        metrics=EdgeMetrics(),
        edge_id="edge-test",
    )
    server = await start_server(create_app(config, deps))
    try:
        yield FakeEdge(config, server, deps, admission, leases, reporter)
    finally:
        await server.stop()
        await close_edge_deps(deps)
