"""Fixtures of the flow-control tests; `rig` (tests/flow/rig.py) holds the harness itself."""

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest
from inproc import start_edge, stop_servers
from rig import EDGE_LIMITS, open_rig

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server


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
    edge = await start_edge(rig.config, nats_url, edge_id="edge-flow")
    rig.edge_metrics = edge.deps.metrics
    rig.edge_url = edge.url
    rig.edge = edge
    try:
        yield rig
    finally:

        async def stop_gateway() -> None:
            await edge.stop()  # first: its releases reach the instances
            await rig.close()

        # The engines stop meanwhile: each stop is a uvicorn shutdown of ~0.15 s.
        await asyncio.gather(stop_gateway(), stop_servers(engines.values()))
