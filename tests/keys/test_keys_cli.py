"""`llmgw keys`: the secret shown once, prefixes in listings, seeding from a file."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.core.apikeys import RateWindow

# One cluster for the module (conftest: keyed_cluster), so one event loop for it too.
pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_the_secret_is_shown_once_and_never_stored(keyed) -> None:
    created = await keyed.keys(
        "create", "--tenant", "team-a", "--models", "m1,m2*", "--rpm", "60", "--label", "team=a"
    )
    secret = created["secret"]
    assert secret.startswith("sk-llmgw-") and secret.startswith(created["prefix"])
    listed = [k for k in await keyed.keys("list") if k["tenant"] == "team-a"]
    shown = await keyed.keys("show", created["id"][:8])
    for view in (listed, shown):
        text = json.dumps(view)
        assert secret not in text and secret[len(created["prefix"]) :] not in text
    [entry] = listed
    assert entry["id"] == created["id"] and entry["prefix"] == created["prefix"]
    assert shown["models"] == ["m1", "m2*"] and shown["rpm"] == 60
    assert shown["labels"] == {"team": "a"}
    updated = await keyed.keys("update", created["id"], "--rpm", "0", "--tpm", "1000")
    assert updated["rpm"] is None and updated["tpm"] == 1000


async def test_keys_seeded_from_a_file_work_at_every_edge(keyed, tmp_path: Path) -> None:
    seed = tmp_path / "keys.yaml"
    secret = "sk-llmgw-seeded-for-compose-0123456789"
    seed.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"secret_env": "TEAM_A_KEY", "tenant": "seeded", "models": ["m2"]},
                ]
            }
        )
    )
    [seeded] = await keyed.keys("seed", str(seed), env={"TEAM_A_KEY": secret})
    assert seeded["tenant"] == "seeded"
    # Seeding again is an update, not a second key.
    await keyed.keys("seed", str(seed), env={"TEAM_A_KEY": secret})
    assert [k["id"] for k in await keyed.keys("list") if k["tenant"] == "seeded"] == [seeded["id"]]
    body = {"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=10) as client:
        for url in keyed.edges:
            response = await client.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {secret}"},
            )
            assert response.status_code == 200


async def test_usage_by_key_tenant_and_model(keyed) -> None:
    created = await keyed.keys("create", "--tenant", "usage-team", "--rpm", "1000")
    window = RateWindow()
    if window.reset_in(time.time()) < 5:  # the run must fit in one 60 s window
        await asyncio.sleep(window.reset_in(time.time()))
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(timeout=10) as client:
        for i in range(4):
            response = await client.post(
                f"{keyed.edges[i % 2]}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {created['secret']}"},
            )
            assert response.status_code == 200
    # This minute's use, as every edge reports it.
    report = await keyed.keys("usage")
    [row] = [r for r in report["keys"] if r["id"] == created["id"]]
    assert row["tenant"] == "usage-team" and row["rpm"] == 1000
    assert row["requests"] == 4 and row["tokens"] > 0
    assert report["edges"] == 2
