"""NATS outage (invariant I7): the declared modes of `admission.on_nats_outage`, on a real
nats-server that the test stops and starts again, a real admission instance and edge, and an
engine that counts the requests it runs at once (the ground truth for the local limits).

- `reject` (default): while NATS is down every request is answered 503 with Retry-After at
  once (never after the admission budget), and the edge is not ready;
- `local`: the edge serves alone within floor(G / edges) of each pair, refuses beyond it, and
  when NATS returns hands its grants to the shard's owner, which holds them until they end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
from gated import GatedEngine, gated_config
from inproc import Admission, Edge, start_admission, start_edge
from timing import eventually

from llmgw.config import Config
from llmgw.core.fleet import EndpointState
from llmgw.fleet import Fleet, FleetRecord
from llmgw.nats_embedded import EmbeddedNats
from llmgw.services.edge.leases import is_local_lease
from llmgw.services.edge.live import AppliedConfigFollower
from llmgw.services.scraper.main import serve as serve_scraper
from llmgw.serving import RunningServer, free_port, start_server

G = 4  # the managed pair's global slots; one edge, so its local share is all of them


def outage_config(nats_url: str, engine_url: str, mode: str) -> Config:
    return gated_config(
        nats_url, engine_url, g=G, admission={"on_nats_outage": mode, "queue_ttl": "5s"}
    )


@dataclass
class Rig:
    nats: EmbeddedNats
    engine: GatedEngine
    admission: Admission
    edge: Edge


@contextlib.asynccontextmanager
async def running_rig(mode: str, store: Path) -> AsyncIterator[Rig]:
    server = EmbeddedNats(port=free_port(), store_dir=store)
    await server.astart()
    engine = GatedEngine()
    upstream: RunningServer = await start_server(engine)
    config = outage_config(server.url, upstream.url, mode)
    scraped, stop_scraper = asyncio.Event(), asyncio.Event()
    scraper = asyncio.create_task(
        serve_scraper(config, stop=stop_scraper, ready=scraped, instance="scraper-outage")
    )
    await asyncio.wait_for(scraped.wait(), 10)
    admission = await start_admission(config, server.url, instance="adm")
    await eventually(lambda: admission.service.load.reports >= 1, 10, "a load report at admission")
    edge = await start_edge(config, server.url, edge_id="edge-1")
    try:
        yield Rig(server, engine, admission, edge)
    finally:
        engine.gate.set()
        if not server.running:  # stop the services the way they stop in production: connected
            await server.astart()
            await eventually(lambda: edge.nc.is_connected, 15, "reconnected for teardown")
        await edge.stop()
        await admission.stop()
        stop_scraper.set()
        await asyncio.wait_for(scraper, 10)
        await upstream.stop()
        await server.astop()


@pytest_asyncio.fixture
async def reject_rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with running_rig("reject", tmp_path / "store") as rig:
        yield rig


@pytest_asyncio.fixture
async def local_rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with running_rig("local", tmp_path / "store") as rig:
        yield rig


def chat(session: str) -> dict[str, Any]:
    return {
        "json": {"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        "headers": {"x-session-id": session},
    }


async def stop_nats(rig: Rig) -> None:
    await rig.nats.astop()
    await eventually(lambda: not rig.edge.nc.is_connected, 10, "the edge noticed NATS is gone")


async def test_reject_answers_503_with_retry_after_at_once(reject_rig: Rig) -> None:
    rig = reject_rig
    rig.engine.gate.set()
    async with httpx.AsyncClient(base_url=rig.edge.url, timeout=30) as client:
        assert (await client.post("/v1/chat/completions", **chat("s0"))).status_code == 200
        await stop_nats(rig)
        assert not rig.edge.deps.admission.ready()
        for i in range(5):
            started = time.monotonic()
            response = await client.post("/v1/chat/completions", **chat(f"s{i}"))
            took = time.monotonic() - started
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "admission_unavailable"
            # Answered at once: far below the 3 s request timeout and the 5 s queue budget.
            assert took < 1.0, took
    assert rig.engine.served == 1


async def test_local_serves_within_the_share_and_the_owner_takes_the_grants_back(
    local_rig: Rig,
) -> None:
    rig = local_rig
    admission, engine = rig.admission.service, rig.engine
    async with httpx.AsyncClient(base_url=rig.edge.url, timeout=60) as client:
        engine.gate.set()
        assert (await client.post("/v1/chat/completions", **chat("warm"))).status_code == 200
        engine.gate.clear()
        await stop_nats(rig)
        assert rig.edge.deps.admission.ready()  # it can serve: it decides alone

        held = [
            asyncio.create_task(client.post("/v1/chat/completions", **chat(f"s{i}")))
            for i in range(G)
        ]
        await eventually(lambda: engine.running == G, 10, f"{G} local grants at the engine")
        # Beyond the share: refused at once, never sent upstream.
        extra = await client.post("/v1/chat/completions", **chat("one-too-many"))
        assert extra.status_code in (429, 503), extra.text
        assert "cannot reach NATS" in extra.json()["error"]["message"]
        assert engine.peak == G
        leases = rig.edge.deps.leases
        local = [h for h in leases.held.values() if is_local_lease(h.record.lease_id)]
        assert len(local) == G and leases.unclaimed() == G

        # NATS returns (same port, same store): the owner takes the grants into its books.
        await rig.nats.astart()
        await eventually(lambda: rig.edge.nc.is_connected, 15, "the edge reconnected")
        ids = {h.record.lease_id for h in local}
        await eventually(
            lambda: ids <= set(admission.ledger.leases) and leases.unclaimed() == 0,
            15,
            "the shard's owner holds the edge's local grants",
        )
        # While they run, admission counts them: the pair has no room for a fifth request.
        use = admission.ledger.pair_use(("iris", "m1"))
        assert use.leases == G

        engine.gate.set()
        responses = await asyncio.gather(*held)
        assert [r.status_code for r in responses] == [200] * G
        assert all(r.headers["x-llmgw-route"] == "local" for r in responses)
        await eventually(lambda: not (ids & set(admission.ledger.leases)), 10, "released")
        assert rig.edge.deps.admission.budget.in_flight() == 0
        # Back to admission's decisions.
        after = await client.post("/v1/chat/completions", **chat("after"))
        assert after.status_code == 200 and after.headers["x-llmgw-route"] != "local"
    assert engine.peak == G


async def test_local_decides_on_the_fleet_as_the_edge_last_saw_it(local_rig: Rig) -> None:
    """The edge follows the live fleet (services/edge/live.py), so while NATS is down it
    decides on the endpoints the fleet had: one added since the start serves, a drained one
    takes nothing (the file lists only the drained one)."""
    rig = local_rig
    added = GatedEngine()
    added.gate.set()
    upstream = await start_server(added)
    try:
        edge = rig.edge.app.edge
        file_endpoint = edge.config.endpoints[0]
        new = file_endpoint.model_copy(update={"id": "engine-2", "url": upstream.url})
        fleet = Fleet(
            records={
                file_endpoint.id: FleetRecord(endpoint=file_endpoint, state=EndpointState.DRAINING),
                new.id: FleetRecord(endpoint=new),
            },
            revision=3,
        )
        AppliedConfigFollower(edge, edge.config)(fleet)
        await stop_nats(rig)
        async with httpx.AsyncClient(base_url=rig.edge.url, timeout=10) as client:
            for i in range(3):
                response = await client.post("/v1/chat/completions", **chat(f"s{i}"))
                assert response.status_code == 200, response.text
                assert response.headers["x-llmgw-route"] == "local"
                assert response.headers["x-llmgw-endpoint"] == "engine-2"
        assert added.served == 3 and rig.engine.served == 0
    finally:
        await upstream.stop()
