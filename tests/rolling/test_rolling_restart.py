"""Rolling restarts with nothing lost: every service kind restarted in turn under steady load.

Real processes with the shipped defaults (flow control on): two simulated engines of a managed
provider with small limits and an unlimited provider, two admission instances, a reaper, a
scraper and two edges behind a client-side round robin that skips an edge whose ``/ready`` is
false. Clients keep one conversation each, streamed and non-streamed requests in turn. Each
kind is restarted with SIGTERM and replaced: the edges (a replacement first, as a Deployment
with maxSurge does), the admission instances (the one stopping hands its shards, pins, leases
and queued requests to the other), the reaper, the scraper.

Asserted: no request failed (every answer complete: a 200 with choices, or a stream ending in
[DONE] without an error event); at every sample of the state subject the leases, unreserved
leases and pins of all instances together stayed within the limits, and the quota books in the
bucket's history never added up to more than the limits; once the load stops no lease is left
at any instance or edge (I1); every stopped process exited 0.
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest
from rolling_rig import (
    Balancer,
    Gateway,
    Results,
    admission_states,
    leases_of_edges,
    steady_load,
    watch_limits,
)
from timing import eventually

from llmgw.config import limits_from_config, load_config
from llmgw.state.checker import check_history
from llmgw.state.history import HistoryRecorder

pytestmark = pytest.mark.e2e

SESSIONS = 12


async def _both_serve(nc) -> bool:
    states = await admission_states(nc)
    return len(states) == 2 and all(s.shards for s in states)


SETTINGS = {"drain_delay": "1s", "drain_timeout": "10s"}  # lease_timeout as shipped: 30 s


@pytest.mark.parametrize("gateway", [SETTINGS], indirect=True)
async def test_every_service_kind_restarts_in_turn_under_load_with_no_failed_request(
    gateway, nats_client
):
    config = load_config(gateway.config, env={})
    limits = limits_from_config(config)
    recorder = await HistoryRecorder(nats_client.jetstream(), config.pinning.bucket).start()
    for kind in ("admission", "admission", "scraper", "reaper"):
        gateway.start(kind)
    for service in [s for kinds in gateway.services.values() for s in kinds]:
        await asyncio.to_thread(service.wait_ready)
    await eventually(lambda: _both_serve(nats_client), timeout=20, interval=0.1)
    await asyncio.gather(gateway.started("edge"), gateway.started("edge"))

    results = Results()
    stop = asyncio.Event()
    samples: list = []
    breaches: list[str] = []
    codes: dict[str, int] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        balancer = Balancer(gateway)
        balancer.start(http)
        await eventually(lambda: _edges_ready(gateway, 2), timeout=10, interval=0.1)
        load = asyncio.create_task(steady_load(balancer, http, SESSIONS, stop, results))
        watch = asyncio.create_task(watch_limits(nats_client, limits, stop, samples, breaches))
        await asyncio.sleep(2)  # the load runs before the first restart
        progress = [sum(results.ok.values())]

        for index in range(2):  # edges: the replacement first, then the old one drains
            old = gateway.edges[index]
            await gateway.started("edge")
            codes[f"edge-{index}"] = await gateway.sigterm(old.service)
            gateway.edges.remove(old)
            progress.append(sum(results.ok.values()))
        for index in range(2):  # admission: the stopping one hands over, a new one joins
            old = gateway.services["admission"][0]
            codes[f"admission-{index}"] = await gateway.sigterm(old)
            await gateway.started("admission")
            await eventually(lambda: _both_serve(nats_client), timeout=20, interval=0.1)
            progress.append(sum(results.ok.values()))
        for kind in ("reaper", "scraper"):
            codes[kind] = await gateway.sigterm(gateway.services[kind][0])
            await gateway.started(kind)
            progress.append(sum(results.ok.values()))
        await asyncio.sleep(2)  # and after the last
        stop.set()
        await asyncio.gather(load, watch)
        await balancer.stop()

    assert results.failures == [], results.failures[:10]
    # Steady load really ran, through every phase and over both kinds of request.
    assert all(b > a for a, b in itertools.pairwise(progress)), progress
    assert min(results.ok["stream"], results.ok["plain"]) > 50, results.ok
    assert codes == dict.fromkeys(codes, 0), codes

    assert breaches == [], breaches[:10]
    assert len(samples) > 20
    # The managed provider was really contended: its limit reached at some point.
    g = config.providers[0].models[0].limits.max_global_in_flight_request_slots
    peak = max(
        sum(p.leases for s in states for p in s.pairs if p.provider == "a") for states in samples
    )
    assert peak >= g - 2, peak

    async def nothing_held() -> bool:
        states = await admission_states(nats_client)
        return len(states) == 2 and all(p.leases == 0 for s in states for p in s.pairs)

    # I1: every lease released, none left to expire (that would take lease_timeout, 30 s). A
    # second grant that a new owner made for an attempt asked again across a handover (its edge
    # already had an answer) leaves at that edge's next renewal, every lease_timeout / 3.
    renewal = config.pinning.lease_timeout / 3
    await eventually(nothing_held, timeout=renewal + 5, interval=0.1)
    assert all(not held for held in (await leases_of_edges(nats_client)).values())
    entries = await recorder.sync(timeout=10)
    await recorder.stop()
    violations = check_history(entries, limits)
    assert violations == [], violations[:10]


async def _edges_ready(gateway: Gateway, count: int) -> bool:
    return sum(e.ready for e in gateway.edges) >= count
