"""A running reaper (`llmgw reaper`'s `serve`, on its real clocks) judges registrations whose
hosts' clocks are hours off its own: one that heartbeats stays active whether its clock runs
ahead or behind, and one that falls silent is drained after its TTL even with a clock ahead
(when the reaper compared `heartbeat_at` with its own wall clock, the first was drained while
heartbeating and the second never)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fleet_helpers import Leases, local_config
from nats.aio.client import Client as NatsClient
from timing import eventually

from llmgw.config import Config
from llmgw.config.fleet import fleet_bucket
from llmgw.core.fleet import EndpointState
from llmgw.services.fleet.ops import FleetOps
from llmgw.services.reaper.main import serve
from llmgw.state.fleet import FleetBucket, open_fleet

TTL = 1.0  # the shortest a registration may ask for
HOURS = 3 * 3600.0


def registrant(fleet: FleetBucket, config: Config, skew: float) -> FleetOps:
    """`llmgw register`'s side on a host whose clock is `skew` seconds off."""
    return FleetOps(fleet, config, Leases(), wall=lambda: time.time() + skew)


def spec(endpoint_id: str) -> dict[str, object]:
    return {
        "id": endpoint_id,
        "url": "http://127.0.0.1:9",  # never called: no probe, no request
        "provider": "iris",
        "models": ["llama-3.3-70b"],
    }


async def heartbeat(ops: FleetOps, endpoint_id: str, stop: asyncio.Event) -> None:
    """As `llmgw register` does: a heartbeat every TTL/3."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TTL / 3):
                await stop.wait()
        if not stop.is_set():
            await ops.heartbeat(endpoint_id)


async def drained(fleet: FleetBucket, endpoint_id: str, within: float) -> float:
    """Seconds until the reaper drains `endpoint_id`; fails after `within`."""
    started = time.monotonic()

    async def drained_now() -> bool:
        return (await fleet.get(endpoint_id))[0].state is not EndpointState.ACTIVE

    await eventually(drained_now, within, f"{endpoint_id} drained", interval=0.02)
    return time.monotonic() - started


async def test_heartbeats_keep_a_registration_and_silence_drains_it_whatever_its_hosts_clock(
    nats_url: str, unique_id: str, nats_client: NatsClient
) -> None:
    config = local_config(
        nats_url, unique_id, pinning={"bucket": unique_id, "reaper_interval": "100ms"}
    )
    fleet = await open_fleet(nats_client, config)
    ahead, behind = registrant(fleet, config, +HOURS), registrant(fleet, config, -HOURS)
    await ahead.register(spec("ahead"), TTL, probe=False)
    await behind.register(spec("behind"), TTL, probe=False)
    await ahead.register(spec("silent-ahead"), TTL, probe=False)
    stop, reaper_stop, ready = asyncio.Event(), asyncio.Event(), asyncio.Event()
    beats = [
        asyncio.create_task(heartbeat(ahead, "ahead", stop)),
        asyncio.create_task(heartbeat(behind, "behind", stop)),
    ]
    reaper = asyncio.create_task(serve(config, stop=reaper_stop, ready=ready))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        # Silent from the reaper's start: drained once silent for its TTL by the reaper's clock.
        took = await drained(fleet, "silent-ahead", within=TTL + 3.0)
        assert took >= TTL - 0.2, took
        # Another one falls silent now: by its drain the reaper has judged the heartbeating
        # ones for at least two TTLs.
        await behind.register(spec("silent-behind"), TTL, probe=False)
        await drained(fleet, "silent-behind", within=TTL + 3.0)
        states = {i: r.state for i, r in (await fleet.fleet()).records.items()}
        assert states["ahead"] is EndpointState.ACTIVE, states
        assert states["behind"] is EndpointState.ACTIVE, states
    finally:
        stop.set()
        await asyncio.gather(*beats)
        reaper_stop.set()
        async with asyncio.timeout(10):
            await reaper
        with contextlib.suppress(Exception):
            await nats_client.jetstream().delete_key_value(fleet_bucket(config))
