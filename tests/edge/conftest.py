"""An in-process gateway on real parts: nats-server, admission, edge and simulators on uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats
import pytest
import pytest_asyncio

from llmgw.config import Config, config_from_dict
from llmgw.events import EventPublisher
from llmgw.services.admission.service import AdmissionService
from llmgw.services.edge.app import EdgeDeps, create_app
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.upstream import Timeouts, new_session
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, free_port, start_server
from llmgw.state.routing_state import RoutingState
from llmgw.state.setup import open_routing_state


@dataclass
class Gateway:
    config: Config
    edge: RunningServer
    admission: AdmissionService | None
    engines: dict[str, RunningServer]
    deps: EdgeDeps
    routing: RoutingState | None = None
    app: Any = None

    @property
    def url(self) -> str:
        return self.edge.url


def gateway_config(
    nats_url: str, engine_urls: dict[str, str], bucket: str = "llmgw_routing", **overrides: Any
) -> Config:
    """Two managed engines and an unlimited deployment serving `m1` (alias `small`) and `m2`."""
    data: dict[str, Any] = {
        "nats": {"url": nats_url, "request_timeout": "500ms"},
        "router": {"max_body_bytes": 4096},
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
def engine_params() -> EngineParams:
    """Simulator parameters of every engine in `gateway`; a test module may override this."""
    return EngineParams.zero_delay()


@pytest_asyncio.fixture
async def gateway(
    nats_url: str, engine_params: EngineParams, unique_id: str
) -> AsyncIterator[Gateway]:
    """Edge + one admission instance + two simulated engines and a third 'deployment'."""
    engines = {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        params = engine_params.model_copy(update={"seed": seed})
        engines[name] = await start_server(create_engine_app(params, ["m1", "m2"]))
    config = gateway_config(
        nats_url, {k: v.url for k, v in engines.items()}, f"routing_{unique_id}"
    )
    admission_nc = await nats.connect(nats_url)
    routing = await open_routing_state(admission_nc, config, instance_id="admission")
    admission = AdmissionService(
        config, admission_nc, routing, events=EventPublisher(admission_nc, "admission-test")
    )
    await admission.start()
    edge_nc = await nats.connect(nats_url)
    session = new_session(Timeouts.from_section(config.timeouts))
    edge_routing = await open_routing_state(edge_nc, config, instance_id="edge", follow_slots=False)
    deps = EdgeDeps(nc=edge_nc, session=session, metrics=EdgeMetrics(), routing=edge_routing)
    app = create_app(config, deps)
    edge = await start_server(app)
    gw = Gateway(config, edge, admission, engines, deps, routing=routing, app=app)
    try:
        yield gw
    finally:
        await edge.stop()
        await app.edge.drain()
        await session.close()
        await edge_nc.close()
        if gw.admission is not None:
            await gw.admission.stop()
        await routing.close()
        await admission_nc.jetstream().delete_key_value(config.pinning.bucket)
        await admission_nc.close()
        for server in engines.values():
            await server.stop()


def unused_url() -> str:
    """An http URL on a loopback port nobody listens on."""
    return f"http://127.0.0.1:{free_port()}"
