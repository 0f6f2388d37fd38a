"""An applied config through `llmgw up` with the shipped config, each change observed without a
restart: a band told to leave most batch slots to the bands above it sends its requests to the
third party at once, and with its overflow turned off they wait for the engines instead; an
alias added is listed and served, a default band changed takes the next request, and a timeout
shortened cuts the next request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from poisson_load import PoissonLoad
from test_up_operability import NATS, READY
from up_harness import UpProcess, config_apply, write_cluster_config

from llmgw.config.sections import default_bands

pytestmark = pytest.mark.e2e

BURST = 12  # concurrent requests: within the engines' 32 slots, so the shipped bands grant all
HEADROOM = 14  # slots per engine that gold leaves free: it holds back past 2 * (16 - 14) - 1


def _cluster(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> tuple[Any, str, str, str, UpProcess]:
    """`llmgw up` with the shipped config: its values, API URL and key, NATS URL, process."""
    config = write_cluster_config(tmp_path / "cluster.yaml")
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    return yaml.safe_load(config.read_text()), api, key, up.wait_for(NATS).group(1), up


def _apply(data: dict[str, Any], path: Path, nats_url: str) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    done = config_apply(path, nats_url)
    assert done.returncode == 0, done.stderr
    assert "1 admission instances run on it" in done.stdout, done.stdout


async def _burst(api: str, key: str) -> list[str]:
    """The endpoint of each of BURST requests sent at once (all must succeed)."""
    load = PoissonLoad(api, key, rate=1.0, max_tokens=24, seed=4)
    sent = await asyncio.gather(*(load.one() for _ in range(BURST)))
    await load.stop()
    assert all(s.status == 200 for s in sent), [s.detail for s in sent if s.status != 200]
    return [s.endpoint or "" for s in sent]


def _offloaded(endpoints: list[str]) -> int:
    return sum(e.startswith("tensorx") for e in endpoints)


def test_a_bands_headroom_and_overflow_applied_live_decide_the_next_requests(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    data, api, key, nats_url, _up = _cluster(tmp_path, start_up)
    assert _offloaded(asyncio.run(_burst(api, key))) == 0  # gold, as shipped: room for all

    bands = [band.model_dump() for band in default_bands()]
    gold = next(band for band in bands if band["name"] == "gold")  # the default band
    gold.update(batch_headroom=HEADROOM)  # overflow: True, as shipped
    data.setdefault("admission", {})["bands"] = bands
    _apply(data, tmp_path / "low.yaml", nats_url)
    lowered = asyncio.run(_burst(api, key))
    # Past 3 requests in flight gold leaves its engines' free slots to the bands above it.
    assert _offloaded(lowered) >= BURST // 2, lowered

    gold.update(overflow=False)
    _apply(data, tmp_path / "wait.yaml", nats_url)
    waited = asyncio.run(_burst(api, key))
    assert _offloaded(waited) == 0, waited  # held back, they waited for the engines
    print(
        f"\nbands applied live: gold with a headroom of {HEADROOM} sent {_offloaded(lowered)} "
        f"of {BURST} to the third party; without overflow all {BURST} waited for the engines"
    )


def test_an_alias_and_a_timeout_applied_live_reach_the_edge_at_once(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    data, api, key, nats_url, up = _cluster(tmp_path, start_up)
    headers = {"authorization": f"Bearer {key}"}

    def ask(model: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = 64
        return httpx.post(f"{api}/chat/completions", json=body, headers=headers, timeout=30)

    def listed() -> list[str]:
        return [m["id"] for m in httpx.get(f"{api}/models", headers=headers).json()["data"]]

    assert ask("big").status_code == 404 and "big" not in listed()
    data["models"][0]["aliases"] = ["llama", "big"]
    data.setdefault("admission", {})["default_band"] = "silver"  # the dev key has none of its own
    _apply(data, tmp_path / "alias.yaml", nats_url)
    assert "big" in listed()
    answered = ask("big")
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] in ("big", "llama-3.3-70b")
    logged = up.wait_for(rf"request_id={answered.headers['x-request-id']} .* band=(\w+)", 10)
    assert logged.group(1) == "silver"

    # A 64-token answer takes longer than that on the engines and the third party alike.
    data["timeouts"] = {"response_header": "50ms", "first_token": "50ms", "total": "50ms"}
    _apply(data, tmp_path / "timeout.yaml", nats_url)
    cut = ask("llama")
    assert cut.status_code == 504, cut.text
