"""`llmgw reaper` as a process (ready line, reaps, exit 0 on SIGTERM), its admin port, and the
refusal to start on an embedded-NATS config."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from reaper_helpers import LOCAL_CONFIG, WAIT, Connect, EventLog, config_data

from llmgw.config import Config
from llmgw.core.keys import MemberValue
from llmgw.events import EventName
from llmgw.services.reaper.main import run, serve
from llmgw.serving import free_port
from llmgw.state.setup import open_routing_store

REPO = Path(__file__).resolve().parents[2]


async def _dead_member(config: Config, connect: Connect) -> str:
    """An admission instance that joined long ago and died: its key is the reaper's to remove."""
    store = await open_routing_store(await connect(), config)
    await store.join(MemberValue("admission-long-gone", 1_000.0, 1_000.0))
    return "admission-long-gone"


async def test_reaper_process_prints_ready_reaps_and_exits_0_on_sigterm(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    config: Config,
    connect: Connect,
    event_log: EventLog,
) -> None:
    member = await _dead_member(config, connect)
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
            lambda log: any(e.member == member for e in log.named(EventName.MEMBER_EXPIRED))
        )
        (event,) = event_log.named(EventName.MEMBER_EXPIRED)
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
    assert 'llmgw_reaper_actions_total{kind="member_expired"} 0.0' in metrics.text
    assert "llmgw_reaper_pass_duration_seconds_count" in metrics.text


def test_an_embedded_nats_config_exits_2_explaining_what_to_set(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LLMGW_NATS__URL", raising=False)
    code = run(argparse.Namespace(config=str(LOCAL_CONFIG)))
    assert code == 2
    assert "LLMGW_NATS__URL" in capsys.readouterr().err
