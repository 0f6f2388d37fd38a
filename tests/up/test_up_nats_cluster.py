"""`llmgw up` with an embedded JetStream cluster: the plan, --dry-run, port checks, end to end."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import httpx
import nats
import pytest
import yaml
from timing import eventually
from up_harness import LOCAL_CONFIG, UpProcess, process_exists

from llmgw.config import config_from_dict, load_config
from llmgw.services.up.main import run
from llmgw.services.up.plan import PlanError, plan_nats

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)


def _local(**nats_fields: object) -> dict:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["nats"].update(nats_fields)
    return data


def test_the_flag_asks_for_three_nodes_and_three_replicas() -> None:
    plan = plan_nats(load_config(LOCAL_CONFIG, env={}), 3)
    assert [(n.name, n.port) for n in plan.nodes] == [
        ("nats-0", 4222),
        ("nats-1", 4223),
        ("nats-2", 4224),
    ]
    assert plan.is_cluster and plan.replicas == 3
    assert plan.child_env("nats://a:1,nats://b:2,nats://c:3") == {
        "LLMGW_NATS__URL": "nats://a:1,nats://b:2,nats://c:3",
        "LLMGW_NATS__REPLICAS": "3",
    }


def test_the_config_asks_for_a_cluster_and_the_flag_wins() -> None:
    config = config_from_dict(_local(embedded_cluster=3, embedded_port=0), env={})
    plan = plan_nats(config)
    assert len(plan.nodes) == 3 and {n.port for n in plan.nodes} == {0}  # free ports
    single = plan_nats(config, 1)
    assert not single.is_cluster and single.replicas == 1
    assert single.child_env("nats://a:1") == {"LLMGW_NATS__URL": "nats://a:1"}


def test_replicas_set_in_the_config_are_kept() -> None:
    plan = plan_nats(config_from_dict(_local(replicas=1), env={}), 3)
    assert plan.replicas == 1
    five = config_from_dict(_local(embedded_cluster=5), env={"LLMGW_NATS__REPLICAS": "5"})
    assert plan_nats(five).replicas == 5


@pytest.mark.parametrize(
    ("nats_fields", "flag", "message"),
    [
        ({"url": "nats://10.0.0.5:4222"}, 3, "--nats-cluster needs nats.url: embedded"),
        ({}, 2, "use 1 (one server) or 3..7"),
        ({"replicas": 5}, 3, "buckets with 5 replicas need at least 5 NATS servers"),
        ({"replicas": 3}, None, "would start 1"),
    ],
)
def test_impossible_nats_setups_are_refused(
    nats_fields: dict, flag: int | None, message: str
) -> None:
    config = config_from_dict(_local(**nats_fields), env={})
    with pytest.raises(PlanError, match=re.escape(message)):
        plan_nats(config, flag)


def test_a_pinning_replicas_override_needs_enough_servers_too() -> None:
    data = _local()
    data["pinning"] = {"replicas": 3}
    with pytest.raises(PlanError, match="buckets with 3 replicas"):
        plan_nats(config_from_dict(data, env={}))
    assert plan_nats(config_from_dict(data, env={}), 3).replicas == 3


def test_dry_run_lists_three_nats_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(config=str(LOCAL_CONFIG), dry_run=True, nats_cluster=3)
    assert run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("nats ") and "JetStream cluster llmgw-up of 3 nodes" in lines[0]
    assert "bucket replicas: 3" in lines[0]
    for index in range(3):
        assert lines[1 + index].split() == [
            f"nats-{index}",
            "nats-server",
            f"llmgw-up-{index}",
            "on",
            f"127.0.0.1:{4222 + index}",
            "(cluster",
            "port:",
            "a",
            "free",
            "one)",
        ]
    assert lines[4].startswith("engine-1 ")


def test_a_bad_flag_exits_2_before_anything(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(config=str(LOCAL_CONFIG), dry_run=True, nats_cluster=2)
    assert run(args) == 2
    assert "use 1 (one server) or 3..7" in capsys.readouterr().err


def test_a_busy_port_of_a_later_node_is_reported_before_anything_starts(
    cluster_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        data = yaml.safe_load(cluster_config.read_text())
        data["nats"]["embedded_port"] = port - 1
        cluster_config.write_text(yaml.safe_dump(data))
        args = argparse.Namespace(config=str(cluster_config), dry_run=False, nats_cluster=3)
        assert run(args) == 1
    err = capsys.readouterr().err
    assert f"port 127.0.0.1:{port} (nats.embedded_port + 1, nats-1) is already in use" in err
    assert "nothing was started" in err


async def _replicas(url: str, stream: str) -> int:
    client = await nats.connect(url.split(","), connect_timeout=2, allow_reconnect=False)
    try:
        return (await client.jetstream().stream_info(stream)).config.num_replicas
    finally:
        await client.close()


def _chat(api: str, key: str) -> httpx.Response:
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    auth = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{api}/chat/completions", json=body, headers=auth, timeout=30)


def _eventually_200(api: str, key: str, timeout: float) -> None:
    def answered() -> bool:
        return _chat(api, key).status_code == 200

    asyncio.run(eventually(answered, timeout, "a 200 answer", interval=0.2))


@pytest.mark.e2e
def test_up_on_a_cluster_serves_survives_a_node_crash_and_stops_every_node(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config, "--nats-cluster", "3")
    api, key = up.wait_for(READY, timeout=90).groups()
    urls = up.wait_for(r"^llmgw up: edge \S+, admin \S+, NATS (\S+)$").group(1)
    assert len(urls.split(",")) == 3
    pids = up.pids()
    assert {"nats-0", "nats-1", "nats-2"} <= set(pids) and "nats" not in pids
    assert _chat(api, key).status_code == 200
    # Every bucket the services created is replicated on the three nodes.
    assert asyncio.run(_replicas(urls, "KV_llmgw_routing")) == 3
    assert asyncio.run(_replicas(urls, "KV_llmgw_load")) == 3
    assert asyncio.run(_replicas(urls, "KV_llmgw_keys")) == 3

    os.kill(pids["nats-1"], signal.SIGKILL)
    up.wait_for(r"^\[nats-1\] exited with code -9; restarting it with its store", timeout=10)
    up.wait_for(r"^\[nats-1\] ready again \(pid \d+\)", timeout=30)
    assert up.pids()["nats-1"] != pids["nats-1"]
    # If nats-1 led a bucket's stream, admission answers 503 until the survivors elect a new
    # leader (a Raft election timeout, 4-9 s): poll, with a deadline above that.
    _eventually_200(api, key, timeout=20)

    assert up.stop(signal.SIGTERM) == 0
    assert up.lines[-2:] == ["llmgw up: stopped", "[nats] stopped"]  # NATS stops last
    assert not [pid for pid in up.all_pids() if process_exists(pid)]
