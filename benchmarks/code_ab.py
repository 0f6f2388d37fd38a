"""Two versions of llmgw side by side: the overhead benchmark's topology, interleaved.

    python benchmarks/code_ab.py --before OLD/.venv/bin/python [--after .venv/bin/python]
        [--separate] [--rounds 9] [--requests 400]

Each interpreter runs the services from the llmgw it has installed (e.g. a worktree of an
earlier commit with its own virtualenv), one cluster each, as benchmarks/overhead.py starts it
(shipped defaults: flow control and a scraper on, the provider's limits, the edge's own
admission instance and no other; `--separate`: admission in a process of its own). Every round
measures the engine directly, then both clusters (alternating which goes first) for each
scenario: concurrency 1 non-streamed and streamed, concurrency 64 non-streamed. "Added p50" is
the gateway's p50 minus the direct p50 of that round; "gateway CPU" is user + system time of
edge, admission and nats-server per measured request (after the warm-up). Values: median
[min..max] over rounds, milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from cluster import cpu_seconds, running_cluster
from measure import pct, reference_speed
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, fmt_ms, run_load

SCENARIOS = ((1, False), (1, True), (64, False))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="the baseline's python")
    parser.add_argument("--after", default=sys.executable, help="the variant's python")
    parser.add_argument("--separate", action="store_true", help="admission in its own process")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    topology = {} if args.separate else {"admissions": 0, "colocated": True}
    trees = {"before": args.before, "after": args.after}
    added: dict = {(t, s): [] for t in trees for s in SCENARIOS}
    cpu: dict = {(t, s): [] for t in trees for s in SCENARIOS}
    speed_before = reference_speed()
    with contextlib.ExitStack() as stack:
        clusters = {
            name: stack.enter_context(
                running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=True, python=python, **topology)
            )
            for name, python in trees.items()
        }
        for round_no in range(args.rounds):
            for concurrency, stream in SCENARIOS:
                order = list(trees) if round_no % 2 == 0 else list(trees)[::-1]
                engine = clusters[order[0]].engine_url
                direct = asyncio.run(run_load(engine, concurrency, args.requests, stream))
                for name in order:
                    cluster = clusters[name]
                    marks: list[float] = []
                    latencies = asyncio.run(
                        run_load(
                            cluster.edge_url,
                            concurrency,
                            args.requests,
                            stream,
                            mark=lambda c=cluster, m=marks: m.append(cpu_seconds(c.gateway_pids())),
                        )
                    )
                    used = marks[1] - marks[0]
                    key = (name, (concurrency, stream))
                    cpu[key].append(used / args.requests)  # the measured requests
                    added[key].append(pct(latencies, 0.5) - pct(direct, 0.5))
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(
        f"\n{args.rounds} interleaved rounds x {args.requests} requests per run; "
        f"{'separate admission process' if args.separate else 'shipped defaults'}; machine "
        f"reference {speed_before:.2f} us before, {reference_speed():.2f} after "
        "(measure.reference_speed)\n"
    )
    print("| concurrency | streamed | code | added p50 | gateway CPU / request |")
    print("|---|---|---|---|---|")
    for scenario in SCENARIOS:
        for name in trees:
            concurrency, stream = scenario
            print(
                f"| {concurrency} | {'yes' if stream else 'no'} | {name} | "
                f"{fmt_ms(added[(name, scenario)])} | {fmt_ms(cpu[(name, scenario)])} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
