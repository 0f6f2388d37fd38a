"""One engine starts failing mid-run: what clients see, where traffic goes, how it comes back.

A cluster under `llmgw up` (three simulated engines of one managed provider, scraper, admission,
reaper, edge; `router.cooldown` 2 s, `failure_threshold` 3). Eight closed-loop clients, a new
session per request. At 6 s every answer of engine-1 becomes a 500 (the simulator's fault knob);
at 16 s it heals; the run ends at 26 s. Run twice: with the default retries (2) and with
`router.retries: 0`, which shows what the breaker alone lets through.

Reported per run: client-visible errors, the failed attempts engine-1 received while failing
(what opened its breaker, then the half-open probes), how long after the fault engine-1's share
of answers stayed at zero, and how long after healing it was back to a steady share.

    python benchmarks/failover.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from interference import UpCluster, cluster_ports

FAIL_AT, HEAL_AT, END_AT = 6.0, 16.0, 26.0
WORKERS = 8


def failover_config(path: Path, *, retries: int) -> Path:
    admin, port = cluster_ports()
    engine = {
        "kind": "engine",
        "max_num_seqs": 16,
        "prefill_base": "2ms",
        "itl_base": "5ms",
        "itl_per_running_seq": "0.1ms",
    }
    data: dict[str, Any] = {
        "listen": f"127.0.0.1:{port()}",
        "admin_listen": f"127.0.0.1:{admin}",
        "nats": {"url": "embedded", "embedded_port": 0},
        "router": {
            "scrape_interval": "200ms",
            "retries": retries,
            "cooldown": "2s",
            "failure_threshold": 3,
        },
        "admission": {"default_band": "platinum"},
        "models": [{"name": "sim-model"}],
        "providers": [{"id": "iris", "kind": "managed", "models": [{"name": "sim-model"}]}],
        "endpoints": [
            {
                "id": f"engine-{i}",
                "url": f"http://127.0.0.1:{port()}",
                "provider": "iris",
                "models": ["sim-model"],
                "simulate": {**engine, "seed": i},
            }
            for i in (1, 2, 3)
        ],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def drive(api: str, engine_1: str) -> list[tuple[float, int, str]]:
    """(seconds since start, status, endpoint) of every request; faults switched on schedule."""
    log: list[tuple[float, int, str]] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession() as http:

        async def fault(at: float, rate: float) -> None:
            await asyncio.sleep(at)
            async with http.post(f"{engine_1}/sim/faults", json={"error_rate": rate}) as r:
                r.raise_for_status()

        async def client(number: int) -> None:
            n = 0
            while (elapsed := time.perf_counter() - started) < END_AT:
                n += 1
                body = {
                    "model": "sim-model",
                    "max_tokens": 8,
                    "user": f"c{number}-{n}",
                    "messages": [{"role": "user", "content": "hello"}],
                }
                async with http.post(f"{api}/chat/completions", json=body) as response:
                    await response.read()
                    log.append(
                        (elapsed, response.status, response.headers.get("x-llmgw-endpoint", "-"))
                    )

        await asyncio.gather(
            fault(FAIL_AT, 1.0), fault(HEAL_AT, 0.0), *(client(n) for n in range(WORKERS))
        )
    return log


def analyse(log: list[tuple[float, int, str]]) -> dict[str, float]:
    errors = sum(1 for _, status, _ in log if status != 200)
    failing = [(t, s, e) for t, s, e in log if FAIL_AT <= t < HEAL_AT]
    ok_engine_1 = [t for t, s, e in log if s == 200 and e == "engine-1"]
    # Last success from engine-1 before it healed, relative to the fault.
    served_after_fault = [t for t in ok_engine_1 if FAIL_AT <= t < HEAL_AT]
    avoided_from = (max(served_after_fault) if served_after_fault else FAIL_AT) - FAIL_AT
    # Back: the first 1-second window after healing in which engine-1 answered >= 20%.
    back = float("inf")
    for start in [HEAL_AT + i / 10 for i in range(int((END_AT - HEAL_AT - 1) * 10))]:
        window = [e for t, s, e in log if start <= t < start + 1 and s == 200]
        if window and Counter(window)["engine-1"] >= 0.2 * len(window):
            back = start - HEAL_AT
            break
    return {
        "requests": len(log),
        "errors": errors,
        "during_fault": len(failing),
        "engine_1_answers_after_fault_s": avoided_from,
        "back_after_heal_s": back,
    }


def run(retries: int, workdir: Path) -> tuple[dict[str, float], list[tuple[float, int, str]]]:
    config = failover_config(workdir / f"failover-{retries}.yaml", retries=retries)
    cluster = UpCluster(config)
    try:
        api = cluster.api()
        engine_1 = yaml.safe_load(config.read_text())["endpoints"][0]["url"]
        log = asyncio.run(drive(api, engine_1))
        return analyse(log), log
    finally:
        cluster.stop()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as tmp:
        rows = {}
        for retries in (2, 0):
            summary, _ = run(retries, Path(tmp))
            rows[retries] = summary
            print(f"retries {retries}: {summary}", file=sys.stderr)
    print(
        f"\nengine-1 fails at {FAIL_AT:g} s and heals at {HEAL_AT:g} s; {WORKERS} clients; "
        "cooldown 2 s, failure threshold 3\n"
    )
    print(
        "| retries | requests | client-visible errors | requests during the fault | "
        "engine-1 back after healing (s) |"
    )
    print("|---|---|---|---|---|")
    for retries, r in rows.items():
        print(
            f"| {retries} | {r['requests']:.0f} | {r['errors']:.0f} | {r['during_fault']:.0f} | "
            f"{r['back_after_heal_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
