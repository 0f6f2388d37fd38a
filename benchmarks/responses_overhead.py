"""Added latency of the Responses API path next to chat completions', gateway versus engine.

    python benchmarks/responses_overhead.py [--rounds 3] [--requests 200] [--turns 4]
        [--chat-only] [--before OLD/.venv/bin/python] [--variant NAME:VAR=VALUE[,VAR=VALUE]]...

The cluster is overhead.py's (the shipped defaults: flow control on with a scraper, the
provider's limits, the edge deciding admission in its own process, a zero-delay simulated
engine), so every millisecond is transport and gateway work. `--chat-only`: the provider
serves chat completions only (`providers[].apis`), so every Responses request is translated.
Per concurrency (1 and 16) and streamed or not, four kinds of request run interleaved, against
the engine directly and through the gateway:

- chat: a chat completion (overhead.py's body: one short message, 256 sessions in turn);
- chat-new: the same, each opening a new session (a new conversation: its pin is written);
- chat-long: a chat completion carrying the chain kind's conversation in chat form (the same
  prompt as a chained turn, 32 sessions in turn);
- responses: a Responses request of one turn (the gateway stores it), each opening a
  conversation never seen before, so a new session, as chat-new;
- chain: the next turn of one of 32 chains of `--turns` stored responses, written before the
  run (`previous_response_id`; the gateway reads the chain and sends the expanded input);
  directly, the engine gets that same expanded input;
- stateless: the chain kind's conversation resent whole, as agents that keep their own history
  send it (``store: false``, no ``previous_response_id``; the same body directly): one session per
  conversation, its opening's, as chat-long;
- live: chains as an agent runs them: each client continues its own chain with the response it
  has just got (so the previous response was written a moment ago), a new chain after
  `--turns` + 1 turns; directly, the engine gets the expanded input of the same turn.

Clusters: this tree's (`after`); each `--variant`, this tree with environment overrides (config:
``LLMGW_RESPONSES__CACHE_BYTES=0``); `--before`, the llmgw another interpreter has installed
(an earlier commit's worktree), all started at once and measured in turn, in an order that
rotates each round. The report gives, per cluster and kind, the paired difference gateway -
direct of p50 and p99, and the gateway's CPU time per measured request (edge, admission,
nats-server), as median [min..max] over rounds, in milliseconds; then each Responses kind next
to chat in the same round: at concurrency 1 the added p50 minus chat's, at 16 their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from cluster import cpu_seconds, running_cluster
from measure import pct, reference_speed
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, WARMUP, bodies, fmt_ms, run_load

from llmgw.core.responses_chat import chat_messages

CHAINS = 32  # chains measured in turn (each a session of its own)
KINDS = ("chat", "chat-new", "chat-long", "responses", "chain", "stateless", "live")
RESPONSES_KINDS = ("responses", "chain", "stateless", "live")
CHAT_ONLY = ["chat_completions", "completions", "embeddings"]
_JSON = {"content-type": "application/json"}


def responses_bodies(stream: bool, count: int) -> list[bytes]:
    """`count` one-turn Responses requests, each of a conversation never seen before."""
    nonce = uuid.uuid4().hex
    return [
        json.dumps(
            {
                "model": "bench-model",
                "input": f"hello {nonce} {i}",
                "max_output_tokens": 20,
                "stream": stream,
            }
        ).encode()
        for i in range(count)
    ]


def question(chain: int | str, turn: int) -> dict:
    return {"type": "message", "role": "user", "content": f"c{chain} t{turn}"}


async def make_chains(edge_url: str, turns: int) -> tuple[list[str], list[list[list[dict]]]]:
    """`CHAINS` chains of `turns` stored responses through the gateway: the last ids, and each
    chain's expanded input after each of its turns (what the gateway sends the engine for the
    next turn, but that)."""
    last_ids, expanded = [], []
    async with aiohttp.ClientSession() as session:
        for chain in range(CHAINS):
            previous, items, prefixes = None, [], [[]]
            for turn in range(turns):
                body = {
                    "model": "bench-model",
                    "input": [question(chain, turn)],
                    "max_output_tokens": 20,
                    "previous_response_id": previous,
                }
                async with session.post(edge_url + "/v1/responses", json=body) as r:
                    response = await r.json()
                    assert r.status == 200, response
                items = [*items, question(chain, turn), *response["output"]]
                prefixes.append(items)
                previous = response["id"]
            last_ids.append(previous)
            expanded.append(prefixes)
    return last_ids, expanded


def chain_bodies(stream: bool, last_ids: list[str], expanded: list[list[list[dict]]]):  # type: ignore[no-untyped-def]
    new = {"type": "message", "role": "user", "content": "and next?"}
    base = {"model": "bench-model", "max_output_tokens": 20, "stream": stream}
    via_gateway = [
        json.dumps({**base, "input": [new], "previous_response_id": rid}).encode()
        for rid in last_ids
    ]
    direct = [
        json.dumps({**base, "input": [*prefixes[-1], new], "store": False}).encode()
        for prefixes in expanded
    ]
    return direct, via_gateway


def chat_new_bodies(stream: bool, count: int) -> list[bytes]:
    """`count` chat completions, each of a session never seen before."""
    nonce = uuid.uuid4().hex
    return [
        json.dumps(
            {
                "model": "bench-model",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 20,
                "user": f"new-{nonce}-{i}",
                "stream": stream,
            }
        ).encode()
        for i in range(count)
    ]


def chat_long_bodies(stream: bool, expanded: list[list[list[dict]]]) -> list[bytes]:
    """The chain kind's conversations (with its next question) as chat completions."""
    new = {"type": "message", "role": "user", "content": "and next?"}
    return [
        json.dumps(
            {
                "model": "bench-model",
                "messages": chat_messages(None, [*prefixes[-1], new]),
                "max_tokens": 20,
                "user": f"long-{chain}",
                "stream": stream,
            }
        ).encode()
        for chain, prefixes in enumerate(expanded)
    ]


def live_direct_bodies(stream: bool, expanded: list[list[list[dict]]]) -> list[bytes]:
    """What the engine gets for turn k of a live chain (k = 0 .. --turns), in turn."""
    base = {"model": "bench-model", "max_output_tokens": 20, "stream": stream, "store": False}
    turns = len(expanded[0])
    return [
        json.dumps(
            {**base, "input": [*expanded[i % CHAINS][i % turns], question("live", i % turns)]}
        ).encode()
        for i in range(CHAINS * turns)
    ]


async def _live_turn(
    session: aiohttp.ClientSession, url: str, body: dict, stream: bool
) -> tuple[float, str]:
    """One turn of a live chain: its latency and its response's id."""
    started = time.perf_counter()
    async with session.post(url, data=json.dumps(body).encode(), headers=_JSON) as r:
        payload = await r.read()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {payload[:200]!r}")
    took = time.perf_counter() - started
    if not stream:
        return took, json.loads(payload)["id"]
    first = payload.split(b"data:", 1)[1].split(b"\n", 1)[0]  # response.created
    return took, json.loads(first)["response"]["id"]


async def run_live(
    base_url: str, concurrency: int, total: int, stream: bool, turns: int, mark: Callable[[], None]
) -> list[float]:
    """`total` turns of live chains at `concurrency` (one chain at a time per client, each of
    `turns` + 1 turns), after a warm-up as run_load's."""
    url = base_url + "/v1/responses"
    base = {"model": "bench-model", "max_output_tokens": 20, "stream": stream}
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(count: int, into: list[float] | None) -> None:
            previous, turn = None, 0
            for _ in range(count):
                body = {**base, "input": [question("live", turn)], "previous_response_id": previous}
                took, rid = await _live_turn(session, url, body, stream)
                if into is not None:
                    into.append(took)
                previous, turn = (rid, turn + 1) if turn < turns else (None, 0)

        await client(WARMUP, None)
        if concurrency > 1:
            await asyncio.gather(*(client(1, None) for _ in range(concurrency)))
        mark()
        share = [total // concurrency + (i < total % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(client(n, latencies) for n in share))
        mark()
    return latencies


def _next_to(mine: list[float], chat: list[float], concurrency: int) -> str:
    """Per round: at concurrency 1 the difference (ms), else the ratio; median [min..max]."""
    if concurrency == 1:
        rel = [(m - ch) * 1e3 for m, ch in zip(mine, chat, strict=True)]
        return f"{statistics.median(rel):+.2f} [{min(rel):+.2f}..{max(rel):+.2f}]"
    rel = [m / ch for m, ch in zip(mine, chat, strict=True)]
    return f"{statistics.median(rel):.2f}x [{min(rel):.2f}..{max(rel):.2f}]"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition(":")
    env = dict(pair.split("=", 1) for pair in assignments.split(",") if pair)
    return name, env


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="requests per run")
    parser.add_argument("--turns", type=int, default=4, help="stored turns before the chain's")
    parser.add_argument("--chat-only", action="store_true", help="the provider: chat only")
    parser.add_argument("--before", help="the baseline's python (another tree's llmgw)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        help="NAME:VAR=VALUE[,VAR=VALUE]: this tree with that environment",
    )
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    trees: dict[str, tuple[str | None, dict[str, str]]] = {"after": (None, {})}
    trees.update({name: (None, env) for name, env in args.variant})
    if args.before:
        trees["before"] = (args.before, {})
    scenarios = [(c, s, kind) for c in (1, 16) for s in (False, True) for kind in KINDS]
    added: dict = {(t, sc): {"p50": [], "p99": []} for t in trees for sc in scenarios}
    cpu: dict = {(t, sc): [] for t in trees for sc in scenarios}
    direct_p50: dict = {sc: [] for sc in scenarios}
    speed_before = reference_speed()
    apis = CHAT_ONLY if args.chat_only else None
    with contextlib.ExitStack() as stack:
        clusters = {
            name: stack.enter_context(
                running_cluster(
                    GATEWAY_CPUS,
                    LOADGEN_CPUS,
                    flow=True,
                    admissions=0,
                    colocated=True,
                    python=python,
                    apis=apis,
                    env=env,
                )
            )
            for name, (python, env) in trees.items()
        }
        payloads: dict = {}
        for name, cluster in clusters.items():
            last_ids, expanded = asyncio.run(make_chains(cluster.edge_url, args.turns))
            for stream in (False, True):
                chat = bodies(stream)
                chain_direct, chain_gateway = chain_bodies(stream, last_ids, expanded)
                long = chat_long_bodies(stream, expanded)
                payloads[name, stream] = {
                    "chat": ("/v1/chat/completions", chat, chat),
                    "chat-new": ("/v1/chat/completions", None, None),
                    "chat-long": ("/v1/chat/completions", long, long),
                    "responses": ("/v1/responses", None, None),
                    "chain": ("/v1/responses", chain_direct, chain_gateway),
                    "stateless": ("/v1/responses", chain_direct, chain_direct),
                    "live": ("/v1/responses", live_direct_bodies(stream, expanded), None),
                }
        names = list(clusters)
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for scenario in scenarios:
                concurrency, stream, kind = scenario
                first = clusters[names[0]]
                path, direct_bodies, _ = payloads[names[0], stream][kind]
                fresh = args.requests + WARMUP + concurrency  # chat-new, responses: every run's own
                fresh_bodies = {"chat-new": chat_new_bodies, "responses": responses_bodies}.get(
                    kind
                )
                if fresh_bodies is not None:
                    direct_bodies = fresh_bodies(stream, fresh)
                direct = asyncio.run(
                    run_load(
                        first.engine_url,
                        concurrency,
                        args.requests,
                        stream,
                        path=path,
                        payloads=direct_bodies,
                    )
                )
                direct_p50[scenario].append(pct(direct, 0.5))
                for name in order:
                    cluster = clusters[name]
                    marks: list[float] = []

                    def mark(c=cluster, m=marks) -> None:  # type: ignore[no-untyped-def]
                        m.append(cpu_seconds(c.gateway_pids()))

                    if kind == "live":
                        latencies = asyncio.run(
                            run_live(
                                cluster.edge_url,
                                concurrency,
                                args.requests,
                                stream,
                                args.turns,
                                mark,
                            )
                        )
                    else:
                        sent = payloads[name, stream][kind][2]
                        latencies = asyncio.run(
                            run_load(
                                cluster.edge_url,
                                concurrency,
                                args.requests,
                                stream,
                                mark=mark,
                                path=path,
                                payloads=sent or fresh_bodies(stream, fresh),  # type: ignore[misc]
                            )
                        )
                    cpu[name, scenario].append((marks[1] - marks[0]) / args.requests)
                    for q, key in ((0.5, "p50"), (0.99, "p99")):
                        added[name, scenario][key].append(pct(latencies, q) - pct(direct, q))
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(
        f"\nshipped defaults{' (provider: chat completions only)' if args.chat_only else ''}, "
        f"{args.rounds} interleaved rounds x {args.requests} requests per run, chains of "
        f"{args.turns} stored turns; values are median [min..max] over rounds, milliseconds; "
        f"machine reference {speed_before:.2f} us before, {reference_speed():.2f} after "
        "(measure.reference_speed)\n"
    )
    print("| code | concurrency | streamed | request | direct p50 | added p50 | added p99 | CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for scenario in scenarios:
            c, s, kind = scenario
            print(
                f"| {name} | {c} | {'yes' if s else 'no'} | {kind} | "
                f"{fmt_ms(direct_p50[scenario])} | {fmt_ms(added[name, scenario]['p50'])} | "
                f"{fmt_ms(added[name, scenario]['p99'])} | {fmt_ms(cpu[name, scenario])} |"
            )
    print(
        "\nnext to a chat kind, same round (c=1: added p50 - the chat kind's, ms; c=16: "
        "added p50 / the chat kind's):\n"
    )
    print(f"| code | concurrency | streamed | next to | {' | '.join(RESPONSES_KINDS)} |")
    print("|---|---|---|---|" + "---|" * len(RESPONSES_KINDS))
    for name in names:
        for c in (1, 16):
            for s in (False, True):
                for reference in ("chat", "chat-new", "chat-long"):
                    cells = [
                        _next_to(
                            added[name, (c, s, kind)]["p50"],
                            added[name, (c, s, reference)]["p50"],
                            c,
                        )
                        for kind in RESPONSES_KINDS
                    ]
                    print(
                        f"| {name} | {c} | {'yes' if s else 'no'} | {reference} | "
                        f"{' | '.join(cells)} |"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
