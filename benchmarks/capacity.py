"""Capacity planning: the per-request NATS traffic model of docs/capacity.md, checked on a real
run, and what one core of each service sustains.

    python benchmarks/capacity.py count [--requests 400] [--sessions 40] [--admissions 2]
    python benchmarks/capacity.py throughput [--seconds 8] [--concurrency 32]
    python benchmarks/capacity.py ends
    python benchmarks/capacity.py estimate [--rps 10000] [--sessions 100000]

``count`` starts the real processes (nats-server, a zero-delay engine, a scraper, N admission
instances, an edge; benchmarks/cluster.py), subscribes to every subject (``>``) on the server,
sends requests over sessions and classifies every message by subject (`classify`): per request
it reports what the model (`PER_REQUEST`, `PER_NEW_SESSION`) says and what was counted.
``throughput`` drives the same topology at a fixed concurrency with the three gateway
processes on one CPU and reports requests per CPU-second of the edge, of admission and of
nats-server: what one core of each sustains. ``ends`` times an instance's handling of another
instance's request end (the one broadcast whose cost grows with instances). ``estimate`` prints the sizing of docs/capacity.md
from the model (`estimate`), so the document and this file cannot disagree unseen
(tests/capacity/test_capacity_counts.py checks both the counts and the document's table).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import nats

from llmgw.wire import ADMISSION_STATE_SUBJECT, StateReply


def _load(name: str):  # type: ignore[no-untyped-def]
    """A sibling benchmark module by path (tests import this file; `cluster` is a common name)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"llmgw_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_cluster = _load("cluster")
cpu_seconds, running_cluster = _cluster.cpu_seconds, _cluster.running_cluster

ROUTING = "llmgw_routing"  # the default bucket names (the benchmark config keeps them)
LOAD = "llmgw_load"
SPEND = "llmgw_spend"

# ---- the model ------------------------------------------------------------------------------

# Messages on the NATS server per admitted request (no retry, nothing queued), by subject class.
# admission.load: the instance's live-lease count per endpoint (FlowLoad) goes out when it
# changes (grant, end), batched per event-loop turn, and only while more than one instance runs:
# at most 2 per request, each delivered to the other instances.
PER_REQUEST = {
    "admission.request": 1,  # edge -> the shard's owner
    "admission.reply": 1,  # owner -> edge inbox (AdmitReply)
    "stats.request": 1,  # edge -> every instance (RequestEnded: release + balancer sample)
    "admission.load": 2,  # upper bound with 2+ instances; 0 with one
}
# Extra per request of a session seen for the first time (its pin is created).
PER_NEW_SESSION = {
    # the pin's put in the routing bucket (in the background: PinWriter), at most: made once
    # the session sends a second request, or a refresh period (75 s) after its first
    "kv.pin": 1,
    "events.pin": 1,  # llmgw.v1.events.pin.created
}
# Bytes (measured by `count`): a pin's key and value in the routing bucket.
PIN_KEY_BYTES = 56
PIN_VALUE_BYTES = 213


def classify(subject: str, data: bytes) -> str:
    """The subject class of one message (the model's vocabulary)."""
    if subject.startswith("llmgw.v1."):
        parts = subject.split(".")
        if parts[2] == "events":
            return f"events.{parts[3]}"
        if parts[2] == "admission" and parts[3] in ("request", "leases"):
            return f"admission.{parts[3]}"
        return ".".join(parts[2:4])
    if subject.startswith(f"$KV.{ROUTING}."):
        return "kv." + subject.split(".")[2]
    if subject.startswith(f"$KV.{LOAD}_fleet."):
        return "kv.fleet"
    if subject.startswith(f"$KV.{LOAD}."):
        return "kv.load"
    if subject.startswith(f"$KV.{SPEND}."):
        return "kv.spend"
    if subject.startswith("_INBOX."):
        try:
            body = json.loads(data)
        except ValueError:
            return "inbox.other"
        if isinstance(body, dict) and "status" in body and "id" in body:
            return "admission.reply"
        return "inbox.other"
    if subject.startswith("$JS."):
        return "js.api" if subject.startswith("$JS.API") else "js.ack"
    return "other"


@dataclass(frozen=True)
class Deployment:
    """The assumptions of docs/capacity.md's sizing."""

    rps: float = 10_000  # admitted requests per second, all edges together
    sessions: int = 100_000  # live sessions (each with a pin)
    new_sessions_per_s: float = 100  # 100,000 sessions living ~17 min each
    mean_request_s: float = 2.0  # a request's duration (streams of ~100 tokens)
    edges: int = 12
    admissions: int = 8
    shards: int = 32
    lease_timeout: float = 30.0
    heartbeat: float = 1.0
    pin_inactivity_timeout: float = 300.0
    endpoints: int = 200
    scrape_interval: float = 2.0
    replicas: int = 3


def estimate(d: Deployment) -> dict[str, float]:
    """Messages per second by subject class, KV keys and bytes, and watchers, for `d`."""
    live_leases = d.rps * d.mean_request_s
    edge_shards = d.edges * min(d.shards, live_leases / d.edges)  # (edge, shard) pairs leasing
    peers = d.admissions - 1
    out = {
        "admission.request": d.rps * PER_REQUEST["admission.request"],
        "admission.reply": d.rps * PER_REQUEST["admission.reply"],
        "stats.request (published)": d.rps * PER_REQUEST["stats.request"],
        "stats.request (delivered)": d.rps * PER_REQUEST["stats.request"] * d.admissions,
        "admission.load (published, at most)": d.rps * PER_REQUEST["admission.load"],
        "admission.load (delivered, at most)": d.rps * PER_REQUEST["admission.load"] * peers,
        "admission.leases (renewals + replies)": 2 * edge_shards / (d.lease_timeout / 3),
        "kv.pin writes": d.new_sessions_per_s * PER_NEW_SESSION["kv.pin"]
        + d.sessions / (d.pin_inactivity_timeout / 4),
        "kv.member writes": d.admissions / d.heartbeat,
        "kv.load writes": d.endpoints / d.scrape_interval,
        "events.pin": d.new_sessions_per_s * PER_NEW_SESSION["events.pin"],
        "live leases (memory only)": live_leases,
        "KV keys (pins)": d.sessions,
        "KV bytes (pins, one replica)": d.sessions * (PIN_KEY_BYTES + PIN_VALUE_BYTES),
        "watchers (KV watches)": d.admissions * 3,  # member., shard., quota. keys
        "watchers (load bucket)": d.admissions,
    }
    return out


def per_request_table() -> str:
    """The model's per-request counts as the Markdown rows docs/capacity.md shows."""
    rows = [f"| `{k}` | {v} | per admitted request |" for k, v in PER_REQUEST.items()]
    rows += [f"| `{k}` | {v} | per new session |" for k, v in PER_NEW_SESSION.items()]
    return "\n".join(rows)


# ---- counting on a real run -------------------------------------------------------------------


@dataclass
class CountResult:
    requests: int
    sessions: int
    admissions: int
    seconds: float
    counts: Counter
    pin_key_bytes: float
    pin_value_bytes: float

    def per_request(self, name: str) -> float:
        return self.counts[name] / self.requests


def body(session: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": "bench-model",
            "messages": [{"role": "user", "content": f"hello {session}"}],
            "max_tokens": 5,
            "stream": stream,
        }
    ).encode()


async def _send(http, url: str, sessions: int, requests: int, concurrency: int) -> None:  # type: ignore[no-untyped-def]
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            session = i % sessions
            async with http.post(
                url + "/v1/chat/completions",
                data=body(session, i % 2 == 0),
                headers={"content-type": "application/json", "x-session-id": f"s{session}"},
            ) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"request failed: {r.status} {await r.text()}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _balanced(nc, admissions: int, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    """Until `admissions` instances answer on the state subject, all 32 shards served once."""
    deadline = time.monotonic() + timeout
    while True:
        replies: list[StateReply] = []
        inbox = nc.new_inbox()

        async def collect(msg, replies=replies) -> None:  # type: ignore[no-untyped-def]
            replies.append(StateReply.model_validate_json(msg.data))

        sub = await nc.subscribe(inbox, cb=collect)
        await nc.publish(ADMISSION_STATE_SUBJECT, b"", reply=inbox)
        await asyncio.sleep(0.3)
        await sub.unsubscribe()
        served = sorted(s for r in replies for s in r.shards)
        if (
            len(replies) == admissions
            and all(r.shards for r in replies)
            and served == list(range(32))
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"admission instances not balanced: {len(replies)} answered")


async def count_on(nats_url: str, edge_url: str, requests: int, sessions: int, admissions: int):  # type: ignore[no-untyped-def]
    counts: Counter = Counter()
    pin_sizes: list[tuple[int, int]] = []

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        kind = classify(msg.subject, msg.data)
        counts[kind] += 1
        if kind == "kv.pin":
            pin_sizes.append((len(msg.subject) - len(f"$KV.{ROUTING}."), len(msg.data)))

    nc = await nats.connect(nats_url)
    # Counted only once the shards have settled: a subscriber on `>` is a responder for every
    # subject, so while a shard moves between instances the edges' requests for it get no
    # "no responders" answer (which makes them ask again at once) but wait out their timeout.
    await _balanced(nc, admissions)
    await nc.subscribe(">", cb=on_msg)
    await nc.flush()
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        await _send(http, edge_url, sessions, requests, concurrency=8)
    await asyncio.sleep(1.0)  # the last ends, pin writes and gossip arrive
    seconds = time.monotonic() - started
    await nc.drain()
    keys = sum(k for k, _ in pin_sizes) / max(1, len(pin_sizes))
    values = sum(v for _, v in pin_sizes) / max(1, len(pin_sizes))
    return CountResult(requests, sessions, admissions, seconds, counts, keys, values)


def count(requests: int, sessions: int, admissions: int) -> CountResult:
    """A real run's message counts (see the module docstring)."""
    with running_cluster({0, 1}, {0, 1}, flow=True, admissions=admissions) as cluster:
        assert cluster.nats is not None
        return asyncio.run(
            count_on(cluster.nats.url, cluster.edge_url, requests, sessions, admissions)
        )


def print_count(result: CountResult) -> None:
    print(
        f"{result.requests} requests over {result.sessions} sessions, "
        f"{result.admissions} admission instances, {result.seconds:.1f} s"
    )
    print("| subject class | model | counted per request |")
    print("|---|---|---|")
    for name, value in PER_REQUEST.items():
        print(f"| `{name}` | {value} | {result.per_request(name):.3f} |")
    for name, value in PER_NEW_SESSION.items():
        counted = result.counts[name] / result.sessions
        print(f"| `{name}` | {value} per new session | {counted:.3f} per session |")
    print(f"pin key {result.pin_key_bytes:.0f} B, value {result.pin_value_bytes:.0f} B")
    print("every class:", dict(sorted(result.counts.items())))


# ---- throughput per core ----------------------------------------------------------------------


async def _drive(url: str, seconds: float, concurrency: int) -> int:
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        nonlocal done
        i = index
        while time.monotonic() < deadline:
            async with http.post(
                url + "/v1/chat/completions",
                data=body(i % 256, False),
                headers={"content-type": "application/json", "x-session-id": f"s{i % 256}"},
            ) as r:
                await r.read()
                done += r.status == 200
            i += concurrency

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done


def throughput(seconds: float, concurrency: int, rounds: int) -> None:
    """Requests per CPU-second of each gateway process, gateway on CPU 1, load on CPU 0."""
    print(
        "| round | requests/s | edge req per CPU-s | admission req per CPU-s | nats req per CPU-s |"
    )
    print("|---|---|---|---|---|")
    with running_cluster({1}, {0}, flow=True) as cluster:
        assert cluster.nats is not None
        pids = {
            "edge": cluster.procs["edge"].pid,
            "admission": cluster.procs["admission"].pid,
            "nats": cluster.nats.pid,
        }
        asyncio.run(_drive(cluster.edge_url, 2, concurrency))  # warm-up
        for index in range(rounds):
            before = {k: cpu_seconds([p]) for k, p in pids.items()}
            started = time.monotonic()
            done = asyncio.run(_drive(cluster.edge_url, seconds, concurrency))
            elapsed = time.monotonic() - started
            used = {k: cpu_seconds([p]) - before[k] for k, p in pids.items()}
            per = {k: done / v if v > 0 else math.inf for k, v in used.items()}
            print(
                f"| {index + 1} | {done / elapsed:.0f} | {per['edge']:.0f} | "
                f"{per['admission']:.0f} | {per['nats']:.0f} |"
            )


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data


async def _ends(n: int) -> float:
    from llmgw.config import config_from_dict
    from llmgw.services.admission.service import AdmissionService
    from llmgw.wire import RequestEnded

    raw = _cluster._config("nats://127.0.0.1:1", "http://127.0.0.1:1", 1, 2, True)
    config = config_from_dict(raw, source="<bench>", env={})
    service = AdmissionService(config, None, None, instance="bench")  # type: ignore[arg-type]
    ended = RequestEnded(
        id="x" * 32,
        edge="edge-1",
        lease="0123456789abcdef",
        shard=3,
        ok=True,
        outcome="success",
        model="bench-model",
        served_model="bench-model",
        provider="local",
        endpoint="engine-1",
        route="pinned",
        tenant="t" * 16,
        ended_at=time.time(),
        latency=0.5,
        sent=True,
        input_tokens=20,
        output_tokens=100,
        status=200,
    )
    msg = _Msg(ended.model_dump_json().encode())
    started = time.perf_counter()
    for _ in range(n):
        await service.on_request_ended(msg)  # type: ignore[arg-type]
    return (time.perf_counter() - started) / n


def ends(n: int) -> None:
    """Microseconds an instance spends on another instance's RequestEnded (every instance gets
    every request's end: the broadcast that grows with the number of instances). Handler only,
    without nats-py's own per-message cost."""
    for _ in range(3):
        print(f"{asyncio.run(_ends(n)) * 1e6:.1f} us per RequestEnded of another instance")


def print_estimate(d: Deployment) -> None:
    print(f"{d}")
    print("| quantity | value |")
    print("|---|---|")
    for name, value in estimate(d).items():
        print(f"| {name} | {value:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("count")
    c.add_argument("--requests", type=int, default=400)
    c.add_argument("--sessions", type=int, default=40)
    c.add_argument("--admissions", type=int, default=2)
    t = sub.add_parser("throughput")
    t.add_argument("--seconds", type=float, default=8)
    t.add_argument("--concurrency", type=int, default=32)
    t.add_argument("--rounds", type=int, default=3)
    n = sub.add_parser("ends")
    n.add_argument("--n", type=int, default=20_000)
    e = sub.add_parser("estimate")
    e.add_argument("--rps", type=float, default=10_000)
    e.add_argument("--sessions", type=int, default=100_000)
    args = parser.parse_args()
    if args.command == "count":
        print_count(count(args.requests, args.sessions, args.admissions))
    elif args.command == "throughput":
        throughput(args.seconds, args.concurrency, args.rounds)
    elif args.command == "ends":
        ends(args.n)
    else:
        print_estimate(Deployment(rps=args.rps, sessions=args.sessions))


if __name__ == "__main__":
    main()
