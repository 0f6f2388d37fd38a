"""The edge's upstream client against aiohttp: latency and CPU per request to one engine.

    python benchmarks/upstream_client.py [--rounds 3] [--requests 2000]

A zero-delay `llmgw sim engine` on CPU 0; each client in its own process on CPU 1 (where the
edge runs in benchmarks/overhead.py), POSTing the same chat request one at a time (concurrency 1)
and then 64 at a time, over keep-alive connections: aiohttp configured as the edge configured it
(no cookie jar, no decompression, no User-Agent), and `llmgw.services.edge.http_client`. Rounds
alternate which client goes first. CPU is the client process's user + system time per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from cluster import WRITES_MAX_TOKENS, ZERO_DELAY
from measure import pct

from llmgw.serving import free_port

BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
).encode()
HEADERS = {"content-type": "application/json"}


async def _run(url: str, which: str, total: int, concurrency: int) -> tuple[float, float]:
    """(p50 latency s, CPU s per request) of `total` POSTs, `concurrency` at a time."""
    if which == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

        async def post() -> None:
            response = await session.post(url, data=BODY, headers=HEADERS)
            await response.read()
            response.release()

        close = session.close
    else:
        from llmgw.services.edge.http_client import UpstreamPool

        pool = UpstreamPool(dial=5)

        async def post() -> None:
            response = await pool.post(url, BODY, HEADERS)
            await response.read()
            response.release()

        close = pool.close
    latencies: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await post()
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker(50) for _ in range(concurrency)))  # warm: connections open
    latencies.clear()
    before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(worker(total // concurrency) for _ in range(concurrency)))
    after = resource.getrusage(resource.RUSAGE_SELF)
    await close()
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return pct(latencies, 0.5), cpu / len(latencies)


def _child(url: str, which: str, total: int, concurrency: int) -> None:
    import uvloop

    os.sched_setaffinity(0, {1})
    p50, cpu = uvloop.run(_run(url, which, total, concurrency))
    print(json.dumps({"p50": p50, "cpu": cpu}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    port = free_port()
    engine = subprocess.Popen(
        [
            *(sys.executable, "-m", "llmgw", "sim", "engine", "--port", str(port)),
            *("--model", "bench-model", *(f"--set={s}" for s in (*ZERO_DELAY, *WRITES_MAX_TOKENS))),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.sched_setaffinity(engine.pid, {0})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the engine answers
            ready = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"import httpx; httpx.get('http://127.0.0.1:{port}/health')",
                ],
                capture_output=True,
            )
            if ready.returncode == 0:
                break
            time.sleep(0.2)
        for rnd in range(args.rounds):
            clients = ["aiohttp", "llmgw"] if rnd % 2 == 0 else ["llmgw", "aiohttp"]
            for concurrency in (1, 64):
                for which in clients:
                    out = subprocess.run(
                        [
                            *(sys.executable, __file__, "--child", url, which),
                            *(str(args.requests), str(concurrency)),
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    results.setdefault((which, concurrency), []).append(json.loads(out.stdout))
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        engine.kill()

    def fmt(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"

    print("| client | concurrency | p50 ms | CPU ms / request |")
    print("|---|---|---|---|")
    for (which, concurrency), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        p50 = [r["p50"] * 1e3 for r in runs]
        cpu = [r["cpu"] * 1e3 for r in runs]
        print(f"| {which} | {concurrency} | {fmt(p50)} | {fmt(cpu)} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, os.path.dirname(__file__))
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main())
