"""The mesh on a three-node NATS cluster with every bucket on three replicas (R3).

1. The chaos run of test_concurrency (four admission instances that die, leave and join, two
   edges, degraded providers, failing engines, cancelled streams), shortened, passes the
   history and audit checkers on R3.
2. One NATS node is SIGKILLed under steady load: the node that leads the routing bucket's
   stream. Components (an edge and an admission instance per node) are spread over the nodes
   (each talks to the first server of its list and moves to the next when it fails), so an
   edge and an admission instance lose their server. No request fails, not even one in flight
   on a connection to the dead node (running at the kill, through the edge connected there or
   its shard's owner there: its admission ask or answer may die in that connection's buffers):
   the edge asks again for an attempt without an answer and
   admission answers an attempt it knows the same way (tests/flow/test_asked_again.py); a
   request that reaches that edge while it reconnects waits for the reconnection. Requests
   keep being routed while the routing bucket elects a new leader (decisions need no KV write)
   and while the node rejoins; I1-I3 hold (audit trail and bucket history); the node restarts
   with its store and catches up with the stream. The test's own calls into the cluster run
   off the event loop: every component shares it, and a blocking call would stall them all.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
import pytest
from inproc import connect
from mesh import MODEL, start_mesh
from test_concurrency import _quiet, _run
from timing import eventually

from llmgw.core.requests import Feature
from llmgw.core.sessions import session_id
from llmgw.core.shards import shard_of
from llmgw.nats_cluster import EmbeddedNatsCluster
from llmgw.state.checker import check_audit, check_history
from llmgw.state.history import HistoryRecorder

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]


@pytest.fixture(scope="module")
def r3():
    with EmbeddedNatsCluster(kill_with_parent=True) as cluster:
        yield cluster


async def test_the_mesh_chaos_run_passes_the_checkers_on_three_replicas(r3, unique_id):
    client = await connect(r3.url, "checker")
    try:
        violations, outcomes, held, entries, chaos_log, mesh = await _run(
            client, r3.url, unique_id, 8, replicas=3
        )
    finally:
        await client.close()
    assert violations == [], "\n".join(str(v) for v in violations[:20])
    assert mesh.config.replicas_of(mesh.config.pinning.bucket) == 3
    grants = [e for e in mesh.audit.events if e.kind == "granted"]
    assert len(grants) > 300 and outcomes[200] > 300, (len(grants), outcomes)
    # The churn happened: an instance killed, one stopped, two joined (shards moved each time).
    assert [line.split()[0] for line in chaos_log if line.split()[0] in ("killed", "stopped")] == [
        "killed",
        "stopped",
    ]
    assert held == 0 and len(entries) > 50


@dataclass
class Done:
    edge: int
    session: str
    started: float
    ended: float
    ok: bool
    detail: str


async def _load(mesh, http, sessions: int, stop: asyncio.Event, done: list[Done]) -> None:
    async def client(index: int) -> None:
        rng = random.Random(index)
        session = f"conversation-{index}"
        while not stop.is_set():
            edge = index % len(mesh.edges)
            stream = rng.random() < 0.5
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"hello {index}"}],
                "max_tokens": rng.randint(1, 25),
                "stream": stream,
            }
            started = time.monotonic()
            ok, detail = False, ""
            try:
                async with http.post(
                    mesh.edges[edge].url + "/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": session},
                ) as r:
                    payload = await r.read()
                    ok = r.status == 200 and (not stream or payload.rstrip().endswith(b"[DONE]"))
                    detail = f"{r.status} {payload[-160:]!r}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                detail = repr(exc)
            done.append(Done(edge, session, started, time.monotonic(), ok, detail))
            await asyncio.sleep(rng.uniform(0, 0.05))

    await asyncio.gather(*(client(i) for i in range(sessions)))


async def _reconnected(nc, port: int, since: float) -> float:
    """When `nc` was connected again to a server other than the one on `port`."""
    await eventually(  # nats-py has no such event
        lambda: nc.is_connected and nc.connected_url and nc.connected_url.port != port,
        60,
        "connected to another server",
        interval=0.005,
    )
    return time.monotonic() - since


async def test_losing_the_routing_stream_leader_fails_only_requests_in_flight_on_it(r3, unique_id):
    bucket = f"nodeloss_{unique_id}"
    # The shipped membership timing: member_ttl outlasts a stream election (4-9 s).
    mesh = await start_mesh(
        r3.url, bucket, admissions=3, edges=3, replicas=3, heartbeat="1s", member_ttl="15s"
    )
    stream = f"KV_{bucket}"
    observer = await connect(r3.url, "observer")
    try:
        await mesh.cluster.balanced()
        leader = r3.stream_leader(stream)
        assert leader is not None
        info = await observer.jetstream().stream_info(stream)
        assert info.config.num_replicas == 3
        # The recorder talks to a surviving node, so it sees every write through the failover.
        survivor = next(i for i in range(3) if i != leader)
        recorder_nc = await connect(r3.nodes[survivor].url, "recorder")
        recorder = await HistoryRecorder(recorder_nc.jetstream(), bucket).start()
        port = r3.nodes[leader].client_port
        on_dead = {
            name: nc
            for name, nc in [
                *((f"edge-{i}", e.nc) for i, e in enumerate(mesh.edges)),
                *((a.service.instance, a.nc) for a in mesh.cluster.admissions),
            ]
            if nc.connected_url.port == port
        }
        assert any(n.startswith("edge") for n in on_dead), on_dead
        assert any(not n.startswith("edge") for n in on_dead), on_dead

        stop = asyncio.Event()
        done: list[Done] = []
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            load = asyncio.create_task(_load(mesh, http, 24, stop, done))
            await asyncio.sleep(3)  # the load runs on the whole cluster before the kill
            owners = {s: a.instance for a in mesh.admissions for s in a.shards.serving}
            killing = time.monotonic()
            await asyncio.to_thread(r3.kill, leader)
            killed = time.monotonic()
            windows = dict(
                zip(
                    on_dead,
                    await asyncio.gather(
                        *(_reconnected(nc, port, killed) for nc in on_dead.values())
                    ),
                    strict=True,
                )
            )
            await asyncio.sleep(6)  # through the election and well past it
            # A new leader (the election may outlast the sleep on a loaded host).
            new_leader = await asyncio.to_thread(r3.stream_leader, stream)
            deadline = time.monotonic() + 15
            while new_leader is None and time.monotonic() < deadline:
                new_leader = await asyncio.to_thread(r3.stream_leader, stream)
            rejoin = time.monotonic()
            await r3.arestart(leader)
            await asyncio.sleep(2)  # and on after the node's restart
            stop.set()
            await load
        await mesh.drain_edges()
        await _quiet(mesh, mesh.config.pinning.lease_timeout + 5)
        held = sum(len(edge.deps.leases.held) for edge in mesh.edges)
        entries = await recorder.sync(timeout=15)

        def caught_up() -> bool:
            info = r3.stream_info(stream) or {}
            last = (info.get("state") or {}).get("last_seq")
            replicas = {r["name"]: r for r in (info.get("cluster") or {}).get("replicas") or []}
            current = replicas.get(r3.nodes[leader].name, {}).get("current")
            return bool(current) and r3.replica_last_seq(leader, stream) == last

        await eventually(
            lambda: asyncio.to_thread(caught_up), 15, "the restarted node caught up", interval=0.2
        )
        await recorder.stop()
        await recorder_nc.close()
        asked_again = sum(edge.deps.admission.asked_again for edge in mesh.edges)
    finally:
        await observer.close()
        await mesh.stop()

    shards = mesh.config.admission.shards

    def owner(d: Done) -> str | None:
        """The instance that owned the request's shard (the edge's session id, not the header)."""
        return owners.get(
            shard_of(session_id(Feature.CHAT, MODEL, {}, header_key=d.session), shards)
        )

    def in_flight_on_dead_node(d: Done) -> bool:
        """Running at the kill, through the edge on the killed node or its shard's owner there
        (the requests that could have failed)."""
        through = {f"edge-{d.edge}", owner(d)} & on_dead.keys()
        return bool(through) and d.started <= killed and d.ended >= killing

    failed = [d for d in done if not d.ok]
    assert failed == [], (
        f"{asked_again} asks again",
        [
            (d.edge, owner(d), d.started - killed, in_flight_on_dead_node(d), d.detail)
            for d in failed
        ][:10],
    )
    # Routing went on while the routing bucket had no leader (an election takes seconds).
    during = Counter(d.ok for d in done if killed + 0.5 < d.started < killed + 3)
    assert during[True] > 50, during
    assert new_leader not in (None, leader)
    # The load went on through the node's rejoin.
    assert sum(d.ok for d in done if d.started >= rejoin) > 50
    assert sum(d.ok for d in done) > 500 and max(windows.values()) < 2, windows
    violations = check_history(entries, mesh.limits) + check_audit(
        mesh.audit.events, mesh.limits, lease_timeout=mesh.config.pinning.lease_timeout
    )
    assert violations == [], "\n".join(str(v) for v in violations[:20])
    assert held == 0  # I1
