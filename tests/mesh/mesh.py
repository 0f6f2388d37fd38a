"""An in-process mesh on real parts: N admission instances and M edges sharing one bucket.

Every instance has its own NATS connection and its own RoutingState (own
slot mirror), exactly as separate processes would; simulated engines run on
uvicorn. Used by the concurrency and chaos tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import nats

from llmgw.config import Config, config_from_dict
from llmgw.services.admission.service import AdmissionService
from llmgw.services.edge.app import EdgeDeps, HotPathApp, create_app
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.upstream import Timeouts, new_session
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server
from llmgw.state.setup import limits_from_config, open_routing_state

MODEL = "chat-model"


def small_limits(pinned: int = 5, slots: int = 8, reserved: int = 2, per_session: int = 2) -> dict:
    return {
        "max_pinned_sessions": pinned,
        "max_global_in_flight_request_slots": slots,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": reserved,
        "max_per_session_in_flight_request_slots": per_session,
    }


def mesh_config(
    nats_url: str, bucket: str, urls: dict[str, str], limits: dict | None = None, **pinning: Any
) -> Config:
    """Managed providers a and b (one engine each, small limits) and unlimited c."""
    limits = limits or small_limits()
    return config_from_dict(
        {
            "nats": {"url": nats_url, "request_timeout": "2s"},
            "timeouts": {
                "dial": "1s",
                "response_header": "5s",
                "first_token": "5s",
                "idle": "2s",
                "total": "30s",
            },
            "pinning": {"bucket": bucket, "history": 64, "lease_timeout": "5s", **pinning},
            # Pins and leases under concurrency, with no scraper: flow control stays off.
            "admission": {"enabled": False},
            "models": [{"name": MODEL}],
            "providers": [
                {
                    "id": "a",
                    "kind": "managed",
                    "priority": 200,
                    "models": [{"name": MODEL, "limits": limits}],
                },
                {
                    "id": "b",
                    "kind": "managed",
                    "priority": 100,
                    "models": [{"name": MODEL, "limits": limits}],
                },
                {"id": "c", "kind": "unlimited", "models": [{"name": MODEL}]},
            ],
            "endpoints": [
                {"id": "engine-a", "url": urls["a"], "provider": "a", "models": [MODEL]},
                {"id": "engine-b", "url": urls["b"], "provider": "b", "models": [MODEL]},
                {"id": "deploy-c", "url": urls["c"], "provider": "c", "models": [MODEL]},
            ],
        },
        source="<mesh>",
        env={},
    )


@dataclass
class Mesh:
    config: Config
    engines: dict[str, RunningServer]
    admissions: list[AdmissionService] = field(default_factory=list)
    edges: list[RunningServer] = field(default_factory=list)
    edge_apps: list[HotPathApp] = field(default_factory=list)
    _connections: list[Any] = field(default_factory=list)
    _closers: list[Any] = field(default_factory=list)

    @property
    def limits(self):
        return limits_from_config(self.config)

    def set_degraded(self, provider: str, degraded: bool) -> None:
        """Mark a managed provider degraded (or not) in every admission instance."""
        for admission in self.admissions:
            if degraded:
                admission.catalog.forced_degraded.add((provider, MODEL))
            else:
                admission.catalog.forced_degraded.discard((provider, MODEL))

    async def stop(self) -> None:
        for server in self.edges:
            await server.stop()
        for app in self.edge_apps:
            await app.edge.drain()
        for admission in self.admissions:
            await admission.stop()
        for close in reversed(self._closers):
            await close()
        for nc in self._connections:
            await nc.close()
        for server in self.engines.values():
            await server.stop()


async def start_mesh(
    nats_url: str,
    bucket: str,
    *,
    admissions: int = 4,
    edges: int = 2,
    engine_params: EngineParams | None = None,
    routing_state_factory: Any = None,
    limits: dict | None = None,
    **pinning: Any,
) -> Mesh:
    params = engine_params or EngineParams.zero_delay(itl_base="2ms", max_num_seqs=64)
    engines = {}
    for seed, name in enumerate("abc"):
        engines[name] = await start_server(
            create_engine_app(params.model_copy(update={"seed": seed}), [MODEL])
        )
    config = mesh_config(
        nats_url, bucket, {k: v.url for k, v in engines.items()}, limits, **pinning
    )
    mesh = Mesh(config, engines)
    for i in range(admissions):
        nc = await nats.connect(nats_url, name=f"admission-{i}")
        mesh._connections.append(nc)
        routing = await open_routing_state(nc, config, instance_id=f"admission-{i}")
        if routing_state_factory is not None:
            routing = routing_state_factory(routing)
        mesh._closers.append(routing.close)
        service = AdmissionService(config, nc, routing)
        await service.start()
        mesh.admissions.append(service)
    for i in range(edges):
        nc = await nats.connect(nats_url, name=f"edge-{i}")
        mesh._connections.append(nc)
        routing = await open_routing_state(nc, config, instance_id=f"edge-{i}", follow_slots=False)
        session = new_session(Timeouts.from_section(config.timeouts))
        mesh._closers.append(session.close)
        app = create_app(
            config, EdgeDeps(nc=nc, session=session, metrics=EdgeMetrics(), routing=routing)
        )
        mesh.edge_apps.append(app)
        mesh.edges.append(await start_server(app))
    return mesh
