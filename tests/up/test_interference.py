"""Seed 002's exit criterion, end to end: a bronze flood must not hurt platinum's latency.

A whole cluster under `llmgw up` (embedded NATS, two simulated engines, scraper, admission,
reaper, edge), driven through the edge's HTTP API like any client:

1. idle: platinum probes alone give the baseline p99;
2. 500 bronze requests run continuously (each worker sends the next as soon as one ends) and
   platinum probes arrive at a fixed rate. With admission on, bronze waits in admission's queue
   (its ceiling is 0.3), platinum goes straight to an engine: p99 <= 1.5x idle;
3. the same load with `admission.enabled: false` pushes every bronze request into the engines'
   FIFO queues, and platinum waits behind them: p99 >= 10x idle.

Both directions are asserted, so the test fails if admission regresses and also if the load
stops being a real load. Sizing (2 cores, about a minute in all): 8 sequences run at once per
engine; a probe is ~0.5 s of engine time and a bronze request ~0.25 s, so 500 bronze requests are
~8 s of engine work queued ahead of a probe when nothing holds them back.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from up_harness import ADMIN_PORTS, UpProcess, admin_port_block

from llmgw.serving import free_port

pytestmark = pytest.mark.e2e

READY = r"^llmgw is ready: OpenAI API at (http://\S+/v1) \(Ctrl-C to stop\)$"
BRONZE_CONCURRENCY = 500
MAX_NUM_SEQS = 8
# Engine time per request: itl 10 ms (+0.02 ms per running sequence) per token.
PROBE_TOKENS = 48  # ~0.5 s
BRONZE_TOKENS = 24  # ~0.25 s: a batch slot frees every ~30 ms per engine under load
IDLE_PROBES = 20
LOADED_PROBES = 50
PROBE_EVERY = 0.1


def interference_config(path: Path, *, admission: bool) -> Path:
    engine = {
        "kind": "engine", "max_num_seqs": MAX_NUM_SEQS, "num_gpu_blocks": 8192, "block_size": 16,
        "prefill_base": "5ms", "prefill_per_token": "0.02ms", "itl_base": "10ms",
        "itl_per_running_seq": "0.02ms", "output_len_mean": PROBE_TOKENS, "output_len_max": PROBE_TOKENS,
    }
    limits = {
        "max_pinned_sessions": 10_000, "max_global_in_flight_request_slots": 10_000,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 100,
        "max_per_session_in_flight_request_slots": 1_000,
    }
    admin = admin_port_block()
    taken = set(range(admin, admin + ADMIN_PORTS))

    def port() -> int:
        while (chosen := free_port()) in taken:
            pass
        taken.add(chosen)
        return chosen

    data: dict[str, Any] = {
        "listen": f"127.0.0.1:{port()}",
        "admin_listen": f"127.0.0.1:{admin}",
        "nats": {"url": "embedded", "embedded_port": 0},
        "router": {"scrape_interval": "100ms", "scrape_timeout": "500ms", "stale_after": "2s"},
        "scoring": {"target_waiting": 4},
        "admission": {"enabled": admission, "interval": "5ms", "queue_ttl": "120s"},
        "pinning": {"lease_timeout": "30s"},
        "timeouts": {"first_token": "120s", "idle": "30s", "total": "300s"},
        "models": [{"name": "sim-model"}],
        # Only our own engines: nothing can overflow, so bronze has to be held back or hurt.
        "providers": [{"id": "iris", "kind": "managed",
                       "models": [{"name": "sim-model", "limits": limits}]}],
        "endpoints": [
            {"id": f"engine-{i}", "url": f"http://127.0.0.1:{port()}", "provider": "iris",
             "models": ["sim-model"], "pool": "sim", "simulate": {**engine, "seed": i}}
            for i in (1, 2)
        ],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def body(user: str, tokens: int) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": tokens, "user": user,
            "messages": [{"role": "user", "content": f"hello from {user}"}]}


async def one(session: aiohttp.ClientSession, api: str, band: str, user: str) -> float:
    started = time.perf_counter()
    tokens = BRONZE_TOKENS if band == "bronze" else PROBE_TOKENS
    async with session.post(f"{api}/chat/completions", json=body(user, tokens),
                            headers={"x-llmgw-band": band}) as response:
        await response.read()
        assert response.status == 200, await response.text()
    return time.perf_counter() - started


async def probes(session: aiohttp.ClientSession, api: str, count: int) -> list[float]:
    """Platinum probes at a fixed rate (open loop), each its own session."""
    tasks = []
    for n in range(count):
        tasks.append(asyncio.create_task(one(session, api, "platinum", f"probe-{n}")))
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


async def until_flooded(session: aiohttp.ClientSession, engines: list[str], admission_admin: str,
                        timeout: float = 20) -> None:
    """Until most of the flood waits in admission's or the engines' queues (at most `timeout`).

    The rest is in flight through the gateway. Measuring starts after `timeout` regardless: the
    assertions on the probes judge whether the load was real.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = (await bronze_queue_depth(session, admission_admin)
                   + await engines_waiting(session, engines))
        if waiting >= 0.6 * BRONZE_CONCURRENCY:
            return
        await asyncio.sleep(0.1)


async def measure(api: str, admission_admin: str, engines: list[str]) -> dict[str, Any]:
    """Idle probes, then probes under a continuous bronze flood; bronze completions counted."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await one(session, api, "platinum", "warm-up")
        idle = await probes(session, api, IDLE_PROBES)
        stop = asyncio.Event()
        done = itertools.count()
        users = [f"tenant-{i % 20}" for i in range(BRONZE_CONCURRENCY)]

        async def bronze_worker(user: str) -> None:
            while not stop.is_set():
                await one(session, api, "bronze", user)
                next(done)

        workers = [asyncio.create_task(bronze_worker(u)) for u in users]
        await until_flooded(session, engines, admission_admin)
        loaded = await probes(session, api, LOADED_PROBES)
        queued = await bronze_queue_depth(session, admission_admin)
        stop.set()
        bronze_done = next(done)
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return {"idle": idle, "loaded": loaded, "bronze_done": bronze_done, "bronze_queued": queued}


def run_cluster(tmp_path: Path, start_up, *, admission: bool) -> dict[str, Any]:
    config = interference_config(tmp_path / f"admission-{admission}.yaml", admission=admission)
    up: UpProcess = start_up(config)
    api = up.wait_for(READY, timeout=90).group(1)
    data = yaml.safe_load(config.read_text())
    host, port = data["admin_listen"].rsplit(":", 1)
    admission_admin = f"http://{host}:{int(port) + 1}"
    engines = [endpoint["url"] for endpoint in data["endpoints"]]
    try:
        return asyncio.run(measure(api, admission_admin, engines))
    finally:
        up.stop()


def summary(result: dict[str, Any]) -> str:
    idle, loaded = result["idle"], result["loaded"]
    return (f"idle p50 {statistics.median(idle) * 1000:.0f} ms p99 {p99(idle) * 1000:.0f} ms; "
            f"loaded p50 {statistics.median(loaded) * 1000:.0f} ms p99 {p99(loaded) * 1000:.0f} ms "
            f"({p99(loaded) / p99(idle):.2f}x); bronze completed {result['bronze_done']}, "
            f"queued in admission {result['bronze_queued']:.0f}")


def test_platinum_latency_holds_under_a_bronze_flood_only_with_admission(tmp_path, start_up):
    on = run_cluster(tmp_path, start_up, admission=True)
    print("admission on: " + summary(on))
    assert on["bronze_done"] > 50, "bronze made no progress: the load was not a real load"
    assert on["bronze_queued"] > 100, "bronze was not held back in admission"
    assert p99(on["loaded"]) <= 1.5 * p99(on["idle"]), summary(on)

    off = run_cluster(tmp_path, start_up, admission=False)
    print("admission off: " + summary(off))
    assert p99(off["loaded"]) >= 10 * p99(off["idle"]), summary(off)
    assert off["bronze_queued"] == 0
