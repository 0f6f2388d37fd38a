"""Added latency of Anthropic's Messages API next to chat completions', through the gateway.

    python benchmarks/messages_overhead.py [--rounds 3] [--requests 300]

The setup of benchmarks/overhead.py (shipped defaults: flow control and its scraper, the
provider's limits, admission in the edge, 256 sessions; a zero-delay engine and the load
generator on CPU 0, nats-server and the edge on CPU 1), at concurrency 1, streamed and not,
twice: once with the provider's default ``apis`` (a Messages request is translated to chat
completions and back) and once with ``messages`` declared (passed through to the engine's own
``/v1/messages``). Per round and scenario, in alternating order:

- chat completions direct to the engine and through the gateway (the reference overhead);
- Messages through the gateway, and direct to the engine's ``/v1/messages`` (what passthrough
  is compared with; the simulated engine's route is itself a translation, so it costs more
  than its chat route).

The report gives, per path, p50 as median [min..max] over rounds and the added p50 (gateway
minus the direct call it replaces: chat for chat and translated Messages, the engine's
``/v1/messages`` for passed-through Messages).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cluster import running_cluster
from measure import pct, reference_speed
from overhead import GATEWAY_CPUS, LOADGEN_CPUS, SESSIONS, fmt_ms, run_load

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
APIS = {"translated": None, "passed through": ["chat_completions", "completions", "messages"]}


def message_bodies(stream: bool) -> list[bytes]:
    flag = b"true" if stream else b"false"
    return [
        b'{"model": "bench-model", "max_tokens": 20, "metadata": {"user_id": "u%d"},'
        b' "messages": [{"role": "user", "content": "hello"}], "stream": %s}' % (i, flag)
        for i in range(SESSIONS)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="requests per run")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    runs = [  # (name, base: "engine" or "edge", path)
        ("chat direct", "engine", CHAT),
        ("chat via gateway", "edge", CHAT),
        ("messages direct", "engine", MESSAGES),
        ("messages via gateway", "edge", MESSAGES),
    ]
    p50: dict[tuple[str, bool, str], list[float]] = {}
    speed = reference_speed()
    for mode, apis in APIS.items():
        colocated = {"admissions": 0, "colocated": True}
        with running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=True, apis=apis, **colocated) as c:
            for round_no in range(args.rounds):
                for stream in (False, True):
                    order = runs if round_no % 2 == 0 else runs[::-1]
                    for name, base, path in order:
                        url = c.engine_url if base == "engine" else c.edge_url
                        payloads = message_bodies(stream) if path == MESSAGES else None
                        latencies = asyncio.run(
                            run_load(url, 1, args.requests, stream, path=path, payloads=payloads)
                        )
                        p50.setdefault((mode, stream, name), []).append(pct(latencies, 0.5))
                print(f"{mode}: round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    print(
        f"\nconcurrency 1, {args.rounds} interleaved rounds x {args.requests} requests per run; "
        f"p50 in milliseconds, median [min..max] over rounds; machine reference {speed:.2f} us\n"
    )
    print("| provider `apis` | streamed | path | direct p50 | gateway p50 | added p50 |")
    print("|---|---|---|---|---|---|")
    for mode in APIS:
        for stream in (False, True):
            chat_direct = p50[(mode, stream, "chat direct")]
            rows = [("chat completions", chat_direct, p50[(mode, stream, "chat via gateway")])]
            direct = chat_direct if mode == "translated" else p50[(mode, stream, "messages direct")]
            rows.append(("Messages", direct, p50[(mode, stream, "messages via gateway")]))
            for label, before, after in rows:
                added = [a - b for a, b in zip(after, before, strict=True)]
                print(
                    f"| {mode} | {'yes' if stream else 'no'} | {label} | {fmt_ms(before)} | "
                    f"{fmt_ms(after)} | {fmt_ms(added)} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
