"""Admission decision latency and sustained admissions per second with 1, 2 and 4 workers.

    python benchmarks/admission.py [--rounds 3] [--workers 1,2,4] [--requests 8000]
                                   [--breakdown N] [--profile] [--layout split|shared]

Topology (per run): a real nats-server, N `llmgw admission --config F` processes (started
through the CLI; one managed provider/model with limits that rarely reject: G=512, R=64,
P=5000, S=4; pinning.history=64; a fresh bucket per run) and a zero-delay `llmgw sim engine`
that only answers the admission's health probes. This process plays the edges: it sends
AdmitRequests over NATS request/reply on llmgw.v1.admission.request, measures the time to the
parsed reply, and releases every granted lease 2 ms later through RoutingState (as an edge
does, off the request path). Sessions come from a pool of 2,000: every pool session is pinned
in a warm-up, then each request picks a random pool session and, with probability 0.1, first
replaces it by a fresh one (a new conversation), so about 10% of admissions create a pin.

Per run: a latency phase at concurrency 1 (uncontended decisions), then a sustained phase
with a fixed number of requests in flight (32). A separate recorder process follows the
bucket's stream from its first message (HistoryRecorder) and, after the run, replays it
through the history checker (limits from the same config): violations must be 0.

CPUs (the reference machine has 2): nats-server and every admission worker share CPU 1; the
load generator, the recorder and the idle engine share CPU 0 (`--layout shared` lets the
kernel place everything on both). Rounds interleave the worker counts (rotating the order).

--breakdown runs the same decision code (AdmissionService.decide) inside this process against
the same server, with a KV wrapper that counts and times every KV call per admission type.
--profile samples one admission worker with py-spy during an extra sustained run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import uvloop
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from cluster import ZERO_DELAY, Proc, cpu_seconds, pin_process, start_process, wait_ready
from measure import pct, print_profile, py_spy, summarize_profile

from llmgw.config import load_config
from llmgw.config.schema import Config
from llmgw.nats_embedded import EmbeddedNats
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.service import AdmissionService
from llmgw.serving import free_port
from llmgw.state.checker import check_history
from llmgw.state.history import HistoryRecorder
from llmgw.state.kv import CasConflict, KVEntry, KVStore
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.state.routing_state import RoutingState
from llmgw.state.setup import limits_from_config, open_routing_state
from llmgw.wire import ADMISSION_REQUEST_SUBJECT, AdmitReply, AdmitRequest

MODEL = "bench-model"
LIMITS = {
    "max_global_in_flight_request_slots": 512,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 64,
    "max_pinned_sessions": 5000,
    "max_per_session_in_flight_request_slots": 4,
}
LOADGEN_CPUS = {0}
SERVICE_CPUS = {1}
EDGE_ID = "edge-bench"


def bench_config(nats_url: str, engine_url: str, bucket: str) -> dict:
    return {
        "nats": {"url": nats_url, "request_timeout": "5s"},
        # The prober checks the engine at start, then every 30 s: it must find it healthy.
        "router": {"scrape_interval": "30s"},
        "models": [{"name": MODEL}],
        "providers": [
            {"id": "local", "kind": "managed", "models": [{"name": MODEL, "limits": LIMITS}]}
        ],
        "endpoints": [
            {"id": "engine-1", "url": engine_url, "provider": "local", "models": [MODEL]}
        ],
        "pinning": {"bucket": bucket, "history": 64},
        "admission": {"enabled": False},  # pinning and leases alone; flow control is measured apart
    }


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    if not values:
        return "-"
    med, lo, hi = (statistics.median(values) * scale, min(values) * scale, max(values) * scale)
    return f"{med:.{digits}f} [{lo:.{digits}f}..{hi:.{digits}f}]"


# ---- the recorder: a separate process, so its work does not run on the load generator's loop


def _recorder_main(nats_url: str, config_path: str, conn: Any) -> None:
    os.sched_setaffinity(0, LOADGEN_CPUS)

    async def main() -> None:
        config = load_config(config_path)
        nc = await nats.connect(nats_url)
        recorder = await HistoryRecorder(nc.jetstream(), config.pinning.bucket).start()
        conn.send("started")
        await asyncio.to_thread(conn.recv)  # "stop": every write of the run has been made
        entries = await recorder.sync(timeout=120, allow_gaps=True)
        gaps = list(recorder.gaps)
        await recorder.stop()
        await nc.close()
        started = time.perf_counter()
        violations = check_history(
            entries, limits_from_config(config), config.pinning.lease_timeout
        )
        conn.send(
            {
                "entries": len(entries),
                "gaps": gaps,
                "violations": len(violations),
                "examples": [str(v) for v in violations[:5]],
                "check_seconds": time.perf_counter() - started,
            }
        )

    uvloop.run(main())


class Recorder:
    def __init__(self, nats_url: str, config_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_recorder_main, args=(nats_url, str(config_path), child))

    async def start(self) -> None:
        self.process.start()
        await asyncio.to_thread(self._conn.recv)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(10)

    async def finish(self) -> dict:
        self._conn.send("stop")
        result = await asyncio.to_thread(self._conn.recv)
        await asyncio.to_thread(self.process.join, 10)
        return result


# ---- the load generator (plays the edges) -------------------------------------------------


class SessionPool:
    """2,000 live conversations; a request continues one, or (new_share) starts a new one."""

    def __init__(self, size: int, new_share: float, rng: random.Random) -> None:
        self._rng = rng
        self.new_share = new_share
        self.sessions = [self._fresh() for _ in range(size)]

    def _fresh(self) -> str:
        return f"{self._rng.getrandbits(128):032x}"

    def pick(self) -> str:
        index = self._rng.randrange(len(self.sessions))
        if self._rng.random() < self.new_share:
            self.sessions[index] = self._fresh()
        return self.sessions[index]


@dataclass
class PhaseResult:
    latencies: list[float] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)  # route, or "rejected:<reason>"
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


class LoadGenerator:
    def __init__(self, nc: Any, routing: RoutingState, pool: SessionPool, hold: float) -> None:
        self._nc = nc
        self._routing = routing
        self._pool = pool
        self._hold = hold
        self._releases: set[asyncio.Task[None]] = set()
        self._counter = 0
        self.release_results: Counter = Counter()

    async def _release(self, reply: AdmitReply, hold: float) -> None:
        if hold:
            await asyncio.sleep(hold)
        assert reply.lease is not None
        result = await self._routing.release_request_lease(
            reply.lease.to_core(), refresh_pin=reply.refresh_pin_on_success
        )
        self.release_results[result.value] += 1

    async def admit(self, session: str, result: PhaseResult, *, release_now: bool) -> None:
        """One admission; its lease is released `hold` later in the background, or right away
        (awaited, after the measurement) if `release_now`."""
        self._counter += 1
        request = AdmitRequest(
            request_id=f"r{self._counter}",
            edge_id=EDGE_ID,
            model=MODEL,
            feature="chat",
            session_id=session,
        )
        started = time.perf_counter()
        msg = await self._nc.request(
            ADMISSION_REQUEST_SUBJECT,
            request.model_dump_json(exclude_defaults=True).encode(),
            timeout=5,
        )
        reply = AdmitReply.model_validate_json(msg.data)
        result.latencies.append(time.perf_counter() - started)
        if reply.admitted:
            result.outcomes[reply.route or "?"] += 1
            if reply.lease is not None and release_now:
                await self._release(reply, 0)
            elif reply.lease is not None:
                task = asyncio.create_task(self._release(reply, self._hold))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)
        else:
            result.outcomes[f"rejected:{reply.reject_reason}"] += 1

    async def phase(
        self, concurrency: int, total: int, sessions: list[str] | None = None
    ) -> PhaseResult:
        """`total` admissions with `concurrency` in flight (or each of `sessions` once).

        At concurrency 1 each lease is released before the next admission starts, so every
        decision runs alone (uncontended); otherwise releases overlap later admissions.
        """
        result = PhaseResult()
        todo = iter(sessions) if sessions is not None else (self._pool.pick() for _ in range(total))

        async def worker() -> None:
            for session in todo:
                await self.admit(session, result, release_now=concurrency == 1)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - started
        return result

    async def drain(self) -> None:
        while self._releases:
            await asyncio.gather(*list(self._releases))


# ---- one run: fresh bucket, N workers, warm-up, latency phase, sustained phase -------------


@dataclass
class RunResult:
    workers: int
    uncontended: PhaseResult
    sustained: PhaseResult
    service_cpu: float  # CPU seconds of workers + nats-server during the sustained phase
    nats_cpu: float  # of which nats-server
    loadgen_cpu: float  # CPU seconds of this process + the recorder, same phase
    machine_cpu: dict[int, float]  # busy seconds per CPU, all processes (others' too), same phase
    check: dict
    releases: Counter


class Bench:
    def __init__(
        self, args: argparse.Namespace, nats_server: EmbeddedNats, engine_url: str, tmp: Path
    ) -> None:
        self.args = args
        self.nats = nats_server
        self.engine_url = engine_url
        self.tmp = tmp
        self.rng = random.Random(args.seed)
        self.service_cpus = SERVICE_CPUS if args.layout == "split" else {0, 1}

    def write_config(self, tag: str) -> tuple[Path, Config]:
        bucket = f"bench_admission_{tag}_{uuid.uuid4().hex[:8]}"
        path = self.tmp / f"{bucket}.yaml"
        path.write_text(yaml.safe_dump(bench_config(self.nats.url, self.engine_url, bucket)))
        return path, load_config(path)

    def start_workers(self, n: int, config_path: Path) -> list[Proc]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cli = [sys.executable, "-m", "llmgw", "admission", "--config", str(config_path)]
        procs = [
            start_process(
                f"{config_path.stem}-admission-{i}", cli, self.service_cpus, self.tmp, env
            )
            for i in range(n)
        ]
        for proc in procs:
            wait_ready(proc, "llmgw admission ready")
        return procs

    @staticmethod
    def stop_workers(procs: list[Proc]) -> None:
        for proc in procs:
            proc.popen.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.popen.wait(10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()

    async def run(
        self, nc: Any, workers: int, *, requests: int, on_sustained_start: Any = None
    ) -> RunResult:
        config_path, config = self.write_config(f"w{workers}")
        routing = await open_routing_state(nc, config, instance_id=EDGE_ID, follow_slots=False)
        recorder = None if self.args.no_check else Recorder(self.nats.url, config_path)
        try:
            if recorder is not None:
                await recorder.start()
            return await self._measure(
                nc, workers, requests, config_path, config, routing, recorder, on_sustained_start
            )
        except BaseException:
            if recorder is not None:
                recorder.kill()
            raise

    async def _measure(
        self,
        nc: Any,
        workers: int,
        requests: int,
        config_path: Path,
        config: Config,
        routing: RoutingState,
        recorder: Recorder | None,
        on_sustained_start: Any,
    ) -> RunResult:
        procs = self.start_workers(workers, config_path)
        pool = SessionPool(
            self.args.sessions, self.args.new_share, random.Random(self.rng.random())
        )
        load = LoadGenerator(nc, routing, pool, self.args.hold_ms / 1000)
        try:
            await load.phase(self.args.concurrency, 0, sessions=list(pool.sessions))  # warm-up
            await load.drain()
            uncontended = await load.phase(1, self.args.latency_requests)
            await load.drain()
            pids = [p.pid for p in procs] + [self.nats.pid]
            own = [] if recorder is None else [recorder.process.pid]
            service_before, loadgen_before = cpu_seconds(pids), cpu_seconds(own) + _self_cpu()
            nats_before = cpu_seconds([self.nats.pid])
            machine_before = cpu_busy()
            if on_sustained_start is not None:
                on_sustained_start(procs)
            sustained = await load.phase(self.args.concurrency, requests)
            service_cpu = cpu_seconds(pids) - service_before
            nats_cpu = cpu_seconds([self.nats.pid]) - nats_before
            loadgen_cpu = cpu_seconds(own) + _self_cpu() - loadgen_before
            machine = {cpu: busy - machine_before[cpu] for cpu, busy in cpu_busy().items()}
            await load.drain()
        finally:
            self.stop_workers(procs)
        check = _UNCHECKED if recorder is None else await recorder.finish()
        await nc.jetstream().delete_key_value(config.pinning.bucket)
        return RunResult(
            workers,
            uncontended,
            sustained,
            service_cpu,
            nats_cpu,
            loadgen_cpu,
            machine,
            check,
            load.release_results,
        )


_UNCHECKED = {"entries": 0, "gaps": [], "violations": 0, "examples": [], "check_seconds": 0.0}


def _self_cpu() -> float:
    times = os.times()
    return times.user + times.system


def cpu_busy() -> dict[int, float]:
    """Busy seconds so far of each CPU, every process on the machine included (/proc/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    busy = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            numbers = [int(v) for v in values[:8]]
            busy[int(name[3:])] = (sum(numbers) - numbers[3] - numbers[4]) / ticks  # - idle, iowait
    return busy


# ---- breakdown: the decision code in this process, every KV call counted and timed ---------


_calls: contextvars.ContextVar[list[tuple[str, float]] | None] = contextvars.ContextVar(
    "kv_calls", default=None
)


class TimedKV:
    """Wraps a KVStore; appends (operation + key namespace, seconds) to the current call list."""

    def __init__(self, inner: KVStore) -> None:
        self._inner = inner

    async def _timed(self, op: str, key: str, call: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        label = f"{op} {key.split('.', 1)[0]}"
        try:
            return await call
        except CasConflict:
            label += " (conflict)"
            raise
        finally:
            calls = _calls.get()
            if calls is not None:
                calls.append((label, time.perf_counter() - started))

    async def get(self, key: str) -> KVEntry | None:
        return await self._timed("get", key, self._inner.get(key))

    async def create(self, key: str, value: bytes) -> int:
        return await self._timed("create", key, self._inner.create(key, value))

    async def update(self, key: str, value: bytes, revision: int) -> int:
        return await self._timed("update", key, self._inner.update(key, value, revision))

    async def delete(self, key: str, revision: int) -> int:
        return await self._timed("delete", key, self._inner.delete(key, revision))

    async def put(self, key: str, value: bytes) -> int:
        return await self._timed("put", key, self._inner.put(key, value))

    async def list(self, prefix: str) -> list[KVEntry]:
        return await self._inner.list(prefix)

    def watch(self, prefix: str) -> Any:
        return self._inner.watch(prefix)


@dataclass
class Breakdown:
    decisions: int = 0
    total: list[float] = field(default_factory=list)
    kv: list[float] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)


async def breakdown(bench: Bench, nc: Any, decisions: int) -> dict[str, Breakdown]:
    """Per admission type (route) and for the release: KV calls and where the time goes."""
    _, config = bench.write_config("breakdown")
    kv = await open_routing_bucket(nc.jetstream(), config.pinning.bucket, history=64)
    routing = RoutingState(
        TimedKV(kv),
        limits_from_config(config),
        clock=time.time,
        rng=random.Random(),
        lease_timeout=config.pinning.lease_timeout,
        instance_id="breakdown",
    )
    await routing.start()
    service = AdmissionService(config, nc, routing, HealthBoard())
    pool = SessionPool(200, 0.1, random.Random(7))
    kinds: dict[str, Breakdown] = defaultdict(Breakdown)

    async def measured(kind: str, call: Awaitable[Any]) -> Any:
        calls: list[tuple[str, float]] = []
        token = _calls.set(calls)
        started = time.perf_counter()
        try:
            outcome = await call
        finally:
            _calls.reset(token)
        elapsed = time.perf_counter() - started
        if callable(kind):
            kind = kind(outcome)
        entry = kinds[kind]
        entry.decisions += 1
        entry.total.append(elapsed)
        entry.kv.append(sum(seconds for _, seconds in calls))
        entry.ops.update(label for label, _ in calls)
        return outcome

    try:
        for n in range(len(pool.sessions) + decisions):
            session = pool.sessions[n] if n < len(pool.sessions) else pool.pick()
            request = AdmitRequest(
                request_id=f"b{n}", edge_id=EDGE_ID, model=MODEL, feature="chat", session_id=session
            )
            reply = await measured(lambda r: f"admit: {r.route}", service.decide(request))
            if reply.lease is not None:
                await measured(
                    "release",
                    routing.release_request_lease(
                        reply.lease.to_core(), refresh_pin=reply.refresh_pin_on_success
                    ),
                )
            if n == len(pool.sessions) - 1:
                kinds.clear()  # the warm-up pinned every pool session; measure from here
    finally:
        await routing.close()
        await nc.jetstream().delete_key_value(config.pinning.bucket)
    return dict(kinds)


# ---- profile: py-spy on one worker during a sustained run ----------------------------------

_AREAS = (
    (
        "llmgw routing state (state/, core/)",
        ("shared/state/", "shared/core/", "llmgw/state/", "llmgw/core/"),
    ),
    ("llmgw admission service", ("services/admission/",)),
    ("nats-py (protocol, JetStream publish/get, consumers)", ("nats/",)),
    ("pydantic (wire messages)", ("pydantic/", "pydantic_core/")),
    ("json (stdlib: KV values, API replies)", ("json/",)),
)


# ---- main -------------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: list[RunResult]) -> None:
    by_workers: dict[int, list[RunResult]] = defaultdict(list)
    for result in results:
        by_workers[result.workers].append(result)
    print(
        f"\n{args.rounds} rounds; per run: {args.latency_requests} admissions at concurrency 1, "
        f"then {args.requests} with {args.concurrency} in flight; layout {args.layout}; "
        "values are median [min..max] over rounds\n"
    )
    print(
        "| workers | admissions/s (c=32) | p50 c=1 ms | p99 c=1 ms | p50 c=32 ms | "
        "p99 c=32 ms | service CPU ms / admission: workers + nats | service cores busy "
        "| load gen + recorder cores busy | CPU 0 / CPU 1 busy, all processes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workers, runs in sorted(by_workers.items()):
        rates = [r.sustained.rate for r in runs]
        n = [len(r.sustained.latencies) for r in runs]
        cpu_per = [r.service_cpu / k for r, k in zip(runs, n, strict=True)]
        nats_per = [r.nats_cpu / k for r, k in zip(runs, n, strict=True)]
        worker_per = [c - k for c, k in zip(cpu_per, nats_per, strict=True)]
        service = [r.service_cpu / r.sustained.seconds for r in runs]
        loadgen = [r.loadgen_cpu / r.sustained.seconds for r in runs]
        all1 = [r.machine_cpu.get(1, 0.0) / r.sustained.seconds for r in runs]
        all0 = [r.machine_cpu.get(0, 0.0) / r.sustained.seconds for r in runs]
        print(
            f"| {workers} | {spread(rates, digits=0)} "
            f"| {spread([pct(r.uncontended.latencies, 0.5) for r in runs], 1e3)} "
            f"| {spread([pct(r.uncontended.latencies, 0.99) for r in runs], 1e3)} "
            f"| {spread([pct(r.sustained.latencies, 0.5) for r in runs], 1e3)} "
            f"| {spread([pct(r.sustained.latencies, 0.99) for r in runs], 1e3)} "
            f"| {statistics.median(cpu_per) * 1e3:.2f} [{min(cpu_per) * 1e3:.2f}.."
            f"{max(cpu_per) * 1e3:.2f}]: {statistics.median(worker_per) * 1e3:.2f} + "
            f"{statistics.median(nats_per) * 1e3:.2f} "
            f"| {statistics.median(service):.2f} | {statistics.median(loadgen):.2f} "
            f"| {statistics.median(all0) * 100:.0f}% / {statistics.median(all1) * 100:.0f}% |"
        )
    print(
        "\n| workers | admissions measured (c=1 + sustained) | outcomes (summed over rounds) "
        "| releases | "
        "history entries checked | gaps | violations |"
    )
    print("|---|---|---|---|---|---|---|")
    for workers, runs in sorted(by_workers.items()):
        outcomes: Counter = Counter()
        releases: Counter = Counter()
        for r in runs:
            outcomes.update(r.uncontended.outcomes)
            outcomes.update(r.sustained.outcomes)
            releases.update(r.releases)
        shown = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
        print(
            f"| {workers} | {sum(outcomes.values())} | {shown} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(releases.items()))} "
            f"| {sum(r.check['entries'] for r in runs)} "
            f"| {sum(len(r.check['gaps']) for r in runs)} "
            f"| **{sum(r.check['violations'] for r in runs)}** |"
        )
        for r in runs:
            for example in r.check["examples"]:
                print(f"    violation: {example}")


def report_breakdown(kinds: dict[str, Breakdown]) -> None:
    print(
        "\nWhere an admission's time goes (decision code in-process at concurrency 1, "
        "KV calls counted and timed; ms are medians):\n"
    )
    print("| operation | n | KV calls per operation | KV time ms | total ms | non-KV Python ms |")
    print("|---|---|---|---|---|---|")
    for kind in sorted(kinds, key=lambda k: (k == "release", k)):
        entry = kinds[kind]
        per_op = ", ".join(
            f"{label} {count / entry.decisions:.2f}" for label, count in sorted(entry.ops.items())
        )
        calls = sum(entry.ops.values()) / entry.decisions
        rest = [t - k for t, k in zip(entry.total, entry.kv, strict=True)]
        print(
            f"| {kind} | {entry.decisions} | {calls:.2f} ({per_op}) "
            f"| {statistics.median(entry.kv) * 1e3:.2f} "
            f"| {statistics.median(entry.total) * 1e3:.2f} "
            f"| {statistics.median(rest) * 1e3:.2f} |"
        )


def report_profile(
    profile: tuple[list[tuple[str, float]], list[tuple[str, float]]], workers: int
) -> None:
    print_profile(
        profile,
        f"Where one admission worker's CPU goes (py-spy, {workers} worker(s), "
        "sustained phase, innermost library frame):",
    )


async def amain(
    args: argparse.Namespace, nats_server: EmbeddedNats, engine_url: str, tmp: Path
) -> None:
    bench = Bench(args, nats_server, engine_url, tmp)
    nc = await nats.connect(nats_server.url)
    counts = [int(w) for w in args.workers.split(",")]
    results: list[RunResult] = []
    try:
        for round_no in range(args.rounds):
            shift = round_no % len(counts)
            for workers in counts[shift:] + counts[:shift]:
                result = await bench.run(nc, workers, requests=args.requests)
                results.append(result)
                print(
                    f"round {round_no + 1}/{args.rounds}, {workers} worker(s): "
                    f"{result.sustained.rate:.0f}/s, violations {result.check['violations']}",
                    file=sys.stderr,
                )
        kinds = await breakdown(bench, nc, args.breakdown) if args.breakdown else None
        profile = None
        if args.profile:
            out = tmp / "admission-profile.txt"
            spies: list[subprocess.Popen] = []

            def spy(procs: list[Proc]) -> None:
                spies.append(
                    subprocess.Popen(
                        [
                            py_spy(),
                            "record",
                            "--pid",
                            str(procs[0].pid),
                            "--duration",
                            "6",
                            "--rate",
                            "500",
                            "--format",
                            "raw",
                            "--output",
                            str(out),
                            "--nonblocking",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                time.sleep(0.5)

            await bench.run(
                nc, args.profile_workers, requests=args.requests * 2, on_sustained_start=spy
            )
            for process in spies:
                process.wait(30)
            profile = summarize_profile(out, _AREAS) if out.exists() else None
    finally:
        await nc.close()
    report(args, results)
    if kinds:
        report_breakdown(kinds)
    if profile:
        report_profile(profile, args.profile_workers)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4", help="admission worker counts")
    parser.add_argument("--requests", type=int, default=8000, help="sustained-phase admissions")
    parser.add_argument(
        "--latency-requests", type=int, default=500, help="admissions at concurrency 1"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument(
        "--new-share",
        type=float,
        default=0.1,
        help="share of requests that start a new conversation",
    )
    parser.add_argument("--hold-ms", type=float, default=2.0, help="lease hold before release")
    parser.add_argument("--layout", choices=("split", "shared"), default="split")
    parser.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="N",
        help="also time N in-process decisions call by call",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy one worker")
    parser.add_argument("--profile-workers", type=int, default=1)
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="no recorder and no checker (to measure what recording costs)",
    )
    parser.add_argument("--seed", type=int, default=20261130)
    args = parser.parse_args()
    if args.layout == "split":
        os.sched_setaffinity(0, LOADGEN_CPUS)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-admission-") as tmp:
        nats_server = EmbeddedNats().start()
        engine: Proc | None = None
        try:
            pin_process(nats_server.pid, SERVICE_CPUS if args.layout == "split" else {0, 1})
            port = free_port()
            engine = start_process(
                "engine",
                [
                    sys.executable,
                    "-m",
                    "llmgw",
                    "sim",
                    "engine",
                    "--port",
                    str(port),
                    "--model",
                    MODEL,
                    *(f"--set={s}" for s in ZERO_DELAY),
                ],
                LOADGEN_CPUS if args.layout == "split" else {0, 1},
                Path(tmp),
                {**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            wait_ready(engine, "ready")
            uvloop.run(amain(args, nats_server, f"http://127.0.0.1:{port}", Path(tmp)))
        finally:
            if engine is not None and engine.popen.poll() is None:
                engine.popen.terminate()
                engine.popen.wait(10)
            nats_server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
