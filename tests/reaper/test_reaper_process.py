"""`llmgw reaper` as a process (ready line, reaps, exit 0 on SIGTERM), its admin port, and the
refusal to start on an embedded-NATS config."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from reaper_helpers import IRIS, LOCAL_CONFIG, MODEL, WAIT, Connect, EventLog, config_data

from llmgw.config import Config
from llmgw.events import EventName
from llmgw.services.reaper.main import run, serve
from llmgw.serving import free_port
from llmgw.state import open_routing_bucket
from llmgw.state.routing_state import RoutingState
from llmgw.state.setup import limits_from_config

REPO = Path(__file__).resolve().parents[2]


async def _abandoned_temporary_lease(config: Config, connect: Connect) -> str:
    """A lease granted long ago by an edge that died: expired the moment a reaper looks."""
    nc = await connect()
    kv = await open_routing_bucket(nc.jetstream(), config.pinning.bucket)
    long_ago = 1_000.0
    # Not started: the bucket is new, so every slot is free and the slot mirror (a hint for
    # choosing a free slot) has nothing to tell.
    state = RoutingState(
        kv,
        limits_from_config(config),
        clock=lambda: long_ago,
        rng=random.Random(3),
        lease_timeout=config.pinning.lease_timeout,
    )
    admitted = await state.try_admit_request_without_pin(IRIS, MODEL)
    assert admitted.lease is not None
    return admitted.lease.lease_id


async def test_reaper_process_prints_ready_reaps_and_exits_0_on_sigterm(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    config: Config,
    connect: Connect,
    event_log: EventLog,
) -> None:
    lease_id = await _abandoned_temporary_lease(config, connect)
    config_file = tmp_path / "reaper.yaml"
    config_file.write_text(yaml.safe_dump(config_data(nats_url, bucket)))
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw",
        "reaper",
        "--config",
        str(config_file),
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output: list[str] = []
    try:
        assert process.stdout is not None
        async with asyncio.timeout(WAIT):
            while not any("llmgw reaper ready" in line for line in output):
                line = await process.stdout.readline()
                assert line, "the reaper exited before it was ready:\n" + "".join(output)
                output.append(line.decode())
        await event_log.wait_until(
            lambda log: any(e.lease_id == lease_id for e in log.named(EventName.LEASE_EXPIRED))
        )
        (event,) = event_log.named(EventName.LEASE_EXPIRED)
        assert event.instance.startswith("reaper-") and event.instance in output[-1]

        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT):
            rest, _ = await process.communicate()
        assert process.returncode == 0, "".join(output) + rest.decode()
        assert "stopping after" in rest.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_admin_port_serves_metrics_and_health(config: Config) -> None:
    port = free_port()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(config, admin=("127.0.0.1", port), stop=stop, ready=ready))
    try:
        async with asyncio.timeout(WAIT):
            await ready.wait()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            health = await client.get("/health")
            metrics = await client.get("/metrics")
    finally:
        stop.set()
        async with asyncio.timeout(WAIT):
            await task
    assert health.status_code == 200 and health.json()["nats"] == "connected"
    assert 'llmgw_reaper_actions_total{kind="lease_expired"} 0.0' in metrics.text
    assert "llmgw_reaper_pass_duration_seconds_count" in metrics.text


def test_an_embedded_nats_config_exits_2_explaining_what_to_set(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LLMGW_NATS__URL", raising=False)
    code = run(argparse.Namespace(config=str(LOCAL_CONFIG)))
    assert code == 2
    assert "LLMGW_NATS__URL" in capsys.readouterr().err
