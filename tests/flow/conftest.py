"""Fixtures of the flow-control tests; `rig` (tests/flow/rig.py) holds the harness itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import nats
import pytest
from rig import EDGE_LIMITS, open_rig

from llmgw.services.edge.app import EdgeDeps, create_app
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.upstream import Timeouts, new_session
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state.setup import open_routing_state


@pytest.fixture
async def stack(nats_url, unique_id, request):
    """Engines, admission (flow control on, per-test settings) and an edge in front."""
    admission = dict(getattr(request, "param", {}))
    router = admission.pop("router", None)
    engines = {
        name: await start_server(create_engine_app(EngineParams.zero_delay(), ["m1"]))
        for name in ("engine-1", "engine-2", "tensorx-1")
    }
    rig = await open_rig(
        nats_url,
        unique_id,
        urls={k: v.url for k, v in engines.items()},
        limits=EDGE_LIMITS,
        router=router,
        **admission,
    )
    rig.engines = engines
    edge_nc = await nats.connect(nats_url)
    session = new_session(Timeouts.from_section(rig.config.timeouts))
    routing = await open_routing_state(edge_nc, rig.config, instance_id="edge", follow_slots=False)
    rig.edge_metrics = EdgeMetrics()
    app = create_app(rig.config, EdgeDeps(edge_nc, session, rig.edge_metrics, routing))
    edge = await start_server(app)
    rig.edge_url = edge.url
    rig.routing = routing
    try:
        yield rig
    finally:
        await edge.stop()
        await app.edge.drain()
        await session.close()
        await routing.close()
        await edge_nc.close()
        await rig.close()
        for server in engines.values():
            await server.stop()
