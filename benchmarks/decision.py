"""One admission decision in process: what placement, the ledger and flow control cost alone.

    python benchmarks/decision.py [--decisions 3000] [--rounds 3] [--conversations 256]
                                  [--python PATH] [--profile KIND]

One admission instance (flow control on, as shipped) on an embedded nats-server, a managed
provider of two engines (each reported running nothing, capacity 64) with limits whose pin table
is full, and a third party. The decision is `Intake._start` called directly, synchronously, as
the colocated edge calls it, with what the edge asks for a short chat request (an API key
without a parallel limit, its band, the prompt's length and the output asked for, so the
context-window check runs); each lease ends (the ledger's release) before the next decision.
Two kinds of decision, interleaved in blocks of 200, median per round:

- *known*: a request of one of `--conversations` pinned conversations, in turn;
- *new*: a new conversation's first request: a new pin, which evicts a one-shot pin (the table
  holds the conversations and as many one-shots, so it is full), the conversations idle for
  less than `pinning.min_idle_before_evict` (not candidates).

`--only-new`: no known requests during the measurement: the conversations, used before the
one-shots, stay idle (agents thinking) while new conversations arrive.

`--python` runs the same measurement with another code tree's interpreter (before/after in one
run: the two alternate per round). `--profile known|new` prints cProfile's top functions for
that kind instead (wall-clock attribution: run it on an idle machine).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

from llmgw.config import config_from_dict
from llmgw.core.shards import shard_of
from llmgw.load import EndpointReport, LoadSample, report_key
from llmgw.nats_embedded import EmbeddedNats
from llmgw.services.admission.compose import open_admission
from llmgw.state.setup import open_load_bucket
from llmgw.wire import AdmitReply, AdmitRequest

MODEL = "m1"
ENGINES = ("engine-1", "engine-2")
BLOCK = 200  # decisions of one kind in a row


def _config(nats_url: str, run: str, pins: int) -> Any:
    return config_from_dict(
        {
            "nats": {"url": nats_url},
            "router": {"load_bucket": f"load_{run}", "stale_after": "600s"},
            "pinning": {"bucket": f"routing_{run}"},
            "admission": {"rollcall_window": "10ms"},
            "models": [{"name": MODEL}],
            "providers": [
                {
                    "id": "iris",
                    "kind": "managed",
                    "models": [
                        {
                            "name": MODEL,
                            "limits": {
                                "max_pinned_sessions": pins,
                                "max_global_in_flight_request_slots": 512,
                                "global_in_flight_request_slots_reserved_for_pinned_sessions": 64,
                                "max_per_session_in_flight_request_slots": 4,
                            },
                        }
                    ],
                },
                {"id": "tensorx", "kind": "unlimited", "models": [{"name": MODEL}]},
            ],
            "endpoints": [
                *(
                    {
                        "id": e,
                        "url": f"http://127.0.0.1:1/{e}",
                        "provider": "iris",
                        "models": [MODEL],
                        "capacity": 64,
                    }
                    for e in ENGINES
                ),
                {
                    "id": "tensorx-1",
                    "url": "http://127.0.0.1:1/t",
                    "provider": "tensorx",
                    "models": [MODEL],
                },
            ],
        }
    )


async def _measure(
    decisions: int, rounds: int, conversations: int, profile: str | None, only_new: bool = False
) -> dict:
    server = EmbeddedNats(kill_with_parent=True).start()
    try:
        run = uuid.uuid4().hex[:8]
        # The table holds the conversations and as many one-shots: full once warmed up.
        config = _config(server.url, run, 2 * conversations)
        running = await open_admission(config, "admission-0", "decision-benchmark")
        try:
            return await _decide(
                running.service, config, decisions, rounds, conversations, profile, only_new
            )
        finally:
            await running.close()
    finally:
        server.stop()


async def _decide(service, config, decisions, rounds, conversations, profile, only_new) -> dict:  # type: ignore[no-untyped-def]
    load = await open_load_bucket(service.nc, config)
    for engine in ENGINES:
        report = EndpointReport(
            endpoint=engine,
            provider="iris",
            pool="p",
            models=(MODEL,),
            healthy=True,
            sample=LoadSample(dialect="vllm", running=0, waiting=0, kv_usage=0.1),
            metrics="full",
            capacity=64,
            scraped_at=time.time(),
            scraper="benchmark",
        )
        await load.put(report_key(engine), report.to_bytes())
    for _ in range(500):  # the instance's load watch applies them (no event to wait on)
        if service.load.reports >= len(ENGINES):
            break
        await asyncio.sleep(0.01)
    else:
        raise RuntimeError("the load reports were not applied")
    shards = config.admission.shards
    intake, ledger = service.intake, service.ledger

    def one(session: str) -> float:
        request = AdmitRequest(
            id=uuid.uuid4().hex,
            edge="edge-benchmark",
            model=MODEL,
            feature="chat",
            shard=shard_of(session, shards),
            session=session,
            request_id=uuid.uuid4().hex,
            band="gold",
            tenant="bench",
            key="810b16ce0395bfe0",
            prompt_bytes=11,
            max_output=20,
        )
        started = time.perf_counter()
        reply = intake._start(request)
        took = time.perf_counter() - started
        assert isinstance(reply, AdmitReply) and reply.lease is not None, reply
        ledger.release(reply.lease.lease_id, time.time(), refresh=True)
        return took

    known = [f"conversation-{i}" for i in range(conversations)]
    for _ in range(2):  # pinned, and used twice: conversations, not one-shots
        for session in known:
            one(session)
    for _ in range(conversations):  # the rest of the table: one-shots
        one(f"one-shot-{uuid.uuid4().hex}")
    await asyncio.sleep(0)

    def block(kind: str, start: int) -> list[float]:
        if kind == "known":
            return [one(known[(start + i) % conversations]) for i in range(BLOCK)]
        return [one(f"new-{uuid.uuid4().hex}") for _ in range(BLOCK)]

    if profile is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        for n in range(0, decisions, BLOCK):
            block(profile, n)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        return {}
    medians: dict[str, list[float]] = {"known": [], "new": []}
    for _ in range(rounds):
        times: dict[str, list[float]] = {"known": [], "new": []}
        for n in range(0, decisions, BLOCK):
            for kind in ("new",) if only_new else ("new", "known"):
                times[kind] += block(kind, n)
            await asyncio.sleep(0)  # what the decisions queued (events, pin writes) goes out
        for kind, taken in times.items():
            if taken:
                medians[kind].append(statistics.median(taken) * 1e6)
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, default=3000, help="of each kind per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--python", help="also measure with this interpreter's llmgw")
    parser.add_argument("--profile", choices=("known", "new"))
    parser.add_argument("--only-new", action="store_true", help="no known requests measured")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile:
        asyncio.run(_measure(args.decisions, 1, args.conversations, args.profile))
        return 0
    if args.json:
        result = asyncio.run(_measure(args.decisions, 1, args.conversations, None, args.only_new))
        print(json.dumps(result))
        return 0
    pythons = {"this": sys.executable, **({"other": args.python} if args.python else {})}
    results: dict[str, dict[str, list[float]]] = {
        name: {"known": [], "new": []} for name in pythons
    }
    for _ in range(args.rounds):
        for name, python in pythons.items():
            out = subprocess.run(
                [python, __file__, "--json", "--decisions", str(args.decisions),
                 "--conversations", str(args.conversations),
                 *(["--only-new"] if args.only_new else [])],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            for kind, values in json.loads(out.stdout.strip().splitlines()[-1]).items():
                results[name][kind] += values
    print(f"decision in process, p50 us: median [min..max] of {args.rounds} rounds")
    print("| code | known conversation | new conversation (evicts a one-shot) |")
    print("|---|---|---|")
    for name, kinds in results.items():
        cells = [
            f"{statistics.median(v):.1f} [{min(v):.1f}..{max(v):.1f}]" if v else "-"
            for v in (kinds["known"], kinds["new"])
        ]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
