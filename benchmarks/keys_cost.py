"""What API keys cost a request: the same gateway with auth.mode none and with keys.

Two clusters run side by side, identical but for `auth.mode` (edge + admission + nats-server
pinned to one core, a zero-delay engine and the load generator on the other); the keys cluster's
one key has an rpm, a tpm and a max_parallel_requests (all far above the load), so every request
passes every check: the key lookup in the edge's mirror, the rpm/tpm window, the model and band
rules, and the key's parallel-request quota in admission. Runs alternate between the clusters.
Reported per concurrency: p50/p99 of each, the paired difference of p50 (keys - none) and gateway
CPU per request. A second part times the edge's check alone, in this process (CPU time), over a
mirror of 10,000 keys.

    python benchmarks/keys_cost.py [--rounds 5] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time

from cluster import cpu_seconds, running_cluster
from measure import pct
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, fmt_ms, run_load

from llmgw.core.apikeys import ApiKey, digest_of
from llmgw.services.edge.auth import KeyAuth
from llmgw.services.edge.limits import KeyLimiter
from llmgw.state.apikeys import KeyMirror

KEY_OPTIONS = ("--rpm", "100000000", "--tpm", "1000000000", "--max-parallel", "10000")


def check_alone(calls: int = 200_000) -> tuple[float, float]:
    """CPU seconds per check (caller + model + band) and per refused unknown key (process CPU
    time, so other processes on a shared machine do not inflate it)."""
    mirror = KeyMirror(kv=None, clock=time.time)  # type: ignore[arg-type]
    secrets = [f"sk-llmgw-{i:048x}" for i in range(10_000)]
    for i, secret in enumerate(secrets):
        mirror.keys[digest_of(secret)] = ApiKey(
            digest_of(secret), f"t{i}", models=("bench-*",), rpm=10**9, tpm=10**9
        )
    auth = KeyAuth(
        mirror,
        KeyLimiter(None, "bench", interval=1.0, clock=time.time),
        default_band="gold",
        clock=time.time,
    )
    header = f"Bearer {secrets[1234]}"
    ids = {"x-request-id": "r"}
    started = time.process_time()
    for _ in range(calls):
        caller = auth.caller(header, ids)
        auth.model_denied(caller, "bench-model", "bench-model")  # type: ignore[arg-type]
        auth.band(caller, None)  # type: ignore[arg-type]
    per_check = (time.process_time() - started) / calls
    started = time.process_time()
    for _ in range(calls):
        auth.caller("Bearer sk-llmgw-unknown", ids)
    return per_check, (time.process_time() - started) / calls


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    concurrencies = (1, 64)
    variants = ("none", "keys")
    cells = [(c, v) for c in concurrencies for v in variants]
    p50 = {k: [] for k in cells}
    p99 = {k: [] for k in cells}
    cpu = {k: [] for k in cells}
    added = {c: [] for c in concurrencies}
    with contextlib.ExitStack() as stack:
        clusters = {
            v: stack.enter_context(
                running_cluster(
                    GATEWAY_CPUS, LOADGEN_CPUS, auth=v == "keys", key_options=KEY_OPTIONS
                )
            )
            for v in variants
        }
        for round_no in range(args.rounds):
            for c in concurrencies:
                order = variants if round_no % 2 == 0 else variants[::-1]
                medians = {}
                for v in order:
                    cluster = clusters[v]
                    before = cpu_seconds(cluster.gateway_pids())
                    latencies = asyncio.run(
                        run_load(cluster.edge_url, c, args.requests, False, cluster.api_key)
                    )
                    used = cpu_seconds(cluster.gateway_pids()) - before
                    cpu[(c, v)].append(used / (args.requests + 20))
                    p50[(c, v)].append(pct(latencies, 0.5))
                    p99[(c, v)].append(pct(latencies, 0.99))
                    medians[v] = pct(latencies, 0.5)
                added[c].append(medians["keys"] - medians["none"])
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)

    print(
        f"\n{args.rounds} interleaved rounds x {args.requests} requests per run, non-streamed; "
        "values are median [min..max] over rounds, milliseconds\n"
    )
    print(
        "| concurrency | auth.mode | p50 | p99 | gateway CPU / request | added p50 (keys - none) |"
    )
    print("|---|---|---|---|---|---|")
    for c, v in cells:
        extra = fmt_ms(added[c]) if v == "keys" else ""
        print(
            f"| {c} | {v} | {fmt_ms(p50[(c, v)])} | {fmt_ms(p99[(c, v)])} | "
            f"{fmt_ms(cpu[(c, v)])} | {extra} |"
        )
    checks = [check_alone() for _ in range(3)]
    per_check = statistics.median(c[0] for c in checks)
    missing = statistics.median(c[1] for c in checks)
    print(
        f"\nThe edge's check alone (10,000 keys in the mirror; median of 3 x 200,000): "
        f"{per_check * 1e6:.2f} us per request (lookup, rpm/tpm window, model, band), "
        f"{missing * 1e6:.2f} us for an unknown key (the 401 response built)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
