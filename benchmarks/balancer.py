"""The rate balancer against round robin and an oracle, on drifting simulated deployments.

Three simulated third-party deployments (`llmgw sim provider` apps on uvicorn, in this process)
whose output rates differ 3x and drift: `a` starts slow (30 tokens/s) and recovers to 90 halfway
through, `b` starts fast (90) and degrades to 25, `c` holds 60. Closed-loop workers send chat
requests (a 400-token prompt, 20-60 output tokens) and pick a deployment per request with:

- balancer: llmgw.core.balancer, fed with every finished request (as edges feed admission);
- round robin: the next deployment in turn;
- oracle: the deployment whose true rate is highest right now (it knows the schedule).

Per strategy: mean effective token rate per request ((output + input/250) / latency), p90
latency, and the time to adapt after the change (until 60% of the picks of the next 2 s go to
the new best deployment). `--sweep` also runs the balancer over greediness values and draws
the trade-off (docs/balancer-greediness.png; needs matplotlib: pip install matplotlib).

    python benchmarks/balancer.py [--duration 40] [--window 8] [--sweep]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from llmgw.core.balancer import BalancerSettings, RateSample, RateWindows, choose, weights
from llmgw.services.sim.apps import create_provider_app
from llmgw.services.sim.params import ProviderParams
from llmgw.serving import RunningServer, start_server

RATIO = 250.0
PROMPT = "word " * 400  # ~400 prompt tokens with the simulator's tokenizer


@dataclass(frozen=True)
class Deployment:
    name: str
    before: float  # tokens/s in the first half
    after: float  # tokens/s from the change on


DEPLOYMENTS = (Deployment("a", 30, 90), Deployment("b", 90, 25), Deployment("c", 60, 60))


@dataclass(frozen=True)
class Done:
    started: float  # seconds since the run started
    deployment: str
    latency: float
    rate: float


def true_rate(deployment: Deployment, elapsed: float, change_at: float) -> float:
    return deployment.after if elapsed >= change_at else deployment.before


async def start_deployments(change_at: float) -> dict[str, RunningServer]:
    servers = {}
    for seed, d in enumerate(DEPLOYMENTS):
        params = ProviderParams(
            tokens_per_second=d.before,
            input_tokens_per_second=20_000,
            base_latency=0.05,
            drift=[{"at": change_at, "tokens_per_second": d.after}],
            seed=seed,
        )
        servers[d.name] = await start_server(create_provider_app(params, ["sim"]))
    return servers


def pick_function(
    strategy: str, windows: RateWindows, change_at: float, rng: random.Random
) -> Callable[[float], str]:
    names = [d.name for d in DEPLOYMENTS]
    turn = itertools.cycle(names)
    if strategy == "round_robin":
        return lambda elapsed: next(turn)
    if strategy == "oracle":
        return lambda elapsed: max(DEPLOYMENTS, key=lambda d: true_rate(d, elapsed, change_at)).name
    clock_start = time.time()

    def balanced(elapsed: float) -> str:
        rates = windows.snapshot(names, clock_start + elapsed)
        return choose(weights(rates, windows.settings), rng)

    return balanced


async def run_strategy(
    strategy: str, *, duration: float, window: float, greediness: float, workers: int, seed: int = 7
) -> list[Done]:
    change_at = duration / 2
    windows = RateWindows(
        BalancerSettings(window=window, input_to_output_token_ratio=RATIO, greediness=greediness)
    )
    rng = random.Random(seed)
    servers = await start_deployments(change_at)
    started = time.perf_counter()
    wall_start = time.time()
    pick = pick_function(strategy, windows, change_at, rng)
    done: list[Done] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def worker(number: int) -> None:
                lengths = random.Random(seed * 1000 + number)
                while (elapsed := time.perf_counter() - started) < duration:
                    name = pick(elapsed)
                    body = {
                        "model": "sim",
                        "max_tokens": lengths.randint(20, 60),
                        "ignore_eos": True,  # exactly that many tokens
                        "messages": [{"role": "user", "content": PROMPT}],
                    }
                    sent = time.perf_counter()
                    async with session.post(
                        servers[name].url + "/v1/chat/completions", json=body
                    ) as response:
                        payload = await response.json()
                    latency = time.perf_counter() - sent
                    usage = payload.get("usage") or {}
                    sample = RateSample(
                        at=wall_start + (time.perf_counter() - started),
                        latency=latency,
                        output_tokens=usage.get("completion_tokens", 0),
                        input_tokens=usage.get("prompt_tokens", 0),
                    )
                    windows.add(name, sample)
                    rate = (sample.output_tokens + sample.input_tokens / RATIO) / latency
                    done.append(Done(elapsed, name, latency, rate))

            await asyncio.gather(*(worker(n) for n in range(workers)))
    finally:
        for server in servers.values():
            await server.stop()
    return done


def time_to_adapt(
    done: list[Done], change_at: float, best: str, span: float = 2.0, share: float = 0.6
) -> float:
    """Seconds after the change until, for the first time, `share` of the picks made in the
    next `span` seconds go to `best` (inf if never: round robin gives it a third)."""
    after = sorted((d for d in done if d.started >= change_at), key=lambda d: d.started)
    end = max((d.started for d in after), default=change_at)
    for d in after:
        if d.started + span > end:
            break
        picks = [x for x in after if d.started <= x.started < d.started + span]
        if sum(x.deployment == best for x in picks) >= share * len(picks):
            return d.started - change_at
    return float("inf")


def summarize(done: list[Done], duration: float) -> dict[str, float]:
    latencies = sorted(d.latency for d in done)
    return {
        "requests": len(done),
        "mean_rate": statistics.fmean(d.rate for d in done),
        "p90_latency": latencies[int(0.9 * (len(latencies) - 1))],
        "adapt": time_to_adapt(done, duration / 2, "a"),
    }


async def compare(
    duration: float, window: float, greediness: float, workers: int, *, together: bool = False
) -> dict[str, dict[str, float]]:
    """Every strategy on its own deployments, one after another or (`together`) side by side
    on one event loop: the same workload in a third of the time, each strategy under the same
    host noise as the others."""
    strategies = ("oracle", "balancer", "round_robin")
    runs = [
        run_strategy(s, duration=duration, window=window, greediness=greediness, workers=workers)
        for s in strategies
    ]
    done = await asyncio.gather(*runs) if together else [await run for run in runs]
    results = {}
    for strategy, finished in zip(strategies, done, strict=True):
        results[strategy] = summarize(finished, duration)
        print(f"{strategy}: {results[strategy]}", file=sys.stderr)
    return results


def plot_sweep(points: list[tuple[float, dict[str, float]]], oracle: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, left = plt.subplots(figsize=(7, 4))
    xs = [g for g, _ in points]
    left.plot(xs, [r["mean_rate"] / oracle * 100 for _, r in points], "o-", color="tab:blue")
    left.set_xlabel("greediness (SLA percentile / 100)")
    left.set_ylabel("mean effective rate, % of oracle", color="tab:blue")
    right = left.twinx()
    right.plot(xs, [r["adapt"] for _, r in points], "s--", color="tab:red")
    right.set_ylabel("time to adapt after the change (s)", color="tab:red")
    left.set_title("Rate balancer: greediness trade-off (3 drifting deployments)")
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per strategy")
    parser.add_argument("--window", type=float, default=8.0, help="balancer window, seconds")
    parser.add_argument("--greediness", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sweep", action="store_true", help="greediness sweep and PNG plot")
    args = parser.parse_args()
    results = asyncio.run(compare(args.duration, args.window, args.greediness, args.workers))
    oracle = results["oracle"]["mean_rate"]
    print(
        f"\n{args.duration:g} s per strategy, change at {args.duration / 2:g} s, window "
        f"{args.window:g} s, greediness {args.greediness}, {args.workers} workers\n"
    )
    print(
        "| strategy | requests | mean effective rate (tokens/s) | % of oracle | p90 latency (s) "
        "| time to adapt (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['requests']:.0f} | {r['mean_rate']:.1f} | "
            f"{r['mean_rate'] / oracle * 100:.0f}% | {r['p90_latency']:.2f} | {r['adapt']:.1f} |"
        )
    if args.sweep:
        points = []
        for greediness in (0.1, 0.3, 0.5, 0.7, 0.9, 0.97):
            done = asyncio.run(
                run_strategy(
                    "balancer",
                    duration=args.duration,
                    window=args.window,
                    greediness=greediness,
                    workers=args.workers,
                )
            )
            points.append((greediness, summarize(done, args.duration)))
            print(f"greediness {greediness}: {points[-1][1]}", file=sys.stderr)
        print("\n| greediness | mean effective rate | % of oracle | time to adapt (s) |")
        print("|---|---|---|---|")
        for greediness, r in points:
            print(
                f"| {greediness} | {r['mean_rate']:.1f} | {r['mean_rate'] / oracle * 100:.0f}% "
                f"| {r['adapt']:.1f} |"
            )
        out = Path(__file__).resolve().parents[1] / "docs" / "balancer-greediness.png"
        plot_sweep(points, oracle, out)
        print(f"\nplot: {out.relative_to(out.parents[1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
