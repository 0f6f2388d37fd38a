"""Two clusters side by side: interleaved runs, paired differences (used by flow_cost, keys_cost).

Rounds alternate which cluster runs first, so both see the same machine noise; per concurrency
the report gives p50/p99 of each, the paired difference of p50 (variant - baseline) and the
gateway CPU (edge + admission + nats-server) per request, as median [min..max] over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cluster import Cluster, cpu_seconds, running_cluster
from measure import pct
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, fmt_ms, run_load


def compare(
    doc: str,
    variants: Mapping[str, Mapping[str, Any]],
    concurrencies: Sequence[int],
    label: str,
) -> int:
    """A benchmark's main: ``--rounds``/``--requests``, one cluster per variant (its
    `running_cluster` options; the first is the baseline), then `side_by_side`."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    with contextlib.ExitStack() as stack:
        clusters = {
            name: stack.enter_context(running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, **options))
            for name, options in variants.items()
        }
        side_by_side(clusters, concurrencies, args.rounds, args.requests, label)
    return 0


def side_by_side(
    clusters: Mapping[str, Cluster],
    concurrencies: Sequence[int],
    rounds: int,
    requests: int,
    label: str,
) -> None:
    """Run and print the table; the first cluster of `clusters` is the baseline."""
    variants = list(clusters)
    cells = [(c, v) for c in concurrencies for v in variants]
    p50: dict = {k: [] for k in cells}
    p99: dict = {k: [] for k in cells}
    cpu: dict = {k: [] for k in cells}
    added: dict = {c: [] for c in concurrencies}
    for round_no in range(rounds):
        for c in concurrencies:
            medians = {}
            for v in variants if round_no % 2 == 0 else variants[::-1]:
                cluster = clusters[v]
                marks: list[float] = []
                latencies = asyncio.run(
                    run_load(
                        cluster.edge_url,
                        c,
                        requests,
                        False,
                        cluster.api_key,
                        mark=lambda k=cluster, m=marks: m.append(cpu_seconds(k.gateway_pids())),
                    )
                )
                used = marks[1] - marks[0]
                cpu[(c, v)].append(used / requests)  # the measured requests, after the warm-up
                p50[(c, v)].append(pct(latencies, 0.5))
                p99[(c, v)].append(pct(latencies, 0.99))
                medians[v] = pct(latencies, 0.5)
            added[c].append(medians[variants[1]] - medians[variants[0]])
        print(f"round {round_no + 1}/{rounds} done", file=sys.stderr)
    print(
        f"\n{rounds} interleaved rounds x {requests} requests per run, non-streamed; "
        "values are median [min..max] over rounds, milliseconds\n"
    )
    print(
        f"| concurrency | {label} | p50 | p99 | gateway CPU / request | "
        f"added p50 ({variants[1]} - {variants[0]}) |"
    )
    print("|---|---|---|---|---|---|")
    for c, v in cells:
        extra = fmt_ms(added[c]) if v == variants[1] else ""
        print(
            f"| {c} | {v} | {fmt_ms(p50[(c, v)])} | {fmt_ms(p99[(c, v)])} | "
            f"{fmt_ms(cpu[(c, v)])} | {extra} |"
        )
