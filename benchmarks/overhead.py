"""Added latency and CPU cost of edge + admission versus calling the engine directly.

    python benchmarks/overhead.py [--rounds 5] [--requests 300] [--no-flow] [--separate]
                                  [--profile]
    python benchmarks/overhead.py --capacity-ab [--rounds 7] [--requests 2000] [--python PATH]

The gateway runs the shipped defaults: flow control on (a scraper feeds it), the provider's
limits configured (pins, slots, reserve, per-session), requests cycling through 256 sessions,
and the topology of `llmgw up`: the edge decides admission in its own process
(admission.colocated, the default) and no other admission instance runs. `--separate`
runs admission as a process of its own instead (compose, Kubernetes, `llmgw up --secure`).

The engine simulator runs at zero delay, so every millisecond measured is
transport and gateway work. The load generator (aiohttp, this process) and
the engine share CPU 0; nats-server, admission and edge share CPU 1. Rounds
interleave direct and gateway runs; the report gives, per scenario, the
paired difference gateway - direct of p50 and p99 as median [min..max] over
rounds, and the gateway's CPU time per measured request (each run first opens every
connection it uses, as clients that keep theirs alive; the last column adds the warm-up's
requests and connection setup, as this script counted before 2026-12-02).

`--capacity-ab`: short requests (non-streamed, c=64) against two such gateways running side by
side, one whose engine endpoint configures ``capacity: 256`` and one that configures none (as
users write it: the capacity is then learned), each with its own engine; rounds interleave the
two (and, within each, direct and gateway runs), and the report gives per variant the added p50
and p99, the gateway's requests per second, its CPU per request, and what its admission ended
with: the endpoint's capacity and how many requests flow control queued.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).parent))
from cluster import Cluster, cpu_seconds, running_cluster
from measure import pct, print_profile, py_spy, reference_speed, summarize_profile

LOADGEN_CPUS = {0}
GATEWAY_CPUS = {1}


SESSIONS = 256  # requests cycle through this many sessions (the `user` field is the session key)


def bodies(stream: bool) -> list[bytes]:
    flag = b"true" if stream else b"false"
    return [
        b'{"model": "bench-model", "messages": [{"role": "user", "content": "hello"}],'
        b' "max_tokens": 20, "user": "u%d", "stream": %s}' % (i, flag)
        for i in range(SESSIONS)
    ]


_JSON = {"content-type": "application/json"}


async def one(
    session: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    stream: bool,
    headers: dict[str, str] = _JSON,
) -> float:
    started = time.perf_counter()
    async with session.post(url, data=payload, headers=headers) as r:
        if stream:
            async for _ in r.content.iter_any():
                pass
        else:
            await r.read()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    return time.perf_counter() - started


WARMUP = 20  # sequential requests before each run, then one wave at the run's concurrency


async def run_load(
    base_url: str,
    concurrency: int,
    total: int,
    stream: bool,
    api_key: str | None = None,
    mark: Callable[[], None] | None = None,
    path: str = "/v1/chat/completions",
    payloads: list[bytes] | None = None,
) -> list[float]:
    """`total` requests at `concurrency`, after a warm-up (not measured) that opens every
    connection the run uses: clients of a gateway keep theirs alive. `mark` is called when the
    warm-up is done and when the measured requests are, before the connections close (what
    lies between the two calls is what a run measures). `payloads` (default: `bodies`) are
    sent in turn to `path`."""
    url = base_url + path
    headers = {**_JSON, "authorization": f"Bearer {api_key}"} if api_key else _JSON
    payloads = payloads if payloads is not None else bodies(stream)
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(min(WARMUP, total)):
            await one(session, url, payloads[i % len(payloads)], stream, headers)
        if concurrency > 1:
            await asyncio.gather(
                *(one(session, url, payloads[i % len(payloads)], stream, headers)
                  for i in range(concurrency))
            )  # fmt: skip
        if mark is not None:
            mark()
        queue = iter(range(total))

        async def worker() -> None:
            for i in queue:
                latencies.append(
                    await one(session, url, payloads[i % len(payloads)], stream, headers)
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if mark is not None:
            mark()
    return latencies


def fmt_ms(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e3:.2f} [{min(values) * 1e3:.2f}..{max(values) * 1e3:.2f}]"
    )


def profile_edge(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(seconds),
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


_AREAS = (
    ("llmgw (edge, core, config)", ("services/", "shared/", "llmgw/")),
    ("uvicorn + starlette (HTTP server)", ("uvicorn/", "starlette/", "fastapi/", "httptools")),
    ("aiohttp (upstream client)", ("aiohttp/", "multidict/", "yarl/")),
    ("nats-py (admission request)", ("nats/",)),
    ("pydantic (wire messages)", ("pydantic/", "pydantic_core/")),
    ("prometheus-client", ("prometheus_client/",)),
)


CAPACITY_VARIANTS = (("capacity: 256", 256), ("no capacity", None))


def _admission_figures(admin_url: str) -> tuple[float | None, float]:
    """The engine endpoint's capacity and the requests that waited in flow control's queue
    (whatever then became of them), as the edge's admission reports them on its admin port's
    /metrics."""
    text = httpx.get(admin_url + "/metrics", timeout=5).text
    capacity, queued = None, 0.0
    for line in text.splitlines():
        if line.startswith("llmgw_admission_endpoint_capacity{"):
            capacity = float(line.rsplit(" ", 1)[1])
        elif line.startswith("llmgw_admission_queue_wait_seconds_count{"):
            queued += float(line.rsplit(" ", 1)[1])  # one per request that left a queue
    return capacity, queued


def capacity_ab(rounds: int, requests: int, python: str | None = None) -> int:
    concurrency = 64
    topology = {"admissions": 0, "colocated": True, "python": python}
    results: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("direct", "gateway", "p50", "p99", "rps", "direct_rps", "cpu")}
        for name, _ in CAPACITY_VARIANTS
    }
    speed_before = reference_speed()
    with contextlib.ExitStack() as stack:
        clusters = {
            name: stack.enter_context(
                running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=True, capacity=cap, **topology)
            )
            for name, cap in CAPACITY_VARIANTS
        }
        for round_no in range(rounds):
            names = [name for name, _ in CAPACITY_VARIANTS]
            if round_no % 2:
                names.reverse()
            for name in names:
                cluster = clusters[name]
                order = ["direct", "gateway"] if round_no % 2 == 0 else ["gateway", "direct"]
                runs = {}
                for target in order:
                    url = cluster.engine_url if target == "direct" else cluster.edge_url
                    marks: list[tuple[float, float]] = []

                    def mark(
                        marks: list[tuple[float, float]] = marks, c: Cluster = cluster
                    ) -> None:
                        marks.append((time.perf_counter(), cpu_seconds(c.gateway_pids())))

                    runs[target] = asyncio.run(
                        run_load(url, concurrency, requests, False, mark=mark)
                    )
                    (t0, cpu0), (t1, cpu1) = marks
                    key = "rps" if target == "gateway" else "direct_rps"
                    results[name][key].append(requests / (t1 - t0))
                    if target == "gateway":
                        results[name]["cpu"].append((cpu1 - cpu0) / requests)
                for q, key in ((0.5, "p50"), (0.99, "p99")):
                    results[name][key].append(pct(runs["gateway"], q) - pct(runs["direct"], q))
                for target in ("direct", "gateway"):
                    results[name][target].append(pct(runs[target], 0.5))
            print(f"round {round_no + 1}/{rounds} done", file=sys.stderr)
        figures = {
            name: _admission_figures(cluster.admin_url or "") for name, cluster in clusters.items()
        }
    print(
        f"\nshort requests, c={concurrency} non-streamed, {rounds} interleaved rounds x "
        f"{requests} requests per run and variant; values are median [min..max] over rounds "
        f"(milliseconds; requests/s); machine reference {speed_before:.2f} us before, "
        f"{reference_speed():.2f} after (measure.reference_speed)\n"
    )
    print(
        "| endpoint | direct p50 | gateway p50 | added p50 | added p99 | gateway req/s "
        "| direct req/s | gateway CPU / request | capacity at the end | requests queued |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in CAPACITY_VARIANTS:
        r = results[name]
        capacity, queued = figures[name]
        print(
            f"| {name} | {fmt_ms(r['direct'])} | {fmt_ms(r['gateway'])} | {fmt_ms(r['p50'])} | "
            f"{fmt_ms(r['p99'])} | {fmt_rate(r['rps'])} | {fmt_rate(r['direct_rps'])} | "
            f"{fmt_ms(r['cpu'])} | {capacity:g} | {queued:g} |"
        )
    return 0


def fmt_rate(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}..{max(values):,.0f}]"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="requests per run")
    parser.add_argument(
        "--no-flow", action="store_true", help="flow control off (admission.enabled: false)"
    )
    parser.add_argument(
        "--separate",
        action="store_true",
        help="admission in a process of its own (admission.colocated off), as `--secure` runs it",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the edge during an extra c=64 run"
    )
    parser.add_argument(
        "--capacity-ab",
        action="store_true",
        help="short requests: an endpoint configuring capacity 256 against one configuring none",
    )
    parser.add_argument(
        "--python",
        default=None,
        help="with --capacity-ab: the interpreter whose installed llmgw runs the gateways "
        "(another code tree's virtualenv; default: this one)",
    )
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    if args.capacity_ab:
        return capacity_ab(args.rounds, args.requests, args.python)
    scenarios = [(1, False), (1, True), (64, False), (64, True)]
    diffs: dict[tuple, dict[str, list[float]]] = {s: {"p50": [], "p99": []} for s in scenarios}
    absolute: dict[tuple, dict[str, list[float]]] = {
        s: {"direct": [], "gateway": []} for s in scenarios
    }
    cpu_per_request: dict[tuple, list[float]] = {s: [] for s in scenarios}
    cpu_with_setup: dict[tuple, list[float]] = {s: [] for s in scenarios}  # incl. the warm-up
    topology = {} if args.separate else {"admissions": 0, "colocated": True}
    speed_before = reference_speed()
    with running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=not args.no_flow, **topology) as cluster:
        for round_no in range(args.rounds):
            for scenario in scenarios:
                concurrency, stream = scenario
                order = ["direct", "gateway"] if round_no % 2 == 0 else ["gateway", "direct"]
                results = {}
                for target in order:
                    url = cluster.engine_url if target == "direct" else cluster.edge_url
                    marks = [cpu_seconds(cluster.gateway_pids())]
                    results[target] = asyncio.run(
                        run_load(
                            url,
                            concurrency,
                            args.requests,
                            stream,
                            mark=lambda marks=marks: marks.append(
                                cpu_seconds(cluster.gateway_pids())
                            ),
                        )
                    )
                    if target == "gateway":  # marks: start, warmed, measured, connections closed
                        marks.append(cpu_seconds(cluster.gateway_pids()))
                        cpu_per_request[scenario].append((marks[2] - marks[1]) / args.requests)
                        warm = WARMUP + (concurrency if concurrency > 1 else 0)
                        cpu_with_setup[scenario].append(
                            (marks[3] - marks[0]) / (args.requests + warm)
                        )
                for q, key in ((0.5, "p50"), (0.99, "p99")):
                    diffs[scenario][key].append(
                        pct(results["gateway"], q) - pct(results["direct"], q)
                    )
                for target in ("direct", "gateway"):
                    absolute[scenario][target].append(pct(results[target], 0.5))
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
        profile = None
        if args.profile:
            out = Path("/tmp/llmgw-edge-profile.txt")
            spy = profile_edge(cluster.procs["edge"].pid, 8, out)
            time.sleep(0.5)
            asyncio.run(run_load(cluster.edge_url, 64, 4000, False))
            spy.wait(30)
            if out.exists():
                profile = summarize_profile(out, _AREAS)

    print(
        f"\n{'admission in a separate process' if args.separate else 'shipped defaults'}, "
        f"{args.rounds} interleaved rounds x {args.requests} requests per run; "
        "values are median [min..max] over rounds, milliseconds; machine reference "
        f"{speed_before:.2f} us before, {reference_speed():.2f} after (measure.reference_speed)\n"
    )
    print(
        "| concurrency | streamed | direct p50 | gateway p50 | added p50 | added p99 "
        "| gateway CPU / request | with the warm-up's new connections |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        c, s = scenario
        print(
            f"| {c} | {'yes' if s else 'no'} | {fmt_ms(absolute[scenario]['direct'])} | "
            f"{fmt_ms(absolute[scenario]['gateway'])} | {fmt_ms(diffs[scenario]['p50'])} | "
            f"{fmt_ms(diffs[scenario]['p99'])} | {fmt_ms(cpu_per_request[scenario])} | "
            f"{fmt_ms(cpu_with_setup[scenario])} |"
        )
    if profile:
        print_profile(
            profile,
            "Where the edge's CPU goes (py-spy samples, c=64 non-streamed, innermost library):",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
