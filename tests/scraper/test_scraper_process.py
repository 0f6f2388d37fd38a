"""`llmgw scraper` as a process (ready line, admin port, exit 0 on SIGTERM), and the admin
port's health verdict."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import yaml
from scraper_helpers import WAIT, EventLog, StartEngine, config_data
from timing import SteppedClock

from llmgw.core.saturation import SaturationSettings
from llmgw.services.scraper.admin import create_admin_app
from llmgw.services.scraper.metrics import ScraperMetrics
from llmgw.services.scraper.reports import ScrapeTarget
from llmgw.services.scraper.service import Scraper, health_window
from llmgw.serving import free_port

REPO = Path(__file__).resolve().parents[2]


async def test_scraper_process_prints_ready_serves_admin_and_exits_0_on_sigterm(
    tmp_path: Path,
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    start_engine: StartEngine,
    events: EventLog,
) -> None:
    engine = await start_engine()
    dead = f"http://127.0.0.1:{free_port()}"
    config_file = tmp_path / "scraper.yaml"
    config_file.write_text(
        yaml.safe_dump(
            config_data(nats_url, load_bucket, unique_id, {"live": engine.url, "dead": dead})
        )
    )
    admin_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw",
        "scraper",
        "--config",
        str(config_file),
        "--admin-listen",
        f"127.0.0.1:{admin_port}",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output: list[str] = []
    try:
        assert process.stdout is not None
        async with asyncio.timeout(WAIT):
            while not any("llmgw scraper ready" in line for line in output):
                line = await process.stdout.readline()
                assert line, "the scraper exited before it was ready:\n" + "".join(output)
                output.append(line.decode())
        assert f"admin http://127.0.0.1:{admin_port}" in output[-1]
        report = await events.wait_for_report("live", lambda r: r.sample is not None)
        assert report.scraper.startswith("scraper-") and report.scraper in output[-1]
        await events.wait_for_report("dead", lambda r: True)

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}") as client:
            health = await client.get("/health")
            metrics = (await client.get("/metrics")).text
        assert health.status_code == 200, health.text
        assert health.json() == {"status": "ok", "nats": "connected"}
        for line in (
            'llmgw_scraper_endpoint_healthy{endpoint="live"} 1.0',
            'llmgw_scraper_endpoint_healthy{endpoint="dead"} 0.0',
            'llmgw_scraper_scrape_age_seconds{endpoint="dead"} +Inf',
            'llmgw_scraper_scrapes_total{endpoint="dead",result="unreachable"}',
            'llmgw_scraper_scrape_duration_seconds_count{endpoint="live"}',
            'llmgw_scraper_engine_running{endpoint="live"} 0.0',
            'llmgw_scraper_pool_saturation{pool="gpu/a",provider="' + unique_id + '"}',
            'llmgw_scraper_publish_failures_total{kind="kv"} 0.0',
        ):
            assert line in metrics, line
        age = next(
            line
            for line in metrics.splitlines()
            if line.startswith('llmgw_scraper_scrape_age_seconds{endpoint="live"}')
        )
        assert 0 <= float(age.split()[-1]) < 5

        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT):
            rest, _ = await process.communicate()
        assert process.returncode == 0, "".join(output) + rest.decode()
        assert "stopping after" in rest.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


class _Connection:
    def __init__(self, connected: bool) -> None:
        self.is_connected = connected


class _NoBucket:
    """The loop's bucket, for tests that never run a round."""

    async def put(self, key: str, value: bytes) -> int:
        raise AssertionError("unused")

    async def get(self, key: str) -> None:
        raise AssertionError("unused")


class _NoPublisher:
    async def publish(self, subject: str, payload: bytes = b"") -> None:
        raise AssertionError("unused")


async def test_admin_health_is_503_when_the_loop_stalls_or_nats_is_lost() -> None:
    clock = SteppedClock(1000.0)
    async with httpx.AsyncClient() as unused_client:
        scraper = Scraper(
            [ScrapeTarget("e1", "p", "gpu", ("m1",), "http://127.0.0.1:9")],
            client=unused_client,
            bucket=_NoBucket(),
            publisher=_NoPublisher(),
            metrics=ScraperMetrics(),
            instance="s",
            interval=2.0,
            timeout=1.0,
            clock=clock,
            settings=SaturationSettings(target_waiting=4, kv_ceiling=0.9, stale_after=10),
        )
    assert health_window(2.0, 1.0) == 4.0
    assert health_window(1.0, 2.0) == 5.0  # a timeout longer than the interval widens it
    connected, lost = _Connection(True), _Connection(False)

    async def health(connection: _Connection, path: str = "/ready") -> httpx.Response:
        app = create_admin_app(scraper.metrics, connection, scraper)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://admin"
        ) as client:
            return await client.get(path)

    not_started = await health(connected)
    assert not_started.status_code == 503
    assert not_started.json()["reason"] == "the scrape loop has not started"
    live = await health(connected, "/health")  # liveness: answering is enough
    assert live.status_code == 200 and live.json()["reason"] == "the scrape loop has not started"

    scraper.started_at = scraper.last_round_at = clock.now
    clock.now += 4.0
    assert (await health(connected)).status_code == 200
    clock.now += 0.5
    stalled = await health(connected)
    assert stalled.status_code == 503
    assert stalled.json()["reason"] == "no scrape round completed for 4.5s (allowed 4s)"

    scraper.last_round_at = clock.now
    disconnected = await health(lost)
    assert disconnected.status_code == 503
    assert disconnected.json() == {
        "status": "degraded",
        "nats": "disconnected",
        "reason": "not connected to NATS",
    }
