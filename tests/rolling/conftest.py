import asyncio
import contextlib
import sys
from pathlib import Path

import pytest

here = Path(__file__).parent
sys.path.insert(0, str(here))
sys.path.insert(0, str(here.parent / "chaos"))  # the process rig (cluster.Service)

from cluster import stop_all  # noqa: E402
from rolling_rig import Gateway, start_simulators, write_config  # noqa: E402

from llmgw.state.nats_kv import open_routing_bucket  # noqa: E402


@pytest.fixture
async def gateway(request, tmp_path, nats_url, nats_client, unique_id):
    """The simulators running and a config (router settings from the test's param); the test
    starts the gateway's services. Everything stops and both buckets go afterwards."""
    urls, simulators = start_simulators()
    for sim in simulators:
        await asyncio.to_thread(sim.wait_ready)
    bucket = f"rolling_{unique_id}"
    js = nats_client.jetstream()
    await open_routing_bucket(js, bucket, history=64)  # before a test's history recorder
    config = write_config(
        tmp_path / "config.yaml", nats_url, bucket, urls, **getattr(request, "param", {})
    )
    gateway = Gateway(config)
    try:
        yield gateway
    finally:
        gateway.stop()
        stop_all(simulators)
        for name in (bucket, f"load_{bucket}"):
            with contextlib.suppress(Exception):
                await js.delete_key_value(name)
