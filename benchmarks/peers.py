"""llmgw next to a bare byte relay, side by side in one run: added latency and CPU per request.

    python benchmarks/peers.py [--rounds 5] [--requests 1000] [--python PATH] [--profile]

One zero-delay `llmgw sim engine`; in front of it, on the same core (CPU 1), a bare aiohttp
byte relay (benchmarks/relay.py) and llmgw as a user runs it: `llmgw edge` with admission in
its process, flow control on with its scraper, API keys required, the provider's limits (pins,
slots, reserve, per-session), no `capacity` on the endpoint (learned, as users write it),
metrics and the access log on (the defaults), requests cycling through 256 users (sessions).
The load generator and the engine share CPU 0. Each round runs, per scenario (concurrency 1 and
64, not streamed, then streamed), the engine directly, the relay and the gateway in an order that
rotates each round; a run warms its connections first, then measures `--requests` requests.

Reported per scenario, median [min..max] over rounds: added p50 (p50 through it minus the
direct p50 of the same round) and CPU per request (the relay's process; the edge's, the
scraper's and nats-server's for llmgw), and the ratio llmgw / relay of each per round: the
figures the goal "at most 1.5x the relay's added p50 at c=1, at most 2.5x its CPU per request at
c=64" is read from. `--python` runs llmgw from another code tree's virtualenv. `--profile`
py-spies the edge during an extra c=64 run (`--profile-concurrency`: another) and prints where
its CPU goes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cluster import cpu_seconds, running_cluster, start_process, wait_ready
from measure import pct, print_profile, reference_speed, summarize_profile
from overhead import _AREAS, GATEWAY_CPUS, LOADGEN_CPUS, fmt_ms, profile_edge, run_load

from llmgw.serving import free_port

SCENARIOS = ((1, False), (64, False), (1, True), (64, True))
TARGETS = ("direct", "relay", "llmgw")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000, help="requests per run")
    parser.add_argument("--python", default=None, help="the interpreter whose llmgw runs")
    parser.add_argument("--profile", action="store_true", help="py-spy the edge at c=64")
    parser.add_argument(
        "--profile-concurrency", type=int, default=64, help="the concurrency --profile runs at"
    )
    parser.add_argument("--profile-raw", default=None, help="also keep py-spy's raw samples here")
    parser.add_argument("--no-streams", action="store_true", help="only the non-streamed scenarios")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    scenarios = [s for s in SCENARIOS if not (args.no_streams and s[1])]
    p50: dict[tuple, dict[str, list[float]]] = {s: {t: [] for t in TARGETS} for s in scenarios}
    cpu: dict[tuple, dict[str, list[float]]] = {s: {t: [] for t in TARGETS[1:]} for s in scenarios}
    speed_before = reference_speed()
    profile = None
    with running_cluster(
        GATEWAY_CPUS,
        LOADGEN_CPUS,
        flow=True,
        admissions=0,
        colocated=True,
        auth=True,
        capacity=None,
        python=args.python,
    ) as cluster:
        relay_port = free_port()
        relay = start_process(
            "relay",
            [
                sys.executable,
                str(Path(__file__).parent / "relay.py"),
                "--port",
                str(relay_port),
                "--upstream",
                cluster.engine_url,
            ],
            GATEWAY_CPUS,
            cluster.procs["engine"].log.parent,
            dict(os.environ),
        )
        cluster.procs["relay"] = relay
        wait_ready(relay, "ready")
        urls = {
            "direct": cluster.engine_url,
            "relay": f"http://127.0.0.1:{relay_port}",
            "llmgw": cluster.edge_url,
        }
        pids = {
            "relay": lambda: [relay.pid],
            "llmgw": lambda: [*cluster.gateway_pids(), cluster.procs["scraper"].pid],
        }
        for round_no in range(args.rounds):
            order = list(TARGETS[round_no % 3 :] + TARGETS[: round_no % 3])
            for scenario in scenarios:
                concurrency, stream = scenario
                for target in order:
                    marks: list[float] = []

                    def mark(target: str = target, marks: list[float] = marks) -> None:
                        if target in pids:
                            marks.append(cpu_seconds(pids[target]()))

                    latencies = asyncio.run(
                        run_load(
                            urls[target],
                            concurrency,
                            args.requests,
                            stream,
                            api_key=cluster.api_key if target == "llmgw" else None,
                            mark=mark,
                        )
                    )
                    p50[scenario][target].append(pct(latencies, 0.5))
                    if marks:
                        cpu[scenario][target].append((marks[1] - marks[0]) / args.requests)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
        if args.profile:
            out = Path(cluster.procs["engine"].log.parent / "edge-profile.txt")
            spy = profile_edge(cluster.procs["edge"].pid, 8, out)
            time.sleep(0.5)
            asyncio.run(
                run_load(
                    cluster.edge_url,
                    args.profile_concurrency,
                    6000 if args.profile_concurrency > 1 else 3000,
                    False,
                    api_key=cluster.api_key,
                )
            )
            spy.wait(30)
            if out.exists():
                profile = summarize_profile(out, _AREAS)
                if args.profile_raw:
                    shutil.copyfile(out, args.profile_raw)

    print(
        f"\nllmgw (keys, limits, pins, flow control, metrics, access log; no capacity configured) "
        f"next to a bare aiohttp relay, {args.rounds} rounds x {args.requests} requests per run; "
        f"median [min..max] over rounds, milliseconds; machine reference {speed_before:.2f} us "
        f"before, {reference_speed():.2f} after\n"
    )
    print(
        "| c | streamed | direct p50 | relay: added p50 | llmgw: added p50 | ratio "
        "| relay: CPU / request | llmgw: CPU / request | ratio | llmgw req/s-equivalent CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        c, s = scenario
        direct = p50[scenario]["direct"]
        added = {
            t: [p50[scenario][t][i] - direct[i] for i in range(len(direct))] for t in TARGETS[1:]
        }
        lat_ratio = [
            g / r if r > 0 else float("inf")
            for g, r in zip(added["llmgw"], added["relay"], strict=True)
        ]
        cpu_ratio = [
            g / r for g, r in zip(cpu[scenario]["llmgw"], cpu[scenario]["relay"], strict=True)
        ]
        print(
            f"| {c} | {'yes' if s else 'no'} | {fmt_ms(direct)} | {fmt_ms(added['relay'])} | "
            f"{fmt_ms(added['llmgw'])} | {fmt_ratio(lat_ratio)} | "
            f"{fmt_ms(cpu[scenario]['relay'])} | {fmt_ms(cpu[scenario]['llmgw'])} | "
            f"{fmt_ratio(cpu_ratio)} | {1 / statistics.median(cpu[scenario]['llmgw']):,.0f} |"
        )
    if profile:
        print_profile(
            profile,
            f"Where the edge's CPU goes (py-spy, c={args.profile_concurrency} non-streamed):",
        )
    return 0


def fmt_ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}..{max(values):.2f}]"


if __name__ == "__main__":
    raise SystemExit(main())
