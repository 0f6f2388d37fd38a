"""The admin API through `llmgw up` with the shipped config: `llmgw up` makes a token and says
where it is (never printing it); a caller without it gets 401, with another 403, and changes
nothing; the CLI passes it (`llmgw endpoints --admin-url`); /metrics and /health stay open."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from test_up_operability import NATS, READY
from up_harness import UpProcess, llmgw_cli, write_cluster_config

pytestmark = pytest.mark.e2e


def test_up_guards_the_admin_api_with_a_token_the_cli_passes(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml")
    admin = "http://" + yaml.safe_load(config.read_text())["admin_listen"]
    up = start_up(config)
    up.wait_for(READY, timeout=90)
    nats_url = up.wait_for(NATS).group(1)
    token_file = Path(up.admin_token_file())
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    assert token not in up.output()  # it says where the token is, never what it is

    def cli(*args: str, **env: str) -> tuple[int, str, str]:
        done = llmgw_cli(config, "endpoints", *args, env={"LLMGW_NATS__URL": nats_url, **env})
        return done.returncode, done.stdout, done.stderr

    with httpx.Client(base_url=admin, timeout=10) as http:
        assert http.get("/metrics").status_code == 200  # open: scrapers carry no token
        assert http.get("/health").status_code == 200
        before = http.get("/admin/endpoints", headers={"authorization": f"Bearer {token}"})
        assert before.status_code == 200, before.text
        body = {"id": "evil", "url": "http://127.0.0.1:1", "provider": "iris", "probe": False}
        body["models"] = ["llama-3.3-70b"]
        for headers, status in (({}, 401), ({"authorization": "Bearer not-the-token"}, 403)):
            added = http.post("/admin/endpoints", json=body, headers=headers)
            assert added.status_code == status, added.text
            drained = http.post("/admin/endpoints/engine-1/drain", headers=headers)
            assert drained.status_code == status, drained.text
            assert http.get("/admin/endpoints", headers=headers).status_code == status
        after = http.get("/admin/endpoints", headers={"authorization": f"Bearer {token}"})
        assert after.json() == before.json()  # no write took effect

    # The CLI over the admin API: with the token file `llmgw up` named, and without it.
    code, out, err = cli(
        "--json", "--admin-url", admin, "list", LLMGW_AUTH__ADMIN_TOKEN_FILE=str(token_file)
    )
    assert code == 0, err
    assert {e["id"] for e in json.loads(out)} >= {"engine-1", "engine-2"}
    code, _, err = cli("--admin-url", admin, "list")
    assert code == 2 and "needs the admin token" in err and "LLMGW_AUTH__ADMIN_TOKEN_FILE" in err
    code, _, err = cli("--admin-url", admin, "drain", "engine-1", LLMGW_AUTH__ADMIN_TOKEN="x" * 32)
    assert code == 2 and "admin token is not valid" in err, err
    code, _, err = cli(
        "--admin-url", admin, "drain", "engine-2", LLMGW_AUTH__ADMIN_TOKEN_FILE=str(token_file)
    )
    assert code == 0, err
    code, out, err = cli("--json", "list")  # over NATS, as before: no admin token needed
    assert code == 0, err
    assert {e["id"]: e["state"] for e in json.loads(out)} == {
        **{e["id"]: "active" for e in json.loads(out)},
        "engine-2": "draining",
    }
    up.stop()
    assert not token_file.exists()  # a run's own token goes with it


def test_up_keeps_a_configured_token_file_and_makes_it_when_missing(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    token_file = tmp_path / "secrets" / "admin-token"
    config = write_cluster_config(
        tmp_path / "cluster.yaml", auth={"mode": "keys", "admin_token_file": str(token_file)}
    )
    admin = "http://" + yaml.safe_load(config.read_text())["admin_listen"]
    up = start_up(config)
    up.wait_for(READY, timeout=90)
    assert up.admin_token_file() == str(token_file)
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    listed = httpx.get(
        f"{admin}/admin/endpoints", headers={"authorization": f"Bearer {token}"}, timeout=10
    )
    assert listed.status_code == 200, listed.text
    up.stop()
    assert token_file.read_text().strip() == token  # kept for the next run
    assert os.environ.get("LLMGW_AUTH__ADMIN_TOKEN_FILE") is None
