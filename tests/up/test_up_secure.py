"""`llmgw up --secure`: the shipped config with one NATS user per service role.

The whole gateway works through it (requests with the development key and with a key the `keys`
role created, `llmgw state`, `llmgw events`), the server logs no permissions violation while it
does, and the denials are real: the edge role may not write the key bucket, a tool with no user
is refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from up_harness import UpProcess, config_apply, llmgw_cli

from llmgw.nats_auth import ROLES

pytestmark = pytest.mark.e2e

READY = r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) "
NATS = r"^llmgw up: edge \S+, admin \S+, NATS (\S+)$"
NATS_STORE = r"^\[nats(?:-\d+)?\] nats-server .* store (\S+)\)$"


def _cli(
    config: Path, nats_url: str, role: str | None, passwords: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    env = {"LLMGW_NATS__URL": nats_url}
    if role is not None:
        env.update(LLMGW_NATS__USER=role, LLMGW_NATS__PASSWORD=passwords[role])
    return llmgw_cli(config, *args, env=env)


def _chat(
    api: str, key: str, *, stream: bool = False, session: str = "secure-test"
) -> httpx.Response:
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": stream,
    }
    return httpx.post(
        f"{api}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", "x-session-id": session},
        timeout=30,
    )


def _instances(config: Path, nats_url: str, passwords: dict[str, str]) -> dict[str, int]:
    """Shards per admission instance, as `llmgw state` (the state role) reports them."""
    done = _cli(config, nats_url, "state", passwords, "state", "--json")
    assert done.returncode == 0, done.stderr
    return {i["instance"]: i["shards"] for i in json.loads(done.stdout)["instances"]}


def _second_admission_takes_shards_and_hands_them_back(
    config: Path, nats_url: str, passwords: dict[str, str], api: str, key: str
) -> None:
    """Shard handovers and roll calls between instances and edges, under the roles' grants."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    env.update(
        LLMGW_NATS__URL=nats_url,
        LLMGW_NATS__USER="admission",
        LLMGW_NATS__PASSWORD=passwords["admission"],
    )
    second = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "admission", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # rebalancing is the instances' own pace: poll what state reports
            shards = _instances(config, nats_url, passwords)
            if len(shards) == 2 and all(shards.values()):
                break
            assert time.monotonic() < deadline, shards
        for turn in range(8):  # sessions on both instances' shards
            reply = _chat(api, key, session=f"handover-{turn}")
            assert reply.status_code == 200, reply.text
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    shards = _instances(config, nats_url, passwords)
    assert list(shards.values()) == [32], shards  # handed back to the one left


def _the_edge_follows_an_applied_alias(
    config: Path, tmp_path: Path, nats_url: str, passwords: dict[str, str], api: str, key: str
) -> None:
    """A separate edge follows the applied config by a read-only watch of its own, and
    answers config apply (by the fleet role) with the revision it runs on: an alias applied is
    listed once the command returns."""
    data = yaml.safe_load(config.read_text())
    data["models"][0]["aliases"] = [*data["models"][0]["aliases"], "big"]
    applied = tmp_path / "alias.yaml"
    applied.write_text(yaml.safe_dump(data, sort_keys=False))
    user = {"LLMGW_NATS__USER": "fleet", "LLMGW_NATS__PASSWORD": passwords["fleet"]}
    done = config_apply(applied, nats_url, user)
    assert done.returncode == 0, done.stderr
    assert "1 admission instances run on it, and 1 edges" in done.stdout, done.stdout
    headers = {"authorization": f"Bearer {key}"}
    listed = httpx.get(f"{api}/models", headers=headers).json()["data"]
    assert "big" in [m["id"] for m in listed]


def _violations(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "Violation" in line]


def test_the_gateway_runs_with_a_nats_user_per_role(
    cluster_config: Path, tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    passwords_file = tmp_path / "nats-passwords.yaml"
    up = start_up(cluster_config, "--secure", "--nats-passwords", str(passwords_file))
    api, dev_key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    log = Path(up.wait_for(NATS_STORE).group(1)) / "nats-server.log"
    passwords = yaml.safe_load(passwords_file.read_text())
    assert set(passwords) == set(ROLES)
    assert stat.S_IMODE(passwords_file.stat().st_mode) == 0o600
    assert not [p for p in passwords.values() if p in up.output()]  # never printed

    # Every service did its part as its role: requests, streams, a key the keys role made.
    for stream in (False, True):
        reply = _chat(api, dev_key, stream=stream)
        assert reply.status_code == 200, reply.text
    created = _cli(
        cluster_config, nats_url, "keys", passwords, "keys", "create", "--tenant", "t", "--rpm", "2"
    )
    assert created.returncode == 0, created.stderr
    secret = re.search(r"(sk-llmgw-\w+)", created.stdout).group(1)  # type: ignore[union-attr]
    statuses = [_chat(api, secret).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]  # the key's limit, on the admission and edge roles
    state = _cli(cluster_config, nats_url, "state", passwords, "state", "--json")
    assert state.returncode == 0, state.stderr
    events = _cli(cluster_config, nats_url, "events", passwords, "events", "--json")
    assert events.returncode == 0 and '"endpoint.scraped"' in events.stdout, events.stderr
    _second_admission_takes_shards_and_hands_them_back(
        cluster_config, nats_url, passwords, api, dev_key
    )
    _the_edge_follows_an_applied_alias(cluster_config, tmp_path, nats_url, passwords, api, dev_key)
    assert _violations(log) == []

    # Denials: the edge role reads the key bucket but may not write it; no user, no entry.
    edge = _cli(cluster_config, nats_url, "edge", passwords, "keys", "create", "--tenant", "x")
    assert edge.returncode == 1
    assert "NATS refused it: permissions violation" in edge.stderr, edge.stderr
    (denied,) = _violations(log)
    assert '"$G/user:edge" - Publish Violation - Subject "$KV.llmgw_keys.' in denied
    listed = _cli(cluster_config, nats_url, "edge", passwords, "keys", "--json", "list")
    assert listed.returncode == 0 and '"tenant": "x"' not in listed.stdout
    anonymous = _cli(cluster_config, nats_url, None, passwords, "state")
    assert anonymous.returncode != 0 and "Authorization Violation" in anonymous.stderr

    assert up.stop() == 0
    assert yaml.safe_load(passwords_file.read_text()) == passwords  # kept for the next start


def test_a_secure_nats_cluster_serves_every_role(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    """`--secure --nats-cluster 3`: every node has the users; the roles' grants hold across the
    cluster (replicated buckets are written through their leaders)."""
    up = start_up(cluster_config, "--secure", "--nats-cluster", "3")
    api, dev_key = up.wait_for(READY, timeout=120).groups()
    stores = [Path(up.wait_for(NATS_STORE, count=i + 1).group(1)) for i in range(3)]
    assert len(set(stores)) == 3
    for stream in (False, True):
        reply = _chat(api, dev_key, stream=stream)
        assert reply.status_code == 200, reply.text
    assert [v for store in stores for v in _violations(store / "nats-server.log")] == []
    assert up.stop() == 0
