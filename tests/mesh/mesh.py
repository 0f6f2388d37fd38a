"""An in-process mesh on real parts: N admission instances and M edges sharing one bucket, a real
scraper reading real simulated engines, flow control on (the shipped defaults).

Every instance has its own NATS connection, exactly as separate processes would; simulated
engines run on uvicorn. Every ledger reports to one `AuditLog`, so the checker can replay every
grant and end of every instance. Used by the concurrency and first-request tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from inproc import Cluster, before_any_lease, connect, stop_servers
from timing import eventually

from llmgw.config import Config, config_from_dict
from llmgw.core.apikeys import ApiKey
from llmgw.services.keys.main import create_key
from llmgw.services.scraper.main import serve as serve_scraper
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server
from llmgw.state.apikeys import open_key_bucket
from llmgw.state.checker import AuditLog

MODEL = "chat-model"
FEATURES = ["chat", "completions", "embeddings"]


def small_limits(pinned: int = 5, slots: int = 8, reserved: int = 2, per_session: int = 2) -> dict:
    return {
        "max_pinned_sessions": pinned,
        "max_global_in_flight_request_slots": slots,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": reserved,
        "max_per_session_in_flight_request_slots": per_session,
    }


def mesh_config(
    nats_url: str,
    bucket: str,
    urls: dict[str, str],
    limits: dict | None = None,
    replicas: int = 1,
    auth: dict | None = None,
    capacity: int = 64,
    **admission: Any,
) -> Config:
    """Managed providers a and b (one engine each, small limits) and unlimited c; every bucket
    on `replicas` replicas (3 on a NATS cluster); `auth`: the auth section (none without)."""
    limits = limits or small_limits()
    return config_from_dict(
        {
            **({"auth": auth} if auth else {}),
            "nats": {"url": nats_url, "request_timeout": "2s", "replicas": replicas},
            "router": {"scrape_interval": "200ms", "load_bucket": f"load_{bucket}"},
            "timeouts": {
                "dial": "1s",
                "response_header": "5s",
                "first_token": "5s",
                "idle": "2s",
                "total": "30s",
            },
            "pinning": {
                "bucket": bucket,
                "history": 64,
                "lease_timeout": "5s",
                "pin_inactivity_timeout": "5s",
                "min_idle_before_evict": "1s",
                # Chaos degrades providers every second or so; sessions it moved come home soon.
                "return_home_after": "1s",
            },
            # Flow control on, as shipped; quick membership so churn settles within a test.
            "admission": {"shards": 16, "heartbeat": "200ms", "member_ttl": "3s", **admission},
            "models": [{"name": MODEL}],
            "providers": [
                {
                    "id": "a",
                    "kind": "managed",
                    "priority": 200,
                    "models": [{"name": MODEL, "limits": limits, "features": FEATURES}],
                },
                {
                    "id": "b",
                    "kind": "managed",
                    "priority": 100,
                    "models": [{"name": MODEL, "limits": limits, "features": FEATURES}],
                },
                {
                    "id": "c",
                    "kind": "unlimited",
                    "models": [{"name": MODEL, "features": FEATURES}],
                },
            ],
            "endpoints": [
                {
                    "id": "engine-a",
                    "url": urls["a"],
                    "provider": "a",
                    "models": [MODEL],
                    "capacity": capacity,
                },
                {
                    "id": "engine-b",
                    "url": urls["b"],
                    "provider": "b",
                    "models": [MODEL],
                    "capacity": capacity,
                },
                {"id": "deploy-c", "url": urls["c"], "provider": "c", "models": [MODEL]},
            ],
        },
        source="<mesh>",
        env={},
    )


@dataclass
class Mesh:
    config: Config
    cluster: Cluster
    engines: dict[str, RunningServer]
    audit: AuditLog
    # auth.mode keys: (secret, key) of every key created in the key bucket, in order.
    keys: list[tuple[str, ApiKey]] = field(default_factory=list)
    _scraper_stop: asyncio.Event = field(default_factory=asyncio.Event)
    _scraper: asyncio.Task[None] | None = None

    @property
    def limits(self) -> dict:
        return self.cluster.limits

    @property
    def edges(self):  # type: ignore[no-untyped-def]
        return self.cluster.edges

    @property
    def admissions(self):  # type: ignore[no-untyped-def]
        return self.cluster.live_admissions()

    def set_degraded(self, provider: str, degraded: bool) -> None:
        """Mark a managed provider degraded (or not) in every admission instance."""
        for admission in self.admissions:
            if degraded:
                admission.catalog.forced_degraded.add((provider, MODEL))
            else:
                admission.catalog.forced_degraded.discard((provider, MODEL))

    async def kill_admission(self, index: int) -> str:
        """SIGKILL-like: it vanishes without handing anything over."""
        handle = [a for a in self.cluster.admissions if not a.stopped][index]
        name = handle.name  # the audit trail's name, though it may have rejoined under another
        self.audit.crash(name)
        await handle.kill()
        return name

    async def stop_admission(self, index: int) -> str:
        """SIGTERM-like: it hands its shards over and leaves."""
        handle = [a for a in self.cluster.admissions if not a.stopped][index]
        await handle.stop()
        self.audit.stopped(handle.name)
        return handle.name

    async def drain_edges(self) -> None:
        for edge in self.edges:
            await edge.deps.reporter.drain()

    async def stop(self) -> None:
        self._scraper_stop.set()
        if self._scraper is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._scraper, 10)
        await self.cluster.stop()
        if self.keys:
            nc = await connect(self.cluster.nats_url, "cleanup-keys")
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_key_value(self.config.auth.bucket)
            await nc.close()
        await stop_servers(self.engines.values())


async def start_mesh(
    nats_url: str,
    bucket: str,
    *,
    admissions: int = 4,
    edges: int = 2,
    engine_params: EngineParams | None = None,
    limits: dict | None = None,
    replicas: int = 1,
    keys: list[dict[str, Any]] | None = None,
    capacity: int | None = None,
    **admission: Any,
) -> Mesh:
    """`keys`: run with auth.mode keys, these keys (ApiKey fields, e.g. tenant and
    max_parallel_requests) created in the key bucket as `llmgw keys create` does. `capacity`:
    the managed engines' batch slots (max_num_seqs, and their endpoints' capacity); by default
    64, far above the limits."""
    params = engine_params or EngineParams.zero_delay(itl_base="2ms", max_num_seqs=64)
    engines = {}
    for seed, name in enumerate("abc"):
        update: dict[str, Any] = {"seed": seed}
        if capacity is not None and name != "c":
            update["max_num_seqs"] = capacity
        engines[name] = await start_server(
            create_engine_app(params.model_copy(update=update), [MODEL])
        )
    auth = {"mode": "keys", "bucket": f"keys_{bucket}"} if keys is not None else None
    config = mesh_config(
        nats_url,
        bucket,
        {k: v.url for k, v in engines.items()},
        limits,
        replicas,
        auth,
        capacity if capacity is not None else 64,
        **admission,
    )
    audit = AuditLog()
    cluster = Cluster(config, nats_url, observer_for=audit.observer, on_stopped=audit.stopped)
    mesh = Mesh(config, cluster, engines, audit)
    ready = asyncio.Event()
    mesh._scraper = asyncio.create_task(
        serve_scraper(config, stop=mesh._scraper_stop, ready=ready, instance="scraper-mesh")
    )
    await asyncio.wait_for(ready.wait(), 10)
    with before_any_lease(config):
        for i in range(admissions):
            await cluster.add_admission(f"admission-{i}")
        await cluster.settled()
    await eventually(
        lambda: all(a.load.reports >= 2 for a in cluster.live_admissions()),
        10,
        "the scraper's reports in every admission instance",
        interval=0.02,
    )
    if keys is not None:
        mesh.keys = await create_keys(config, nats_url, keys)
    for _ in range(edges):
        await cluster.add_edge()
    return mesh


async def create_keys(
    config: Config, nats_url: str, specs: list[dict[str, Any]]
) -> list[tuple[str, ApiKey]]:
    """Create keys in the key bucket with the CLI's own code (`llmgw keys create`)."""
    nc = await connect(nats_url, "keys-cli")
    try:
        bucket = await open_key_bucket(nc, config)
        created = []
        for spec in specs:
            secret, key = create_key(spec, now=time.time())
            await bucket.create(key)
            created.append((secret, key))
        return created
    finally:
        await nc.close()
