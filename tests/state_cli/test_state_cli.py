"""`llmgw state` against a live bucket on a real nats-server: text and --json output, and the
clear failures (embedded config, no bucket, no server) that never create anything."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from inproc import start_admission
from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError
from state_cli_helpers import IRIS, LOCAL_CONFIG, MODEL, REPO, TENSORX, session_id, write_config

from llmgw.cli import build_parser
from llmgw.config import config_from_dict, load_config
from llmgw.core.requests import Feature
from llmgw.core.sessions import key_session
from llmgw.core.sessions import session_id as core_session_id
from llmgw.core.shards import shard_of
from llmgw.load import EndpointReport, LoadSample, report_key
from llmgw.runtime import load_tool_config
from llmgw.services.state.main import run
from llmgw.services.up.offset import shift_ports
from llmgw.serving import free_port
from llmgw.state import open_routing_bucket
from llmgw.state.setup import open_load_bucket
from llmgw.wire import AdmitRequest, ReplyStatus


async def _populate(nats_url: str, config_file: Path):
    """A live admission instance holding two pins on iris (one with two leases), one on
    tensorx (which iris cannot take: the session asked for it by failing over), and their
    leases, all still running."""
    config = load_config(config_file, env={})
    admission = await start_admission(
        config, nats_url, instance="admission-state", follow_load=False
    )
    service = admission.service
    for n in (1, 2, 2):
        session = session_id(n)
        reply = await service.decide(
            AdmitRequest(
                id=f"r{n}-{time.monotonic_ns()}",
                edge="edge-x",
                model=MODEL,
                feature="chat",
                session=session,
                shard=shard_of(session, config.admission.shards),
            )
        )
        assert reply.status is ReplyStatus.ADMITTED and reply.target.provider == IRIS
    service.catalog.forced_degraded.add((IRIS, MODEL))  # iris is down for session 3
    session = session_id(3)
    reply = await service.decide(
        AdmitRequest(
            id="r3",
            edge="edge-x",
            model=MODEL,
            feature="chat",
            session=session,
            shard=shard_of(session, config.admission.shards),
        )
    )
    assert reply.target.provider == TENSORX
    await service.pins.drain()
    return admission


async def test_json_output_counts_the_live_bucket_and_the_instances_leases(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    admission = await _populate(nats_url, config_file)
    try:
        # run() owns its event loop, as the console command does: give it a thread.
        code = await asyncio.to_thread(
            run, argparse.Namespace(config=str(config_file), json=True, pins=True)
        )
    finally:
        await admission.stop()
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["bucket"] == bucket
    pairs = {(p["provider"], p["model"]): p for p in data["pairs"]}
    iris = pairs[(IRIS, MODEL)]
    # Session 1 sent one request: its pin is held, not yet written (a new pin is written once
    # its session comes back); session 2's second request wrote its pin.
    assert (iris["pins"], iris["pins_stored"], iris["leases"]) == (2, 1, 3)
    assert (iris["max_pins"], iris["max_leases"], iris["reserved"]) == (200, 64, 16)
    assert iris["quota_leases"] == 64  # a lone instance holds the whole limit
    assert (pairs[(TENSORX, MODEL)]["pins"], pairs[(TENSORX, MODEL)]["leases"]) == (1, 1)
    assert sorted(p["session"] for p in data["pins"]) == [session_id(2)]  # the bucket's
    [instance] = data["instances"]
    assert instance["instance"] == "admission-state" and instance["answered"]
    assert instance["shards"] == 32 and instance["leases"] == 4
    assert data["leases_by_kind"] == {"new_pin": 3, "pinned": 1}


async def test_text_output_from_the_command_line(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    nats_client: NatsClient,
) -> None:
    """The real console entry (`python -m llmgw state --pins`) on an empty bucket."""
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    await open_routing_bucket(nats_client.jetstream(), bucket)  # as the first service does
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw",
        "state",
        "--config",
        str(config_file),
        "--pins",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0] == (f"routing bucket {bucket}: lease timeout 30s, pin inactivity timeout 5m")
    assert lines[1].startswith("read at ") and lines[1].endswith(" UTC; 0/32 shards owned")
    assert [line.split() for line in lines if line.startswith(f"{IRIS} ")] == [
        [IRIS, MODEL, "0/200", "0/64", "0/16", "0/0/0"],
        [IRIS, "qwen2.5-32b", "0/200", "0/64", "0/16", "0/0/0"],
    ]
    assert "  none (start `llmgw admission`, or `llmgw up`)" in lines
    assert lines[-1] == "pins (0, from the bucket):"


async def test_a_missing_bucket_exits_1_and_is_not_created(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    nats_client: NatsClient,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    code = await asyncio.to_thread(
        run, argparse.Namespace(config=str(config_file), json=False, pins=False)
    )
    assert code == 1
    assert f"no routing bucket '{bucket}'" in capsys.readouterr().err
    with pytest.raises(NotFoundError):
        await nats_client.jetstream().stream_info(f"KV_{bucket}")


def test_an_unreachable_server_exits_1_quickly(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config_file = write_config(tmp_path / "c.yaml", f"nats://127.0.0.1:{free_port()}", "b")
    started = time.monotonic()
    code = run(argparse.Namespace(config=str(config_file), json=False, pins=False))
    assert code == 1
    assert time.monotonic() - started < 10
    assert "cannot read from NATS" in capsys.readouterr().err


async def test_an_embedded_config_reaches_the_server_up_started_on_its_port(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    nats_client: NatsClient,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`nats.url: embedded` (the config `llmgw up` ran with) reads from embedded_port."""
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    data = yaml.safe_load(config_file.read_text())
    data["nats"] = {"url": "embedded", "embedded_port": urlsplit(nats_url).port}
    config_file.write_text(yaml.safe_dump(data))
    await open_routing_bucket(nats_client.jetstream(), bucket)
    code = await asyncio.to_thread(
        run, argparse.Namespace(config=str(config_file), json=True, pins=False)
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["bucket"] == bucket


def test_an_embedded_config_on_a_random_port_exits_2_explaining_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["nats"] = {"url": "embedded", "embedded_port": 0}
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(data))
    code = run(argparse.Namespace(config=str(config_file), json=False, pins=False))
    assert code == 2
    err = capsys.readouterr().err
    assert "LLMGW_NATS__URL=nats://HOST:PORT" in err and "llmgw up" in err


async def test_a_session_is_found_by_the_key_the_client_sent(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--session alice`: the pins of the session header value (or `user`) alice, hashed as the
    edge hashes it; other sessions are left out."""
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    config = load_config(config_file, env={})
    admission = await start_admission(config, nats_url, instance="admission-k", follow_load=False)
    try:
        for key, turn in (("alice", 1), ("bob", 1), ("alice", 2), ("bob", 2)):  # pins written
            session = core_session_id(Feature.CHAT, MODEL, {}, header_key=key)
            reply = await admission.service.decide(
                AdmitRequest(
                    id=f"k-{key}-{turn}",
                    edge="edge-x",
                    model=MODEL,
                    feature="chat",
                    session=session,
                    shard=shard_of(session, config.admission.shards),
                )
            )
            assert reply.status is ReplyStatus.ADMITTED
        await admission.service.pins.drain()
        code = await asyncio.to_thread(
            run, argparse.Namespace(config=str(config_file), json=True, pins=False, session="alice")
        )
    finally:
        await admission.stop()
    assert code == 0
    pins = json.loads(capsys.readouterr().out)["pins"]
    assert [p["session"] for p in pins] == [
        core_session_id(Feature.CHAT, MODEL, {}, header_key="alice")
    ]


async def test_a_cluster_started_with_a_port_offset_is_reached_with_the_same_offset(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    nats_client: NatsClient,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`llmgw up --port-offset N` moves the embedded NATS port by N; `llmgw state
    --port-offset N` with the same config reads that server, and without it never does."""
    offset = 1000
    port = urlsplit(nats_url).port
    assert port is not None and port - offset > 1024
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    data = yaml.safe_load(config_file.read_text())
    data["nats"] = {"url": "embedded", "embedded_port": port - offset, "connect_timeout": "1s"}
    config_file.write_text(yaml.safe_dump(data))
    await open_routing_bucket(nats_client.jetstream(), bucket)

    def state(*argv: str) -> int:
        return run(build_parser().parse_args(["state", "--config", str(config_file), *argv]))

    assert await asyncio.to_thread(state, "--json", "--port-offset", str(offset)) == 0
    assert json.loads(capsys.readouterr().out)["bucket"] == bucket
    assert await asyncio.to_thread(state, "--json") == 1  # the unshifted port: not this cluster


def test_tools_move_the_nats_port_as_llmgw_up_moves_it(tmp_path: Path) -> None:
    """The tools' offset rule and `llmgw up`'s (services/up/offset.py) agree, for every tool
    that dials the cluster."""
    raw = yaml.safe_load(LOCAL_CONFIG.read_text())
    moved = config_from_dict(shift_ports(raw, 1000), env={})
    for tool, action in (("state", []), ("events", []), ("keys", ["list"])):
        config = ["--config", str(LOCAL_CONFIG)]
        args = build_parser().parse_args([tool, *config, "--port-offset", "1000", *action])
        assert load_tool_config(args).nats == moved.nats, tool
        unmoved = build_parser().parse_args([tool, *config, *action])
        assert load_tool_config(unmoved).nats == load_config(LOCAL_CONFIG).nats


async def test_endpoints_show_the_scrapers_reports_with_each_engines_dialect(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    nats_client: NatsClient,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    config = load_config(config_file, env={})
    await open_routing_bucket(nats_client.jetstream(), bucket)

    def state(*argv: str) -> int:
        return run(build_parser().parse_args(["state", "--config", str(config_file), *argv]))

    assert await asyncio.to_thread(state) == 0
    assert "endpoints: no load bucket read (none yet: start `llmgw scraper`" in (
        capsys.readouterr().out
    )
    load_kv = await open_load_bucket(nats_client, config)
    try:
        now = time.time()
        for endpoint, sample, metrics in (
            ("engine-a", LoadSample(dialect="llamacpp", running=3, waiting=1), "partial"),
            ("engine-b", None, "error"),
        ):
            report = EndpointReport(
                endpoint=endpoint,
                provider=IRIS,
                pool="gpu",
                models=(MODEL,),
                healthy=True,
                sample=sample,
                metrics=metrics,
                metrics_error="HTTP 500" if sample is None else None,
                capacity=4,
                saturation=0.0,
                scraped_at=now - 1,
                scraper="scraper-x",
            )
            await load_kv.put(report_key(endpoint), report.to_bytes())
        assert await asyncio.to_thread(state, "--json") == 0
        endpoints = {e["endpoint"]: e for e in json.loads(capsys.readouterr().out)["endpoints"]}
        assert endpoints["engine-a"]["dialect"] == "llamacpp"
        assert (endpoints["engine-a"]["running"], endpoints["engine-a"]["kv_usage"]) == (3, None)
        assert endpoints["engine-b"]["dialect"] is None
        assert endpoints["engine-b"]["metrics_error"] == "HTTP 500"
        assert await asyncio.to_thread(state) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        # ... capacity, saturation, the engine's context window (none reported here), age
        assert [
            "engine-a",
            IRIS,
            "yes",
            "llamacpp",
            "partial",
            "3",
            "1",
            "-",
            "4",
            "0.00",
            "-",
        ] in [row[:-1] for row in rows]
        assert ["engine-b", IRIS, "yes", "-", "error", "-", "-", "-", "4", "0.00", "-"] in [
            row[:-1] for row in rows
        ]
    finally:
        await nats_client.jetstream().delete_key_value(config.router.load_bucket)


async def test_sub_agents_are_listed_under_their_parents_and_found_by_their_sessions_key(
    tmp_path: Path,
    nats_url: str,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Claude Code session's main agent, a sub-agent of it and one that sub-agent started:
    `--pins` lists them as a tree under the root (the other session beside it), and `--session`
    with the session header's value finds the whole family, parents in the JSON."""
    config_file = write_config(tmp_path / "c.yaml", nats_url, bucket)
    config = load_config(config_file, env={})
    root = key_session(("claude-1",), MODEL, "chat")
    sub = key_session(("claude-1", "agent-a"), MODEL, "chat")
    nested = key_session(("claude-1", "agent-b"), MODEL, "chat")
    other = key_session(("zz-other",), MODEL, "chat")
    admission = await start_admission(config, nats_url, instance="admission-t", follow_load=False)
    try:
        family = ((nested, sub), (other, None), (root, None), (sub, root))
        for turn, (session, parent) in enumerate(family * 2):  # 2 requests each: pins written
            reply = await admission.service.decide(
                AdmitRequest(
                    id=f"t-{session}-{turn}",
                    edge="edge-x",
                    model=MODEL,
                    feature="chat",
                    session=session,
                    parent=parent,
                    shard=shard_of(root if parent else session, config.admission.shards),
                )
            )
            assert reply.status is ReplyStatus.ADMITTED
        await admission.service.pins.drain()
        text = await asyncio.to_thread(
            run, argparse.Namespace(config=str(config_file), json=False, pins=True)
        )
        listed = capsys.readouterr().out
        found = await asyncio.to_thread(
            run,
            argparse.Namespace(config=str(config_file), json=True, pins=False, session="claude-1"),
        )
    finally:
        await admission.stop()
    assert text == found == 0
    family = [r for r in listed.splitlines() if root in r or sub in r or nested in r]
    assert [r.split()[0] for r in family] == [root, "└", "└"], listed
    assert family[1].startswith("  └ " + sub) and family[2].startswith("    └ " + nested)
    pins = {p["session"]: p["parent"] for p in json.loads(capsys.readouterr().out)["pins"]}
    assert pins == {root: None, sub: root, nested: sub}
