"""Two edges and two admission instances with auth.mode keys; keys made by the real CLI."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest_asyncio
from inproc import Cluster, InFlight, before_any_lease, stop_servers

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server
from llmgw.state.checker import AuditLog

REPO = Path(__file__).parent.parent.parent
PROVIDER_KEY_ENV = "KEYS_TEST_TENSORX_KEY"
PROVIDER_KEY = "sk-third-party-upstream-key-0123456789"


def _edge_conftest():  # type: ignore[no-untyped-def]
    """tests/edge/conftest.py, for its gateway config (same engines, models and providers); its
    own imports (`fakes`) resolve from its directory, also when tests/keys runs alone."""
    edge = Path(__file__).parent.parent / "edge"
    if str(edge) not in sys.path:
        sys.path.append(str(edge))
    spec = importlib.util.spec_from_file_location("edge_conftest", edge / "conftest.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["edge_conftest"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


gateway_config = _edge_conftest().gateway_config


@dataclass
class KeyedGateway:
    cluster: Cluster
    engines: dict[str, RunningServer]
    nats_url: str
    bucket: str
    in_flight: dict[str, int]  # at all engines together: now, max
    audit: AuditLog
    provider_key: str = PROVIDER_KEY  # the third party's upstream key (tensorx)

    @property
    def edges(self) -> list[str]:
        return [e.url for e in self.cluster.edges]

    async def keys(self, *args: str, env: dict[str, str] | None = None) -> Any:
        """`llmgw keys --json ARGS` against this gateway's bucket, as a separate process (awaited:
        the gateway's parts share this event loop and keep serving meanwhile)."""
        env = {
            **os.environ,
            **(env or {}),
            "LLMGW_NATS__URL": self.nats_url,
            "LLMGW_AUTH__BUCKET": self.bucket,
        }
        config = str(REPO / "config/local.yaml")
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "llmgw", "keys", "--config", config, "--json", *args),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(60):
            out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        return json.loads(out)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed_cluster(nats_url: str) -> AsyncIterator[KeyedGateway]:
    """One cluster per test module (tests use keys of their own); `keyed` resets its records."""
    unique_id = uuid.uuid4().hex[:12]
    engines = {}
    in_flight = {"now": 0, "max": 0}
    # Slow enough that 50 requests overlap; ground truth counted at the engines.
    params = EngineParams.zero_delay(itl_base=0.01, max_num_seqs=64)
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        app = create_engine_app(params.model_copy(update={"seed": seed}), ["m1", "m2"])
        engines[name] = await start_server(InFlight(app, in_flight))
    bucket = f"keys_{unique_id}"
    # The third party's upstream key: tests check it never shows anywhere but upstream.
    os.environ[PROVIDER_KEY_ENV] = PROVIDER_KEY
    config = gateway_config(
        nats_url,
        {k: v.url for k, v in engines.items()},
        f"routing_{unique_id}",
        auth={"mode": "keys", "bucket": bucket, "usage_interval": "50ms"},
    )
    for provider in config.providers:
        if provider.id == "tensorx":
            provider.api_key_env = PROVIDER_KEY_ENV
    audit = AuditLog()
    cluster = Cluster(config, nats_url, observer_for=audit.observer)
    gateway = KeyedGateway(cluster, engines, nats_url, bucket, in_flight, audit)
    try:
        with before_any_lease(config):
            for _ in range(2):
                await cluster.add_admission(follow_load=False)
            await cluster.balanced()
        for _ in range(2):
            await cluster.add_edge()
        yield gateway
    finally:
        await cluster.stop()
        import nats

        nc = await nats.connect(nats_url)
        try:
            await nc.jetstream().delete_key_value(bucket)
        except Exception:
            pass
        await nc.close()
        await stop_servers(engines.values())
        os.environ.pop(PROVIDER_KEY_ENV, None)


@pytest_asyncio.fixture(loop_scope="module")
async def keyed(keyed_cluster: KeyedGateway) -> AsyncIterator[KeyedGateway]:
    keyed_cluster.in_flight["max"] = keyed_cluster.in_flight["now"]
    keyed_cluster.audit.events.clear()
    yield keyed_cluster
