"""Added latency of the Responses API path next to chat completions', gateway versus engine.

    python benchmarks/responses_overhead.py [--rounds 3] [--requests 200] [--turns 4]

The cluster is overhead.py's (the shipped defaults: flow control on with a scraper, the
provider's limits, the edge deciding admission in its own process, a zero-delay simulated
engine), so every millisecond is transport and gateway work. Per concurrency (1 and 16) and
streamed or not, three pairs run interleaved, each request against the engine directly and
through the gateway:

- chat: a chat completion (overhead.py's body);
- responses: a Responses request of one turn (the gateway stores it);
- chain: the next turn of a chain of `--turns` stored responses (`previous_response_id`: the
  gateway reads the chain, one KV get per turn, and sends the expanded input); directly, the
  engine gets that same expanded input.

The report gives, per pair, the paired difference gateway - direct of p50 and p99 as median
[min..max] over rounds, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from cluster import running_cluster
from measure import pct, reference_speed
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, bodies, fmt_ms, run_load

CHAINS = 32  # chains measured in turn (each a session of its own)


def responses_bodies(stream: bool, count: int) -> list[bytes]:
    return [
        json.dumps(
            {
                "model": "bench-model",
                "input": f"hello {i}",
                "max_output_tokens": 20,
                "stream": stream,
            }
        ).encode()
        for i in range(count)
    ]


async def make_chains(edge_url: str, turns: int) -> tuple[list[str], list[list[dict]]]:
    """`CHAINS` chains of `turns` stored responses through the gateway: the last ids, and each
    chain's expanded input (what the gateway sends the engine for the next turn, but that)."""
    last_ids, expanded = [], []
    async with aiohttp.ClientSession() as session:
        for chain in range(CHAINS):
            previous, items = None, []
            for turn in range(turns):
                question = {"type": "message", "role": "user", "content": f"c{chain} t{turn}"}
                body = {
                    "model": "bench-model",
                    "input": [question],
                    "max_output_tokens": 20,
                    "previous_response_id": previous,
                }
                async with session.post(edge_url + "/v1/responses", json=body) as r:
                    response = await r.json()
                    assert r.status == 200, response
                items += [question, *response["output"]]
                previous = response["id"]
            last_ids.append(previous)
            expanded.append(items)
    return last_ids, expanded


def chain_bodies(stream: bool, last_ids: list[str], expanded: list[list[dict]]):  # type: ignore[no-untyped-def]
    new = {"type": "message", "role": "user", "content": "and next?"}
    base = {"model": "bench-model", "max_output_tokens": 20, "stream": stream}
    via_gateway = [
        json.dumps({**base, "input": [new], "previous_response_id": rid}).encode()
        for rid in last_ids
    ]
    direct = [
        json.dumps({**base, "input": [*items, new], "store": False}).encode() for items in expanded
    ]
    return direct, via_gateway


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="requests per run")
    parser.add_argument("--turns", type=int, default=4, help="stored turns before the chain's")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    scenarios = [(c, s, kind) for c in (1, 16) for s in (False, True) for kind in
                 ("chat", "responses", "chain")]  # fmt: skip
    diffs = {s: {"p50": [], "p99": []} for s in scenarios}
    direct_p50 = {s: [] for s in scenarios}
    speed_before = reference_speed()
    with running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=True, admissions=0, colocated=True) as cl:
        last_ids, expanded = asyncio.run(make_chains(cl.edge_url, args.turns))
        payloads = {}
        for stream in (False, True):
            chat = bodies(stream)
            single = responses_bodies(stream, CHAINS)
            chain_direct, chain_gateway = chain_bodies(stream, last_ids, expanded)
            payloads[stream] = {
                "chat": ("/v1/chat/completions", chat, chat),
                "responses": ("/v1/responses", single, single),
                "chain": ("/v1/responses", chain_direct, chain_gateway),
            }
        for round_no in range(args.rounds):
            for scenario in scenarios:
                concurrency, stream, kind = scenario
                path, direct_bodies, gateway_bodies = payloads[stream][kind]
                order = ["direct", "gateway"] if round_no % 2 == 0 else ["gateway", "direct"]
                results = {}
                for target in order:
                    url = cl.engine_url if target == "direct" else cl.edge_url
                    sent = direct_bodies if target == "direct" else gateway_bodies
                    results[target] = asyncio.run(
                        run_load(url, concurrency, args.requests, stream, path=path, payloads=sent)
                    )
                for q, key in ((0.5, "p50"), (0.99, "p99")):
                    diffs[scenario][key].append(
                        pct(results["gateway"], q) - pct(results["direct"], q)
                    )
                direct_p50[scenario].append(pct(results["direct"], 0.5))
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    print(
        f"\nshipped defaults, {args.rounds} interleaved rounds x {args.requests} requests per run, "
        f"chains of {args.turns} stored turns; values are median [min..max] over rounds, "
        f"milliseconds; machine reference {speed_before:.2f} us before, "
        f"{reference_speed():.2f} after (measure.reference_speed)\n"
    )
    print("| concurrency | streamed | request | direct p50 | added p50 | added p99 |")
    print("|---|---|---|---|---|---|")
    for scenario in scenarios:
        c, s, kind = scenario
        print(
            f"| {c} | {'yes' if s else 'no'} | {kind} | {fmt_ms(direct_p50[scenario])} | "
            f"{fmt_ms(diffs[scenario]['p50'])} | {fmt_ms(diffs[scenario]['p99'])} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
