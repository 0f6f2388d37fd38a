"""Admission decisions: latency at concurrency 1 and sustained decisions per second, with 1 and 2
admission instances (session shards split between them, ADR 0002).

    python benchmarks/admission.py [--rounds 3] [--workers 1,2] [--requests 8000]

Topology (per run): a real nats-server, a zero-delay `llmgw sim engine`, `llmgw scraper` (flow
control is on, as shipped, and needs its load reports) and N `llmgw admission` processes, all
started through the CLI with one generated config (one managed provider/model with limits that
rarely refuse: G=512, R=64, P=5000, S=4; a fresh routing bucket per run). This process plays the
edges: it sends `AdmitRequest`s to the owner of each session's shard
(`llmgw.v1.admission.request.<shard>`), times each until its `AdmitReply` is parsed, and ends
every granted lease with the `RequestEnded` an edge publishes after the response. Sessions come
from a pool of 2,000 (a warm-up pins each); each request picks one at random and, with
probability 0.1, replaces it by a fresh one first (a new conversation: a new pin).

Per run: a latency phase (500 decisions at concurrency 1, each lease ended before the next; the
p50 of a new conversation's first decision, which creates its pin, is shown next to a returning
session's), then
a sustained phase (`--requests` decisions with 32 in flight). CPUs: nats-server and the admission
instances share CPU 1; this process, the engine and the scraper CPU 0. "Service CPU" is the user
+ system time of the admission instances and nats-server in the sustained phase per decision.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats
import nats.errors
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from cluster import ZERO_DELAY, cpu_seconds, pin_process, start_process, wait_ready
from measure import pct

from llmgw.core.shards import shard_of
from llmgw.nats_embedded import EmbeddedNats
from llmgw.serving import free_port
from llmgw.wire import (
    ADMISSION_HEALTH_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitReply,
    AdmitRequest,
    HealthReply,
    ReplyStatus,
    RequestEnded,
    admission_subject,
)

SERVICE_CPUS = {1}
CLIENT_CPUS = {0}
SHARDS = 32
POOL = 2000
NEW_CONVERSATION = 0.1


def config(nats_url: str, engine_url: str, bucket: str) -> dict:
    return {
        "nats": {"url": nats_url},
        "router": {"scrape_interval": "500ms", "load_bucket": f"load_{bucket}"},
        "pinning": {"bucket": bucket},
        "admission": {"shards": SHARDS},
        "models": [{"name": "bench-model"}],
        "providers": [
            {
                "id": "local",
                "kind": "managed",
                "models": [
                    {
                        "name": "bench-model",
                        "limits": {
                            "max_pinned_sessions": 5000,
                            "max_global_in_flight_request_slots": 512,
                            "global_in_flight_request_slots_reserved_for_pinned_sessions": 64,
                            "max_per_session_in_flight_request_slots": 4,
                        },
                    }
                ],
            }
        ],
        "endpoints": [
            {
                "id": "engine-1",
                "url": engine_url,
                "provider": "local",
                "models": ["bench-model"],
                "capacity": 512,
            }
        ],
    }


class Edges:
    """The benchmark's edge: admission requests to each shard's owner, ends as edges send them."""

    def __init__(self, nc: nats.NATS, rng: random.Random) -> None:
        self.nc = nc
        self.rng = rng
        self.pool = [self._session() for _ in range(POOL)]
        self.ids = 0
        self.refused = 0
        self.no_responders = 0

    def _session(self) -> str:
        return self.rng.randbytes(16).hex()

    def pick(self) -> str:
        index = self.rng.randrange(POOL)
        if self.rng.random() < NEW_CONVERSATION:
            self.pool[index] = self._session()
        return self.pool[index]

    async def decide(self, session: str) -> tuple[float, AdmitReply]:
        self.ids += 1
        shard = shard_of(session, SHARDS)
        request = AdmitRequest(
            id=f"b{self.ids}",
            edge="bench-edge",
            model="bench-model",
            feature="chat",
            shard=shard,
            session=session,
        )
        payload = request.model_dump_json(exclude_defaults=True).encode()
        started = time.perf_counter()
        for _ in range(200):  # as the edge does: nobody serves the shard yet, ask again shortly
            try:
                msg = await self.nc.request(admission_subject(shard), payload, timeout=10)
            except nats.errors.NoRespondersError:
                self.no_responders += 1
                await asyncio.sleep(0.01)
                continue
            reply = AdmitReply.model_validate_json(msg.data)
            if reply.refusal is not None and reply.refusal.value == "not_owner":
                await asyncio.sleep(0.01)
                continue
            return time.perf_counter() - started, reply
        raise RuntimeError(f"shard {shard} unserved for 2 s")

    async def end(self, reply: AdmitReply) -> None:
        if reply.status is not ReplyStatus.ADMITTED or reply.lease is None:
            self.refused += 1
            return
        lease, target = reply.lease, reply.target
        assert target is not None
        ended = RequestEnded(
            id=reply.id,
            edge="bench-edge",
            lease=lease.lease_id,
            shard=lease.shard,
            refresh=reply.refresh,
            ok=True,
            outcome="success",
            model="bench-model",
            provider=target.provider,
            endpoint=target.endpoint,
            route=reply.route,
            ended_at=time.time(),
            latency=0.001,
        )
        await self.nc.publish(REQUEST_STATS_SUBJECT, ended.model_dump_json().encode())


async def serving_instances(nc: nats.NATS, workers: int, timeout: float = 60) -> None:
    """Until `workers` instances answer and serve all shards between them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(ADMISSION_HEALTH_SUBJECT, b"", reply=inbox)
        replies = []
        with_timeout = time.monotonic() + 0.5
        while time.monotonic() < with_timeout:
            try:
                msg = await sub.next_msg(timeout=max(0.01, with_timeout - time.monotonic()))
            except Exception:
                break
            replies.append(HealthReply.model_validate_json(msg.data))
        await sub.unsubscribe()
        if len(replies) == workers and sum(r.shards for r in replies) == SHARDS:
            if workers == 1 or all(r.shards > 0 for r in replies):
                return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{workers} admission instances did not settle")


async def measure(nats_url: str, pids: list[int], workers: int, requests: int) -> dict:
    nc = await nats.connect(nats_url)
    edges = Edges(nc, random.Random(7))
    try:
        await serving_instances(nc, workers)
        for session in edges.pool:  # warm-up: every pool session pinned
            _, reply = await edges.decide(session)
            await edges.end(reply)
        latencies = []
        by_route: dict[str | None, list[float]] = {}
        for _ in range(500):
            took, reply = await edges.decide(edges.pick())
            latencies.append(took)
            by_route.setdefault(reply.route, []).append(took)
            await edges.end(reply)
        await nc.flush()
        todo = iter(range(requests))

        async def worker() -> None:
            for _ in todo:
                _, reply = await edges.decide(edges.pick())
                await edges.end(reply)

        before = cpu_seconds(pids)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        elapsed = time.perf_counter() - started
        used = cpu_seconds(pids) - before
        return {
            "p50": pct(latencies, 0.5),
            "p99": pct(latencies, 0.99),
            # A new conversation's first request (creates the pin) against a returning one.
            "new": pct(by_route.get("new_pin", [0.0]), 0.5),
            "returning": pct(by_route.get("pinned", [0.0]), 0.5),
            "rate": requests / elapsed,
            "cpu": used / requests,
            "refused": edges.refused,
        }
    finally:
        await nc.close()


def run_once(workers: int, requests: int, round_no: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-admission-bench-") as tmp:
        logdir = Path(tmp)
        server = EmbeddedNats().start()
        pin_process(server.pid, SERVICE_CPUS)
        procs = []
        try:
            engine_port = free_port()
            engine_url = f"http://127.0.0.1:{engine_port}"
            path = logdir / "bench.yaml"
            path.write_text(yaml.safe_dump(config(server.url, engine_url, f"bench_{round_no}")))
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            cli = [sys.executable, "-m", "llmgw"]
            sim = [f"--set={s}" for s in ZERO_DELAY]
            engine_cmd = [*cli, "sim", "engine", "--port", str(engine_port), "--model"]
            engine = start_process(
                "engine", [*engine_cmd, "bench-model", *sim], CLIENT_CPUS, logdir, env
            )
            procs.append(engine)
            wait_ready(engine, "ready")
            scraper = start_process(
                "scraper", [*cli, "scraper", "--config", str(path)], CLIENT_CPUS, logdir, env
            )
            procs.append(scraper)
            wait_ready(scraper, "ready")
            admissions = []
            for i in range(workers):
                admission = start_process(
                    f"admission-{i}",
                    [*cli, "admission", "--config", str(path)],
                    SERVICE_CPUS,
                    logdir,
                    env,
                )
                procs.append(admission)
                admissions.append(admission)
            for admission in admissions:
                wait_ready(admission, "ready")
            pids = [a.pid for a in admissions] + [server.pid]
            return asyncio.run(measure(server.url, pids, workers, requests))
        finally:
            for proc in reversed(procs):
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.popen.wait(15)
                except Exception:
                    proc.popen.kill()
            server.stop()


def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return (
        f"{statistics.median(values) * scale:.{digits}f} "
        f"[{min(values) * scale:.{digits}f}..{max(values) * scale:.{digits}f}]"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--requests", type=int, default=8000)
    args = parser.parse_args()
    os.sched_setaffinity(0, CLIENT_CPUS)
    counts = [int(w) for w in args.workers.split(",")]
    results: dict[int, list[dict]] = {w: [] for w in counts}
    for round_no in range(args.rounds):
        order = counts[round_no % len(counts) :] + counts[: round_no % len(counts)]
        for workers in order:
            results[workers].append(run_once(workers, args.requests, round_no))
        print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    print(f"\n{args.rounds} rounds; median [min..max] over rounds\n")
    print(
        "| instances | decision p50 ms (c=1) | decision p99 ms (c=1) | p50 new session / "
        "returning ms | decisions/s (32 in flight) | service CPU ms / decision | refused |"
    )
    print("|---|---|---|---|---|---|---|")
    for workers, runs in results.items():
        print(
            f"| {workers} | {fmt([r['p50'] for r in runs], 1e3)} | "
            f"{fmt([r['p99'] for r in runs], 1e3)} | "
            f"{fmt([r['new'] for r in runs], 1e3)} / {fmt([r['returning'] for r in runs], 1e3)} | "
            f"{fmt([r['rate'] for r in runs], 1, 0)} | "
            f"{fmt([r['cpu'] for r in runs], 1e3, 3)} | {sum(r['refused'] for r in runs)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
