"""Colocated admission (`admission.colocated`): each edge runs an admission instance in its own
process and decides the requests of that instance's shards by a direct call, the others over
NATS. Real parts: a nats-server, a scraper (flow control is on, as shipped), two edges with
their instances on uvicorn, and an engine that counts what it runs at once (the ground truth
for the pair's global limit G across both edges).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio
from gated import GatedEngine, gated_config
from inproc import Admission, Edge, before_any_lease, connect, start_admission
from timing import eventually

from llmgw.config import Config
from llmgw.core.requests import Feature
from llmgw.core.sessions import session_id
from llmgw.core.shards import desired_owner, shard_of
from llmgw.services.edge.app import create_app
from llmgw.services.edge.colocated import ColocatedAdmission
from llmgw.services.edge.main import open_edge_deps
from llmgw.services.scraper.main import serve as serve_scraper
from llmgw.serving import start_server
from llmgw.wire import REQUEST_STATS_SUBJECT, RequestEnded

G = 3  # the pair's global slots in the first test, split between the two instances' quotas
ENGINE_SLOTS = 2  # the engine's batch capacity in the second: flow control queues beyond it
CHAT = "/v1/chat/completions"


def colocated_config(
    nats_url: str, engine_url: str, bucket: str, g: int, capacity: int, per_session: int = 2
) -> Config:
    return gated_config(
        nats_url,
        engine_url,
        g=g,
        capacity=capacity,
        per_session=per_session,
        admission={"colocated": True, "queue_ttl": "10s", "shards": 8},
        pinning={"bucket": bucket, "lease_timeout": "3s"},
        router={"load_bucket": f"load_{bucket}"},
    )


@dataclass
class ColocatedEdge:
    edge: Edge
    instance: Admission

    @property
    def client(self) -> ColocatedAdmission:
        return self.edge.deps.admission

    def owns(self, session: str, shards: int) -> bool:
        return self.instance.service.shards.serves(shard_of(session, shards))


async def start_colocated_edge(config: Config, nats_url: str, name: str) -> ColocatedEdge:
    """An edge as `llmgw edge` composes it with admission.colocated: its instance first."""
    instance = await start_admission(config, nats_url, instance=f"{name}-admission")
    nc = await connect(nats_url, name)
    deps = await open_edge_deps(nc, config, name, colocated=instance.service)
    app = create_app(config, deps)
    return ColocatedEdge(Edge(app, await start_server(app), deps, nc), instance)


@dataclass
class Rig:
    config: Config
    engine: GatedEngine
    edges: list[ColocatedEdge]


@contextlib.asynccontextmanager
async def running_rig(
    nats_url: str, bucket: str, g: int, capacity: int, per_session: int = 2
) -> AsyncIterator[Rig]:
    engine = GatedEngine()
    upstream = await start_server(engine)
    config = colocated_config(nats_url, upstream.url, bucket, g, capacity, per_session)
    scraped, stop_scraper = asyncio.Event(), asyncio.Event()
    scraper = asyncio.create_task(
        serve_scraper(config, stop=stop_scraper, ready=scraped, instance="scraper-coloc")
    )
    await asyncio.wait_for(scraped.wait(), 10)
    with before_any_lease(config):
        edges = [await start_colocated_edge(config, nats_url, f"edge-{i}") for i in range(2)]
    try:
        shards = config.admission.shards

        def balanced() -> bool:
            # Not merely every shard served: a split mid-rebalance (one instance gives a few
            # shards a round) moves shards, and the test's sessions with them, after it starts.
            names = [e.instance.service.instance for e in edges]
            serving = {
                s: e.instance.service.instance
                for e in edges
                for s in e.instance.service.shards.serving
            }
            return all(serving.get(s) == desired_owner(s, names) for s in range(shards))

        await eventually(balanced, 15, "the shards balanced over both instances")
        await eventually(
            lambda: all(e.instance.service.load.reports >= 1 for e in edges), 10, "load reports"
        )
        yield Rig(config, engine, edges)
    finally:
        engine.gate.set()
        for e in edges:
            await e.edge.stop()  # the edge first: its releases reach the owners
            await e.instance.stop()
        stop_scraper.set()
        await asyncio.wait_for(scraper, 10)
        await upstream.stop()


@pytest_asyncio.fixture
async def rig(nats_url: str, unique_id: str) -> AsyncIterator[Rig]:
    async with running_rig(nats_url, f"coloc_{unique_id}", G, capacity=64) as rig:
        yield rig


@pytest_asyncio.fixture
async def queueing_rig(nats_url: str, unique_id: str) -> AsyncIterator[Rig]:
    async with running_rig(nats_url, f"colocq_{unique_id}", 64, capacity=ENGINE_SLOTS) as rig:
        yield rig


@pytest_asyncio.fixture
async def one_per_session_rig(nats_url: str, unique_id: str) -> AsyncIterator[Rig]:
    async with running_rig(nats_url, f"colocs_{unique_id}", G, capacity=64, per_session=1) as rig:
        yield rig


def chat(user: str) -> dict[str, Any]:
    return {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "user": user}


def session_of(user: str) -> str:
    session = session_id(Feature.CHAT, "m1", chat(user))
    assert session is not None
    return session


def leases(rig: Rig) -> int:
    return sum(
        len(e.instance.service.ledger.leases) + len(e.edge.deps.leases.held) for e in rig.edges
    )


async def test_each_edge_decides_its_own_shards_in_process_and_g_holds_across_both(rig: Rig):
    shards = rig.config.admission.shards
    users = [f"user-{i}" for i in range(16)]
    async with httpx.AsyncClient(timeout=30) as http:
        # Every request goes through edge 0 or 1 alternately, whoever owns its shard.
        tasks = [
            asyncio.create_task(http.post(rig.edges[i % 2].edge.url + CHAT, json=chat(u)))
            for i, u in enumerate(users)
        ]
        await eventually(lambda: rig.engine.running == G, 10, "G requests running")
        await asyncio.sleep(0.3)  # the others queue; none may reach the engine
        assert rig.engine.running == G
        rig.engine.gate.set()
        answers = await asyncio.gather(*tasks)
    # Beyond G: queued, or refused where an instance's quota share was spent (never run).
    statuses = [a.status_code for a in answers]
    assert set(statuses) <= {200, 503}, [a.text for a in answers if a.status_code != 200][:2]
    assert all(a.json()["error"]["code"] == "no_capacity" for a in answers if a.status_code != 200)
    assert rig.engine.peak <= G and rig.engine.served == statuses.count(200) >= G
    for index, e in enumerate(rig.edges):
        sent = [u for i, u in enumerate(users) if i % 2 == index]
        own = [u for u in sent if e.owns(session_of(u), shards)]
        assert own and len(own) < len(sent)  # both kinds went through this edge
        assert e.client.decided_here == len(own)  # own shards here, the rest over NATS
    await eventually(lambda: leases(rig) == 0, 10, "every lease ended")


async def test_ends_are_applied_in_process_once_and_still_reach_the_other_instance(rig: Rig):
    """Edge 0 hands its ends to its own instance in process and publishes them for the
    others: its instance applies each exactly once (the NATS copy is ignored), edge 1's
    instance gets every one over NATS, and every lease ends."""
    shards = rig.config.admission.shards
    edge, other = rig.edges
    users = [f"ends-{i}" for i in range(12)]
    own = [u for u in users if edge.owns(session_of(u), shards)]
    assert own and len(own) < len(users)  # leases of both instances end at this edge
    before = [e.instance.service.rates.samples for e in rig.edges]
    rig.engine.gate.set()
    async with httpx.AsyncClient(timeout=30) as http:
        for user in users:  # one at a time: no request is refused for G
            answer = await http.post(edge.edge.url + CHAT, json=chat(user))
            assert answer.status_code == 200, answer.text
    await eventually(lambda: leases(rig) == 0, 10, "every lease ended")
    n = len(users)
    await eventually(
        lambda: other.instance.service.rates.samples == before[1] + n, 10, "the NATS copies"
    )
    # A marker end from another edge, published after the ends on edge 0's connection: once
    # edge 0's instance has it, any copy of edge 0's own ends has been through it too.
    marker = RequestEnded(
        id="marker",
        edge="elsewhere",
        ok=True,
        outcome="success",
        model="m1",
        provider="iris",
        endpoint="engine-1",
        ended_at=time.time(),
    )
    await edge.edge.nc.publish(REQUEST_STATS_SUBJECT, marker.model_dump_json().encode())
    await eventually(
        lambda: edge.instance.service.rates.samples >= before[0] + n + 1, 10, "the marker"
    )
    assert edge.instance.service.rates.samples == before[0] + n + 1  # each end once, no echo


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_sequential_client_with_one_slot_per_session_finds_its_slot_free(
    one_per_session_rig: Rig, stream: bool
):
    """max_per_session_in_flight_request_slots: 1. A client that sends its next request once
    the last one's answer is in (a stream: its end) finds the last one's slot free: the lease
    of an instance in the edge's process is released in the response's turn, before the next
    request is read (services/edge/reporting.py; a stream's attempt ends in the turn its end
    is sent, services/edge/streamed.py). Every request is admitted on its pin at once: none
    waits in a queue, none is sent elsewhere or refused."""
    rig = one_per_session_rig
    rig.engine.gate.set()
    edge = rig.edges[0]
    shards = rig.config.admission.shards
    user = next(u for u in (f"seq-{i}" for i in range(256)) if edge.owns(session_of(u), shards))
    metrics = edge.instance.service.metrics
    waited_before = _observations(metrics.queue_wait)
    # A bare HTTP/1.1 client on one connection: its next request leaves as soon as the last
    # answer is read, within the edge's next event-loop turns (an HTTP client library's own
    # work per request would give the edge time it does not get from a fast client).
    host, port = edge.edge.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({**chat(user), "stream": stream}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    routes = []
    try:
        for _ in range(40):
            writer.write(request)
            status, headers, answer = await asyncio.wait_for(_answer(reader), 10)
            assert status == 200, answer
            routes.append(headers["x-llmgw-route"])
    finally:
        writer.close()
    assert routes == ["new_pin"] + ["pinned"] * 39
    assert _observations(metrics.queue_wait) == waited_before  # no request queued
    assert _by_label(metrics.rejections) == {}
    assert edge.client.decided_here == 40  # all in process
    await eventually(lambda: leases(rig) == 0, 10, "every lease ended")


async def test_a_queued_request_whose_client_leaves_is_cancelled_in_process(queueing_rig: Rig):
    rig = queueing_rig
    shards = rig.config.admission.shards
    edge = rig.edges[0]
    flow = edge.instance.service.flow
    assert flow is not None
    own = iter(u for u in (f"queued-{i}" for i in range(256)) if edge.owns(session_of(u), shards))
    async with httpx.AsyncClient(timeout=30) as http:
        holders = []
        while not len(flow.queues):  # until the engine is busy enough for gold to wait
            assert len(holders) < 4 * ENGINE_SLOTS, "nothing ever queued"
            holders.append(
                asyncio.create_task(http.post(edge.edge.url + CHAT, json=chat(next(own))))
            )
            await eventually(
                lambda: rig.engine.running + len(flow.queues) == len(holders), 10, "placed"
            )
        cancelled = edge.instance.service.metrics.cancellations
        before = _value(cancelled)
        with contextlib.suppress(httpx.ReadTimeout):
            await http.post(edge.edge.url + CHAT, json=chat(next(own)), timeout=1.0)
        await eventually(
            lambda: _value(cancelled) == before + 1, 10, "the queued request cancelled"
        )
        assert len(flow.queues) == 1  # only the holder that waits
        rig.engine.gate.set()
        done = await asyncio.gather(*holders)
    assert [d.status_code for d in done] == [200] * len(holders)
    assert rig.engine.served == len(holders)  # the cancelled one never ran
    assert edge.client.decided_here == len(holders) + 1
    await eventually(lambda: leases(rig) == 0, 10, "every lease ended")


def _value(counter: Any) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _by_label(counter: Any) -> dict[str, float]:
    return {
        str(s.labels): s.value
        for m in counter.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.value
    }


def _observations(histogram: Any) -> float:
    return sum(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer, with a content-length or chunked: its status, headers and body."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in head[1:] if line)
    status = int(head[0].split()[1])
    if headers.get("transfer-encoding") != "chunked":
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)  # the empty line after the last chunk
    return status, headers, body
