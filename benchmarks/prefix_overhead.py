"""Cache-aware placement on the hot path: llmgw's added latency at concurrency 1 for a 100-token
and an 8k-token prompt, with `prefix` on (the default) and off.

Two gateways run side by side in the shipped topology (the edge decides admission in its own
process, flow control on with a scraper: benchmarks/overhead.py's), one with
``prefix.enabled: true``, one with ``false``, each in front of its own zero-delay simulated
engine. The prompts: a system message of ~80 or ~8,000 tokens (the simulator's tokenizer; the
same text for every request, as a tenant's) and a ~20-token user message of its own per session
(256 sessions, the ``user`` field); 20 tokens out, not streamed. Every round sends ``--requests``
sequential requests of each prompt size straight to each engine and through each gateway, in
an order that alternates between rounds; *added* is gateway p50 - direct p50 within the round.
Reported: median [min..max] over rounds of the added p50 and of the gateway's CPU per request
(edge, admission, nats-server), and the paired differences that the goal names.

    python benchmarks/prefix_overhead.py [--rounds 9] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import cpu_seconds, running_cluster
from measure import pct, reference_speed
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, SESSIONS, fmt_ms, run_load
from prefix import words

from llmgw.services.sim.tokenizer import token_ids

PROMPTS = {"100": 80, "8k": 8000}  # system message tokens; the user message adds ~20


def payloads(size: str) -> list[bytes]:
    rng = random.Random(f"overhead-{size}")
    system = words(rng, PROMPTS[size], "Tenant 00 policy.")
    return [
        json.dumps(
            {
                "model": "bench-model",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(rng, 20, f"Question {i}:")},
                ],
                "max_tokens": 20,
                "user": f"u{i}",
            }
        ).encode()
        for i in range(SESSIONS)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=300, help="requests per run")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    bodies = {size: payloads(size) for size in PROMPTS}
    for size, found in bodies.items():
        prompt = json.loads(found[0])["messages"]
        length = sum(len(token_ids(m["content"])) for m in prompt)
        print(f"{size}: {length} prompt tokens, {len(found[0])} bytes of body", file=sys.stderr)
    cells = [(size, prefix) for size in PROMPTS for prefix in ("on", "off")]
    added: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    cpu: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    speed = reference_speed()
    with contextlib.ExitStack() as stack:
        clusters = {
            prefix: stack.enter_context(
                running_cluster(
                    GATEWAY_CPUS,
                    LOADGEN_CPUS,
                    flow=True,
                    admissions=0,
                    colocated=True,
                    prefix={"enabled": prefix == "on"},
                )
            )
            for prefix in ("on", "off")
        }
        for round_no in range(args.rounds):
            order = cells if round_no % 2 == 0 else cells[::-1]
            for size, prefix in order:
                cluster = clusters[prefix]
                p50 = {}
                targets = ["direct", "gateway"] if round_no % 2 == 0 else ["gateway", "direct"]
                for target in targets:
                    url = cluster.engine_url if target == "direct" else cluster.edge_url
                    marks: list[float] = []
                    latencies = asyncio.run(
                        run_load(
                            url,
                            1,
                            args.requests,
                            False,
                            mark=lambda m=marks, k=cluster: m.append(cpu_seconds(k.gateway_pids())),
                            payloads=bodies[size],
                        )
                    )
                    p50[target] = pct(latencies, 0.5)
                    if target == "gateway":
                        cpu[(size, prefix)].append((marks[1] - marks[0]) / args.requests)
                added[(size, prefix)].append(p50["gateway"] - p50["direct"])
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    print(
        f"\n{args.rounds} interleaved rounds x {args.requests} sequential requests per run, "
        "non-streamed; median [min..max] over rounds, milliseconds; machine reference "
        f"{speed:.2f} us before, {reference_speed():.2f} after (measure.reference_speed)\n"
    )
    print("| prompt | prefix | added p50 | gateway CPU / request |")
    print("|---|---|---|---|")
    for cell in cells:
        print(f"| {cell[0]} tokens | {cell[1]} | {fmt_ms(added[cell])} | {fmt_ms(cpu[cell])} |")
    pairs = {
        "8k on - 100 off (the goal: <= 0.2 ms)": (("8k", "on"), ("100", "off")),
        "8k on - 100 on": (("8k", "on"), ("100", "on")),
        "8k on - 8k off (the prefix's own cost at 8k)": (("8k", "on"), ("8k", "off")),
        "100 on - 100 off": (("100", "on"), ("100", "off")),
    }
    print("\n| paired difference of added p50, per round | median [min..max] | CPU |")
    print("|---|---|---|")
    for label, (a, b) in pairs.items():
        diff = [x - y for x, y in zip(added[a], added[b], strict=True)]
        cpu_diff = [x - y for x, y in zip(cpu[a], cpu[b], strict=True)]
        print(f"| {label} | {fmt_ms(diff)} | {fmt_ms(cpu_diff)} |")
    print(
        "\nmedians: "
        + ", ".join(f"{c[0]}/{c[1]} {statistics.median(added[c]) * 1e3:.3f}" for c in cells)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
