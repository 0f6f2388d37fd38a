"""Shared pieces of the live-fleet tests: the local config on a test's own buckets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


async def eventually(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `check()` holds (polled every 10 ms); fails after `timeout`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def engines_values(nats_url: str, urls: dict[str, str], bucket: str) -> dict[str, Any]:
    """Two managed engines (iris) and a third party (tensorx) serving `m1`; iris/m1 has
    G = 8 (R = 2, P = 8, S = 2). No scraper runs: flow control is off."""
    return {
        "nats": {"url": nats_url, "request_timeout": "500ms"},
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
