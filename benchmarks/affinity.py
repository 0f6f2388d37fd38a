"""Session affinity on engine replicas: prefix-cache hits and TTFT, affinity vs random vs least-loaded.

Three simulated engines (`llmgw sim engine` apps on uvicorn, in this process) with prefix
caching, each cache holding about half of the workload's conversations. Multi-turn chats: every
session starts with its own ~300-token system prompt and adds a ~100-token user turn and the
answer per turn, so each turn's prompt begins with the whole previous prompt. Between turns a
session's user thinks (50-300 ms); the next free worker sends its next turn. Each request picks a
replica with:

- affinity: llmgw.core.affinity (consistent hashing with bounded loads, load factor 1.25, the
  load being each replica's requests in flight), as admission does for a session;
- random: any replica;
- least-loaded: the replica with the fewest requests in flight.

Reported: prefix-cache hit rate (cached prompt tokens / prompt tokens, from the engines' usage),
the workload's ideal hit rate (every cacheable block of the previous turn found), and TTFT p50 /
p90 (first streamed content token).

    python benchmarks/affinity.py [--sessions 48] [--turns 8] [--workers 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from llmgw.core.affinity import HashRing, bounded_load_choice
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server

REPLICAS = ("engine-1", "engine-2", "engine-3")
BLOCK = 16


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ideal_cached: int
    ttft: float


class Conversation:
    """One session's chat so far."""

    def __init__(self, number: int, seed: int) -> None:
        self.number = number
        self.rng = random.Random(seed * 100_000 + number)
        self.messages: list[dict] = [{"role": "system", "content": words(self.rng, 300)}]
        self.previous_prompt = 0
        self.turns = 0


def engine_params(seed: int, blocks: int) -> EngineParams:
    return EngineParams(
        max_num_seqs=8,
        num_gpu_blocks=blocks,
        block_size=BLOCK,
        max_model_len=16384,
        prefill_base=0.002,
        prefill_per_token=0.0003,
        itl_base=0.008,
        itl_per_running_seq=0.0002,
        seed=seed,
    )


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(count))


def chooser(
    strategy: str, inflight: Counter[str], rng: random.Random, load_factor: float = 1.25
) -> Callable[[str], str]:
    ring = HashRing(REPLICAS)
    if strategy == "affinity":
        return lambda session: (
            bounded_load_choice(ring, session, inflight, load_factor) or REPLICAS[0]
        )
    if strategy == "random":
        return lambda session: rng.choice(REPLICAS)
    return lambda session: min(REPLICAS, key=lambda r: (inflight[r], rng.random()))


async def stream_one(
    session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int
) -> tuple[float, dict, str]:
    """TTFT, usage and the answer's text of one streamed chat completion."""
    body = {
        "model": "sim",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # the answer is as long as the turn says
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    usage: dict = {}
    text = []
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(content)
    return ttft or (time.perf_counter() - started), usage, "".join(text)


async def run_strategy(
    strategy: str,
    *,
    sessions: int,
    turns: int,
    workers: int,
    blocks: int,
    seed: int = 11,
    load_factor: float = 1.25,
) -> list[Turn]:
    servers: dict[str, RunningServer] = {}
    for n, name in enumerate(REPLICAS):
        servers[name] = await start_server(create_engine_app(engine_params(n, blocks), ["sim"]))
    inflight: Counter[str] = Counter()
    pick = chooser(strategy, inflight, random.Random(seed), load_factor)
    results: list[Turn] = []
    # Sessions wait in one queue for their next turn (after a think time), and whichever worker
    # is free takes the next one: a session's turns are not tied to a worker, as real traffic's
    # are not to a connection. (Tied, "least loaded" turns sticky by accident: a session's next
    # turn would start just as its own previous turn freed a place on its replica.)
    ready: asyncio.Queue[Conversation | None] = asyncio.Queue()
    for number in range(sessions):
        ready.put_nowait(Conversation(number, seed))
    remaining = sessions
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def come_back(conversation: Conversation) -> None:
                await asyncio.sleep(conversation.rng.uniform(0.05, 0.3))  # the user reads, types
                ready.put_nowait(conversation)

            later: set[asyncio.Task[None]] = set()

            async def worker() -> None:
                nonlocal remaining
                while (conversation := await ready.get()) is not None:
                    conversation.messages.append(
                        {"role": "user", "content": words(conversation.rng, 100)}
                    )
                    replica = pick(f"session-{conversation.number}")
                    inflight[replica] += 1
                    try:
                        ttft, usage, answer = await stream_one(
                            http,
                            servers[replica].url,
                            conversation.messages,
                            conversation.rng.randint(16, 48),
                        )
                    finally:
                        inflight[replica] -= 1
                    prompt = usage.get("prompt_tokens", 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    ideal = min(conversation.previous_prompt // BLOCK * BLOCK, max(prompt - 1, 0))
                    results.append(Turn(prompt, cached, ideal, ttft))
                    conversation.previous_prompt = prompt
                    conversation.messages.append({"role": "assistant", "content": answer})
                    conversation.turns += 1
                    if conversation.turns < turns:
                        task = asyncio.create_task(come_back(conversation))
                        later.add(task)
                        task.add_done_callback(later.discard)
                    else:
                        remaining -= 1
                        if remaining == 0:
                            for _ in range(workers):
                                ready.put_nowait(None)

            await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        for server in servers.values():
            await server.stop()
    return results


def summarize(turns: list[Turn]) -> dict[str, float]:
    prompt = sum(t.prompt_tokens for t in turns)
    ttfts = sorted(t.ttft for t in turns)
    return {
        "requests": len(turns),
        "hit_rate": sum(t.cached_tokens for t in turns) / prompt,
        "ideal_hit_rate": sum(t.ideal_cached for t in turns) / prompt,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
    }


async def compare(
    sessions: int,
    turns: int,
    workers: int,
    blocks: int,
    load_factor: float = 1.25,
    *,
    together: bool = False,
) -> dict[str, dict[str, float]]:
    """Every strategy on its own engines, one after another or (`together`) side by side on one
    event loop: the same workload in about a third of the time, under the same host noise."""
    strategies = ("affinity", "random", "least_loaded")
    runs = [
        run_strategy(
            strategy,
            sessions=sessions,
            turns=turns,
            workers=workers,
            blocks=blocks,
            load_factor=load_factor,
        )
        for strategy in strategies
    ]
    done = await asyncio.gather(*runs) if together else [await run for run in runs]
    results = {}
    for strategy, turns_done in zip(strategies, done, strict=True):
        results[strategy] = summarize(turns_done)
        print(f"{strategy}: {results[strategy]}", file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=3072, help="KV blocks per engine")
    parser.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        help="affinity's bound: scoring.session_load_factor",
    )
    args = parser.parse_args()
    results = asyncio.run(
        compare(args.sessions, args.turns, args.workers, args.blocks, args.load_factor)
    )
    print(
        f"\n{args.sessions} sessions x {args.turns} turns, {args.workers} at a time, "
        f"3 engines x {args.blocks} blocks of {BLOCK} tokens, load factor {args.load_factor}\n"
    )
    print("| strategy | prefix-cache hit rate | % of ideal | TTFT p50 (ms) | TTFT p90 (ms) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['hit_rate']:.1%} | {r['hit_rate'] / r['ideal_hit_rate']:.0%} | "
            f"{r['ttft_p50'] * 1000:.0f} | {r['ttft_p90'] * 1000:.0f} |"
        )
    print(f"\nideal hit rate of the workload: {results['affinity']['ideal_hit_rate']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
