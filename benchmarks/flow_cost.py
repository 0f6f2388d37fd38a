"""What flow control costs a request when nothing is saturated: the same gateway, flow off vs on.

Two clusters run side by side (same config but `admission.enabled`; the flow-on one also runs
the scraper that feeds it), each an edge + admission in front of one zero-delay simulated
engine, gateway processes pinned to one core, the load generator to the other. Runs alternate
between the clusters, so both see the same machine noise. Reported per concurrency: latency
p50/p99 of each, the difference, and gateway CPU (edge + admission) per request.

    python benchmarks/flow_cost.py [--rounds 5] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from cluster import cpu_seconds, running_cluster
from measure import pct
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, fmt_ms, run_load


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    concurrencies = (1, 32)
    keys = [(c, flow) for c in concurrencies for flow in (False, True)]
    p50 = {k: [] for k in keys}
    p99 = {k: [] for k in keys}
    cpu = {k: [] for k in keys}
    added = {c: [] for c in concurrencies}
    with contextlib.ExitStack() as stack:
        clusters = {
            flow: stack.enter_context(running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=flow))
            for flow in (False, True)
        }
        for round_no in range(args.rounds):
            for c in concurrencies:
                order = (False, True) if round_no % 2 == 0 else (True, False)
                medians = {}
                for flow in order:
                    cluster = clusters[flow]
                    before = cpu_seconds(cluster.gateway_pids())
                    latencies = asyncio.run(run_load(cluster.edge_url, c, args.requests, False))
                    used = cpu_seconds(cluster.gateway_pids()) - before
                    cpu[(c, flow)].append(used / (args.requests + 20))
                    p50[(c, flow)].append(pct(latencies, 0.5))
                    p99[(c, flow)].append(pct(latencies, 0.99))
                    medians[flow] = pct(latencies, 0.5)
                added[c].append(medians[True] - medians[False])
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)

    print(
        f"\n{args.rounds} interleaved rounds x {args.requests} requests per run, non-streamed; "
        "values are median [min..max] over rounds, milliseconds\n"
    )
    print(
        "| concurrency | flow control | p50 | p99 | gateway CPU / request | added p50 (on - off) |"
    )
    print("|---|---|---|---|---|---|")
    for c, flow in keys:
        extra = fmt_ms(added[c]) if flow else ""
        print(
            f"| {c} | {'on' if flow else 'off'} | {fmt_ms(p50[(c, flow)])} | "
            f"{fmt_ms(p99[(c, flow)])} | {fmt_ms(cpu[(c, flow)])} | {extra} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
