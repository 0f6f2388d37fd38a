"""`llmgw up --port-offset N`: every local port of the config moves by N, nothing else."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from up_harness import LOCAL_CONFIG, REPO

from llmgw.config import config_from_dict
from llmgw.services.up.offset import shift_ports


def test_local_ports_move_and_foreign_endpoints_stay() -> None:
    raw = yaml.safe_load(LOCAL_CONFIG.read_text())
    raw["endpoints"].append(
        {
            "id": "far",
            "url": "https://api.example:8443/v1",
            "provider": "tensorx",
            "models": ["llama-3.3-70b"],
        }
    )
    moved = shift_ports(raw, 1000)
    assert (moved["listen"], moved["admin_listen"]) == ("127.0.0.1:9080", "127.0.0.1:10090")
    assert moved["nats"]["embedded_port"] == 5222
    urls = {e["id"]: e["url"] for e in moved["endpoints"]}
    assert urls == {
        "engine-1": "http://127.0.0.1:9101",
        "engine-2": "http://127.0.0.1:9102",
        "tensorx-east": "http://127.0.0.1:9201",
        "tensorx-west": "http://127.0.0.1:9202",
        "far": "https://api.example:8443/v1",  # not ours to move
    }
    without = {k: v for k, v in moved.items() if k not in ("listen", "admin_listen", "nats")}
    assert [e["id"] for e in without["endpoints"]] == [e["id"] for e in raw["endpoints"]]
    config_from_dict(moved, source="<moved>", env={})  # still a valid config


def test_dry_run_plans_the_moved_cluster_and_leaves_no_file() -> None:
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("llmgw-up-offset*"))
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "up", "--dry-run", "--port-offset", "1000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "127.0.0.1:5222" in done.stdout and "127.0.0.1:9080 (edge `listen`)" in done.stdout
    assert "127.0.0.1:10092 (reaper admin)" in done.stdout  # admission runs in the edge
    assert set(temp.glob("llmgw-up-offset*")) == before
