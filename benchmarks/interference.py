"""Flow control's promise as a benchmark: platinum latency under a 500-request bronze flood.

The scenario (shared with tests/up/test_interference.py, which asserts on one run of it): a whole
cluster under `llmgw up` (embedded NATS, two simulated engines, scraper, admission, reaper,
edge), driven through the edge's HTTP API like any client:

1. idle: platinum probes alone (a fixed rate, open loop) give the baseline;
2. 500 bronze requests run continuously (each worker sends the next as soon as one ends) and
   platinum probes arrive at the same fixed rate. With admission on, bronze waits in admission's
   queue (its ceiling is 0.3, and it leaves one batch slot per engine free: `batch_headroom`)
   and platinum goes straight to a free slot;
3. the same with `admission.enabled: false`: every bronze request sits in the engines' FIFO
   queues and platinum waits behind them.

Sizing (2 cores, about a minute per run): 8 sequences run at once per engine (FIFO, as vLLM's
default scheduling); a probe is 64 tokens, ~0.65 s of engine time. Two bronze mixes
(`--lengths`): `similar` (the hard case, the default: 32..96 tokens, a probe's length on
average, so 500 bronze requests are ~20 s of engine work queued ahead of a probe when nothing
holds them back) and `long` (the first version: 8..40 tokens, ~0.25 s; the probe ~2.6x longer). `--engine-priority` adds
the variant where the engines run vLLM's priority scheduling and the edge sends each band's
`priority` (`endpoints[].priority_scheduling`); `--without-headroom` the variant where silver and
bronze keep no batch slot free for the bands above them (`batch_headroom: 0`: full work
conservation, every slot used while work waits).

    python benchmarks/interference.py [--runs 3] [--lengths similar|long] [--engine-priority]
        [--without-headroom]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmgw.config.sections import default_bands
from llmgw.serving import free_port, free_port_block

# With auth.mode keys the line also names the development key.
READY = r"^llmgw is ready: OpenAI API at (http://\S+/v1)(?:, API key \S+)? \(Ctrl-C to stop\)$"
ADMIN_PORTS = 4  # `llmgw up`: the edge's admin port, then admission, reaper, scraper
BRONZE_CONCURRENCY = 500
MAX_NUM_SEQS = 8
# Engine time per request: itl 10 ms (+0.02 ms per running sequence) per token.
PROBE_TOKENS = 64  # ~0.65 s
# Bronze lengths vary, as real requests do: equal lengths would make a batch start and finish in
# lockstep cohorts, and a probe arriving mid-cohort would wait for the whole cohort. Drawn from a
# seeded generator: every run sends the same lengths. `similar` (the hard case, the default):
# 32..96 tokens, a probe's length on average; `long`: 8..40 (~0.25 s), the probe ~2.6x longer.
BRONZE_LENGTHS = {"similar": (32, 96), "long": (8, 40)}
BRONZE_TOKENS = BRONZE_LENGTHS["similar"]
IDLE_PROBES = 20
# p99 of 100 is about the second-worst: one scheduling hiccup of a busy host does not decide it.
LOADED_PROBES = 100
PROBE_EVERY = 0.1


def cluster_ports() -> tuple[int, Callable[[], int]]:
    """For a `llmgw up` config on free ports: the edge's admin port (its next three free too,
    for admission, reaper and scraper) and a function giving other free ports, all distinct."""
    admin = free_port_block(ADMIN_PORTS)
    taken = set(range(admin, admin + ADMIN_PORTS))

    def port() -> int:
        while (chosen := free_port()) in taken:
            pass
        taken.add(chosen)
        return chosen

    return admin, port


def interference_config(
    path: Path,
    *,
    admission: bool,
    bronze_ceiling: float | None = None,
    target_waiting: float = 4,
    engine_priority: bool = False,
    headroom: int | None = None,
) -> Path:
    """The scenario's cluster config; `bronze_ceiling` replaces bronze's default 0.3, `headroom`
    the batch bands' default batch_headroom (1); `engine_priority`: the engines schedule by
    priority and the edge sends the band's."""
    engine = {
        "kind": "engine",
        "scheduling_policy": "priority" if engine_priority else "fcfs",
        "max_num_seqs": MAX_NUM_SEQS,
        "num_gpu_blocks": 8192,
        "block_size": 16,
        "prefill_base": "5ms",
        "prefill_per_token": "0.02ms",
        "itl_base": "10ms",
        "itl_per_running_seq": "0.02ms",
        "output_len_mean": PROBE_TOKENS,
        "output_len_max": max(PROBE_TOKENS, *BRONZE_LENGTHS["similar"]),
    }
    limits = {
        "max_pinned_sessions": 10_000,
        "max_global_in_flight_request_slots": 10_000,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 100,
        "max_per_session_in_flight_request_slots": 1_000,
    }
    admin, port = cluster_ports()
    data: dict[str, Any] = {
        "listen": f"127.0.0.1:{port()}",
        "admin_listen": f"127.0.0.1:{admin}",
        "nats": {"url": "embedded", "embedded_port": 0},
        "router": {"scrape_interval": "100ms", "scrape_timeout": "500ms", "stale_after": "2s"},
        "scoring": {"target_waiting": target_waiting},
        "admission": {"enabled": admission, "interval": "5ms", "queue_ttl": "120s"},
        "pinning": {"lease_timeout": "30s"},
        "timeouts": {"first_token": "120s", "idle": "30s", "total": "300s"},
        "models": [{"name": "sim-model"}],
        # Only our own engines: nothing can overflow, so bronze has to be held back or hurt.
        "providers": [
            {"id": "iris", "kind": "managed", "models": [{"name": "sim-model", "limits": limits}]}
        ],
        "endpoints": [
            {
                "id": f"engine-{i}",
                "url": f"http://127.0.0.1:{port()}",
                "provider": "iris",
                "models": ["sim-model"],
                "pool": "sim",
                "priority_scheduling": engine_priority,
                "simulate": {**engine, "seed": i},
            }
            for i in (1, 2)
        ],
    }
    if bronze_ceiling is not None or headroom is not None:
        bands = [band.model_dump() for band in default_bands()]
        for band in bands:
            if band["name"] == "bronze" and bronze_ceiling is not None:
                band["saturation_ceiling"] = bronze_ceiling
            if not band["interactive"] and headroom is not None:
                band["batch_headroom"] = headroom
        data["admission"]["bands"] = bands
    # Tenants are bearer tokens and bands come from the header here: no API keys.
    data["auth"] = {"mode": "none"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def body(user: str, tokens: int) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": tokens,
        "ignore_eos": True,  # exactly `tokens` tokens
        "user": user,
        "messages": [{"role": "user", "content": f"hello from {user}"}],
    }


async def one(
    session: aiohttp.ClientSession,
    api: str,
    band: str,
    user: str,
    tenant: str | None = None,
    tokens: int = PROBE_TOKENS,
) -> float:
    """One request's latency; `user` makes its session, `tenant` (an API key) its tenant."""
    started = time.perf_counter()
    headers = {"x-llmgw-band": band}
    if tenant is not None:
        headers["authorization"] = f"Bearer {tenant}"
    async with session.post(
        f"{api}/chat/completions", json=body(user, tokens), headers=headers
    ) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{band} request failed: {response.status} {await response.text()}")
    return time.perf_counter() - started


async def probes(
    session: aiohttp.ClientSession, api: str, count: int, cap: float | None = None
) -> list[float]:
    """Platinum probes at a fixed rate (open loop), each its own session. With `cap`, a probe
    still running after `cap` seconds is abandoned and counts as `cap`: a lower bound on its
    latency, so a percentile of the result is a lower bound on the true one."""

    async def probe(n: int) -> float:
        if cap is None:
            return await one(session, api, "platinum", f"probe-{n}")
        try:
            return await asyncio.wait_for(one(session, api, "platinum", f"probe-{n}"), cap)
        except TimeoutError:
            return cap

    tasks = []
    for n in range(count):
        tasks.append(asyncio.create_task(probe(n)))
        await asyncio.sleep(PROBE_EVERY)
    return list(await asyncio.gather(*tasks))


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def bronze_queue_depth(session: aiohttp.ClientSession, admission_admin: str) -> float:
    """llmgw_admission_queue_depth{band="bronze"} from admission's admin port (0 if absent)."""
    async with session.get(f"{admission_admin}/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith('llmgw_admission_queue_depth{band="bronze"}'):
            return float(line.split()[-1])
    return 0.0


async def engines_waiting(session: aiohttp.ClientSession, engines: list[str]) -> int:
    total = 0
    for url in engines:
        async with session.get(f"{url}/sim/state") as response:
            total += (await response.json())["waiting"]
    return total


async def until_flooded(
    session: aiohttp.ClientSession, engines: list[str], admission_admin: str, timeout: float = 20
) -> None:
    """Until most of the flood waits in admission's or the engines' queues (at most `timeout`).

    The rest is in flight through the gateway. Measuring starts after `timeout` regardless: the
    assertions on the probes judge whether the load was real.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = await bronze_queue_depth(session, admission_admin) + await engines_waiting(
            session, engines
        )
        if waiting >= 0.6 * BRONZE_CONCURRENCY:
            return
        await asyncio.sleep(0.1)


async def measure(
    api: str,
    admission_admin: str,
    engines: list[str],
    bronze_tokens: tuple[int, int] = BRONZE_TOKENS,
    cap_factor: float | None = None,
) -> dict[str, Any]:
    """Idle probes, then probes under a continuous bronze flood; bronze completions counted.
    With `cap_factor`, a loaded probe counts as at most `cap_factor` x the idle p99 (`probes`):
    enough to show that the loaded p99 is at least that, without waiting for the whole queue."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await one(session, api, "platinum", "warm-up")
        idle = await probes(session, api, IDLE_PROBES)
        stop = asyncio.Event()
        done = itertools.count()
        failed = itertools.count()

        async def bronze_worker(worker: int) -> None:
            # A session per worker (its own pin), 20 tenants (API keys) among the workers.
            lengths = random.Random(worker)
            while not stop.is_set():
                try:
                    await one(
                        session,
                        api,
                        "bronze",
                        f"bronze-{worker}",
                        f"tenant-{worker % 20}",
                        lengths.randint(*bronze_tokens),
                    )
                except (RuntimeError, aiohttp.ClientError):
                    next(failed)
                else:
                    next(done)

        workers = [asyncio.create_task(bronze_worker(w)) for w in range(BRONZE_CONCURRENCY)]
        try:
            await until_flooded(session, engines, admission_admin)
            cap = None if cap_factor is None else cap_factor * p99(idle)
            loaded = await probes(session, api, LOADED_PROBES, cap)
            queued = await bronze_queue_depth(session, admission_admin)
        finally:  # also on an error: a worker on a closed session would spin without yielding
            stop.set()
            bronze_done = next(done)
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return {
        "idle": idle,
        "loaded": loaded,
        "bronze_done": bronze_done,
        "bronze_queued": queued,
        "bronze_failed": next(failed),
    }


def cluster_endpoints(config: Path) -> tuple[str, list[str]]:
    """The admin URL that serves admission's metrics, and the engines' URLs: the edge's admin
    port when the edge runs admission (admission.colocated, the default), else the admission
    process's (the edge's + 1, as `llmgw up` plans it)."""
    data = yaml.safe_load(config.read_text())
    host, port = data["admin_listen"].rsplit(":", 1)
    colocated = data.get("admission", {}).get("colocated", True)
    admin = int(port) if colocated else int(port) + 1
    return f"http://{host}:{admin}", [e["url"] for e in data["endpoints"]]


def summary(result: dict[str, Any]) -> str:
    idle, loaded = result["idle"], result["loaded"]
    return (
        f"idle p50 {statistics.median(idle) * 1000:.0f} ms p99 {p99(idle) * 1000:.0f} ms; "
        f"loaded p50 {statistics.median(loaded) * 1000:.0f} ms p99 {p99(loaded) * 1000:.0f} ms "
        f"({p99(loaded) / p99(idle):.2f}x); bronze completed {result['bronze_done']}, "
        f"failed {result['bronze_failed']}, queued in admission {result['bronze_queued']:.0f}"
    )


class UpCluster:
    """`llmgw up` as a child process, until `stop`."""

    def __init__(self, config: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "up", "--config", str(config)],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def api(self, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.match(READY, line):
                    return match.group(1)
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("llmgw up did not become ready:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


def run_once(
    workdir: Path,
    *,
    admission: bool,
    bronze_ceiling: float | None = None,
    target_waiting: float = 4,
    engine_priority: bool = False,
    bronze_tokens: tuple[int, int] = BRONZE_TOKENS,
    headroom: int | None = None,
) -> dict[str, Any]:
    config = interference_config(
        workdir / f"admission-{admission}.yaml",
        admission=admission,
        bronze_ceiling=bronze_ceiling,
        target_waiting=target_waiting,
        engine_priority=engine_priority,
        headroom=headroom,
    )
    cluster = UpCluster(config)
    try:
        api = cluster.api()
        return asyncio.run(measure(api, *cluster_endpoints(config), bronze_tokens))
    finally:
        cluster.stop()


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}..{max(values):.0f}]"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="rounds of every variant")
    parser.add_argument(
        "--lengths",
        choices=sorted(BRONZE_LENGTHS),
        default="similar",
        help="bronze lengths: similar to the probes' (default) or ~2.6x shorter",
    )
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="also run admission on with the engines' priority scheduling",
    )
    parser.add_argument(
        "--without-headroom",
        action="store_true",
        help="also run admission on with the batch bands' batch_headroom 0 (full work "
        "conservation), with --engine-priority also with the engines' priority",
    )
    parser.add_argument(
        "--bronze-ceiling",
        type=float,
        default=None,
        help="bronze's saturation ceiling (default: the config default, 0.3)",
    )
    parser.add_argument(
        "--target-waiting",
        type=float,
        default=4,
        help="scoring.target_waiting (default 4, the config default)",
    )
    parser.add_argument("--on-only", action="store_true", help="skip the admission-off runs")
    args = parser.parse_args()
    # (label, admission, engine priority, headroom override), side by side in every round.
    variants: list[tuple[str, bool, bool, int | None]] = [("admission on", True, False, None)]
    if args.engine_priority:
        variants.append(("admission on, engine priority", True, True, None))
    if args.without_headroom:
        variants.append(("admission on, headroom 0", True, False, 0))
        if args.engine_priority:
            variants.append(("admission on, headroom 0, engine priority", True, True, 0))
    if not args.on_only:
        variants.append(("admission off", False, False, None))
    rows: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-interference-") as tmp:
        for run in range(args.runs):
            for label, admission, engine_priority, headroom in variants:
                result = run_once(
                    Path(tmp),
                    admission=admission,
                    bronze_ceiling=args.bronze_ceiling,
                    target_waiting=args.target_waiting,
                    engine_priority=engine_priority,
                    bronze_tokens=BRONZE_LENGTHS[args.lengths],
                    headroom=headroom,
                )
                print(f"run {run + 1} {label}: {summary(result)}", file=sys.stderr)
                for phase in ("idle", "loaded"):
                    row = rows.setdefault(f"{phase}, {label}", {})
                    values = [v * 1000 for v in result[phase]]
                    row.setdefault("p50", []).append(statistics.median(values))
                    row.setdefault("p99", []).append(p99(values))
                ratio = ratios.setdefault(label, {})
                ratio.setdefault("p99", []).append(p99(result["loaded"]) / p99(result["idle"]))
                ratio.setdefault("bronze", []).append(result["bronze_done"])
    print(
        f"\n{args.runs} runs each, {args.lengths} lengths; platinum latency in ms, "
        "median [min..max] over runs\n"
    )
    print("| phase | p50 | p99 |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {fmt(row['p50'])} | {fmt(row['p99'])} |")
    for label, ratio in ratios.items():
        print(
            f"\nloaded p99 / idle p99, {label}: "
            + ", ".join(f"{r:.2f}x" for r in ratio["p99"])
            + "; bronze completed while probing: "
            + ", ".join(f"{b:.0f}" for b in ratio["bronze"])
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
