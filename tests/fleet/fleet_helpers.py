"""Shared pieces of the live-fleet tests: the local config on a test's own buckets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import yaml
from inproc import stop_servers

from llmgw.config import Config, config_from_dict
from llmgw.config.fleet import fleet_bucket

REPO = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = REPO / "config" / "local.yaml"


def local_config(nats_url: str, bucket: str, **overrides: Any) -> Config:
    """config/local.yaml on `nats_url`, with buckets of its own (the fleet's is named after the
    load bucket)."""
    data: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["nats"] = {"url": nats_url, "connect_timeout": "1s"}
    data["pinning"] = {"bucket": bucket}
    data["router"] = {"load_bucket": f"load_{bucket}"}
    data.update(overrides)
    return config_from_dict(data, env={})


class Leases:
    """What the admission instances answer about leases per endpoint (None: nobody answers)."""

    def __init__(self) -> None:
        self.held: dict[str, int] | None = {}

    async def __call__(self) -> dict[str, int] | None:
        return self.held


def engines_values(nats_url: str, urls: dict[str, str], bucket: str) -> dict[str, Any]:
    """Two managed engines (iris) and a third party (tensorx) serving `m1`; iris/m1 has
    G = 8 (R = 2, P = 8, S = 2). No scraper runs: flow control is off."""
    return {
        "nats": {"url": nats_url},  # the shipped request_timeout (1 s)
        "router": {"load_bucket": f"load_{bucket}"},
        "pinning": {"bucket": bucket, "lease_timeout": "3s"},
        "admission": {"enabled": False},
        "models": [{"name": "m1"}],
        "providers": [
            {
                "id": "iris",
                "kind": "managed",
                "models": [
                    {
                        "name": "m1",
                        "limits": {
                            "max_pinned_sessions": 8,
                            "max_global_in_flight_request_slots": 8,
                            "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
                            "max_per_session_in_flight_request_slots": 2,
                        },
                    }
                ],
            },
            {"id": "tensorx", "kind": "unlimited", "priority": 10, "models": [{"name": "m1"}]},
        ],
        "endpoints": [
            {"id": name, "url": url, "provider": "tensorx" if "tensorx" in name else "iris"}
            | {"models": ["m1"]}
            for name, url in urls.items()
        ],
    }


async def add_following_admission(cluster: Any, config: Config) -> Any:
    """One more admission instance of `cluster` that follows the fleet bucket, composed as
    `llmgw admission` composes it (seed, first snapshot, then each change); its mirror."""
    from llmgw.services.admission.live import FleetFollower, apply_fleet
    from llmgw.state.fleet import start_fleet

    admission = await cluster.add_admission(follow_load=False)
    mirror = await start_fleet(admission.nc, config, seed=True)
    apply_fleet(admission.service, config, mirror.fleet)
    mirror.on_change(FleetFollower(admission.service, config))
    return mirror


async def stop_fleet_cluster(
    mirrors: list[Any], cluster: Any, engines: Any, nats_url: str, config: Config
) -> None:
    """Stop a test's fleet mirrors, cluster and engines, and delete its fleet bucket."""

    for mirror in mirrors:
        await mirror.stop()
    await cluster.stop()
    await stop_servers(engines)
    with contextlib.suppress(Exception):
        cleanup = await nats.connect(nats_url)
        await cleanup.jetstream().delete_key_value(fleet_bucket(config))
        await cleanup.close()


class LoadRun:
    """A cluster on `values` whose ledgers' audit trail is recorded: two admission instances
    following the fleet bucket as `llmgw admission` composes them, an edge, and 24 clients
    sending one-shot chat requests for `m1` through it (`start`) until `apply` stops them."""

    def __init__(self, values: dict[str, Any], nats_url: str) -> None:
        from inproc import Cluster

        from llmgw.state.checker import AuditLog

        self.nats_url = nats_url
        self.config = config_from_dict(values, env={})
        self.audit = AuditLog()
        self.cluster = Cluster(self.config, nats_url, observer_for=self.audit.observer)
        self.mirrors: list[Any] = []
        self.errors: list[str] = []  # the text of every answer but a 200
        self.stop = asyncio.Event()
        self.workers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for _ in range(2):
            self.mirrors.append(await add_following_admission(self.cluster, self.config))
        await self.cluster.balanced()
        edge = await self.cluster.add_edge()
        self.workers = [asyncio.create_task(self._client(edge.url, w)) for w in range(24)]

    async def _client(self, url: str, worker: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                response = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m1",
                        "messages": [{"role": "user", "content": f"w{worker} r{n}"}],
                        "max_tokens": 24,
                    },
                )
                if response.status_code != 200:
                    self.errors.append(response.text[:200])

    async def apply(
        self, values: dict[str, Any], settle: float, *, then_stop: bool = True
    ) -> tuple[int, float]:
        """Apply `values` as `llmgw config apply` does, check that every admission instance
        (both) acknowledged it, let the load run `settle` seconds more, then stop it (unless
        not `then_stop`). (The revision, acknowledged at: time.time.)"""
        from llmgw.services.fleet.apply import apply_file

        nc = await nats.connect(self.nats_url)
        try:
            valid = config_from_dict(values, env={})
            revision, on_it, answering, _ = await apply_file(nc, valid, values, "<test>", wait=10)
        finally:
            await nc.close()
        acknowledged = time.time()
        assert on_it == answering >= 2, (on_it, answering)
        await asyncio.sleep(settle)
        if then_stop:
            self.stop.set()
            await asyncio.gather(*self.workers)
        return revision, acknowledged

    async def close(self, engines: Any) -> None:
        self.stop.set()
        await asyncio.gather(*self.workers, return_exceptions=True)
        await stop_fleet_cluster(self.mirrors, self.cluster, engines, self.nats_url, self.config)
