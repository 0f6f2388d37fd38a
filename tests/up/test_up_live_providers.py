"""A provider and a model added and removed by `llmgw config apply` through `llmgw up` with the
shipped config, without a restart: the new model is listed and served through the new provider
as soon as the command returns; its key, prices and a tenant's budget change while it runs (a
key the provider revoked is the gateway's failure, 502, never the client's 401; the rotated key
file is read at the next apply; the new price is the next request's cost; a budget given takes
the next request); once it is removed again it is answered like a model that never existed
(404 model_not_found), a request that ran on it finishes, and no lease is left."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import yaml
from test_up_operability import NATS, READY
from timing import eventually
from up_harness import UpProcess, write_cluster_config

from llmgw.broadcast import ask_instances
from llmgw.config import config_from_dict
from llmgw.services.fleet.apply import apply_file
from llmgw.services.sim.apps import create_provider_app
from llmgw.services.sim.params import ProviderParams
from llmgw.serving import start_server

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b"


def _with_provider(data: dict[str, Any], url: str, key_file: Path) -> dict[str, Any]:
    """The shipped config plus a second third party, `vela`, serving a new model with the key
    in `key_file`."""
    added = copy.deepcopy(data)
    added["models"].append({"name": MODEL, "aliases": ["mistral"]})
    added["providers"].append(
        {
            "id": "vela",
            "kind": "unlimited",
            "priority": 40,
            "api_key_file": str(key_file),
            "models": [{"name": MODEL}],
        }
    )
    added["endpoints"].append({"id": "vela-1", "url": url, "provider": "vela", "models": [MODEL]})
    return added


async def _leases(nc: Any) -> dict[str, int]:
    """Live leases per endpoint, summed over the admission instances that answer."""
    held: dict[str, int] = {}
    for reply in await ask_instances(nc, 0.3):
        for endpoint, count in reply.leases_by_endpoint.items():
            held[endpoint] = held.get(endpoint, 0) + count
    return {e: n for e, n in held.items() if n}


def test_a_provider_and_model_applied_live_are_served_at_once_and_removed_cleanly(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    path = write_cluster_config(tmp_path / "cluster.yaml")
    data = yaml.safe_load(path.read_text())
    up = start_up(path)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    headers = {"authorization": f"Bearer {key}"}

    async def main() -> dict[str, float]:
        # 20 tokens/s: a 40-token answer streams for about 2 s
        params = ProviderParams(
            tokens_per_second=20, base_latency=0.02, seed=7, api_keys=["vela-key-1"]
        )
        vela = await start_server(create_provider_app(params, [MODEL]))
        nc = await nats.connect(nats_url)
        http = httpx.AsyncClient(base_url=api, headers=headers, timeout=30)
        key_file = tmp_path / "vela.key"
        key_file.write_text("vela-key-1\n")
        try:
            return await _scenario(data, vela.url, nc, http, key_file)
        finally:
            await http.aclose()
            await nc.close()
            await vela.stop()

    figures = asyncio.run(main())
    print(
        f"\nprovider + model applied live: first answer from the new model (1 token) "
        f"{figures['served']:.3f}s after the apply began, acknowledged after {figures['ack']:.3f}s; "
        f"removed: 404 model_not_found, the running stream finished, no lease left"
    )


async def _apply(nc: Any, values: dict[str, Any]) -> None:
    config = config_from_dict(values, env={})
    _, on_it, answering, edges = await apply_file(nc, config, values, "<test>", wait=10)
    assert on_it == answering == 1 and all(e.follows for e in edges), (on_it, answering, edges)


async def _keys_prices_and_budgets(
    added: dict[str, Any], url: str, nc: Any, http: httpx.AsyncClient, key_file: Path
) -> None:
    """The running provider's key rotated, its prices and a tenant's budget given, live."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with httpx.AsyncClient(base_url=url) as vela:
        revoked = await vela.post("/sim/faults", json={"api_keys": ["vela-key-2"]})
        assert revoked.status_code == 200, revoked.text
    refused = await http.post("/chat/completions", json=body)
    assert refused.status_code == 502, refused.text  # the gateway's key, not the client's
    error = refused.json()["error"]
    assert error["code"] == "upstream_error" and "credentials" in error["message"], error

    await asyncio.to_thread(key_file.write_text, "vela-key-2\n")  # rotated, then applied
    priced = copy.deepcopy(added)
    priced["spend"]["cost_header"] = True
    priced["spend"]["prices"].append({"provider": "vela", "model": MODEL, "input": 1, "output": 2})
    await _apply(nc, priced)
    served = await http.post("/chat/completions", json=body)
    assert served.status_code == 200, served.text
    usage = served.json()["usage"]
    picos = usage["prompt_tokens"] * 1_000_000 + usage["completion_tokens"] * 2_000_000
    assert served.headers["x-llmgw-cost"] == f"{picos / 10**12:.6f} USD", served.headers

    budgeted = copy.deepcopy(priced)  # the development key's tenant: less than one request
    budgeted["spend"]["budgets"] = [{"tenant": "dev", "period": "daily", "max_spend": 0.000001}]
    await _apply(nc, budgeted)
    over = await http.post("/chat/completions", json=body)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "insufficient_quota", over.text
    await _apply(nc, priced)  # the budget taken back: served again
    again = await http.post("/chat/completions", json=body)
    assert again.status_code == 200, again.text


async def _scenario(
    data: dict[str, Any], url: str, nc: Any, http: httpx.AsyncClient, key_file: Path
) -> dict[str, float]:
    def ask(model: str, **extra: Any) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        return body | extra

    async def listed() -> list[str]:
        return [m["id"] for m in (await http.get("/models")).json()["data"]]

    unknown = await http.post("/chat/completions", json=ask(MODEL))
    assert unknown.status_code == 404 and MODEL not in await listed()

    added = _with_provider(data, url, key_file)
    config = config_from_dict(added, env={})
    began = time.monotonic()
    applying = asyncio.create_task(apply_file(nc, config, added, "<added>", wait=10))
    while (
        served := await http.post("/chat/completions", json=ask("mistral", max_tokens=1))
    ).status_code == 404:
        assert time.monotonic() - began < 5, "the new model was not served within 5 s"
    first_answer = time.monotonic() - began
    assert served.status_code == 200, served.text
    revision, on_it, answering, edges = await applying
    acknowledged = time.monotonic() - began
    assert on_it == answering == 1, (revision, on_it, answering)
    assert [(e.config_revision, e.follows) for e in edges] == [(revision, True)]  # the edge
    assert served.headers.get("x-llmgw-endpoint", "vela-1") == "vela-1"
    assert MODEL in await listed() and "mistral" in await listed()
    assert first_answer < 1.0, f"the new model was served {first_answer:.3f}s after the apply"

    await _keys_prices_and_budgets(added, url, nc, http, key_file)

    # A stream on the new provider runs while it is removed: it finishes, nothing new starts.
    async def stream() -> list[str]:
        body = ask(MODEL, stream=True, max_tokens=40, ignore_eos=True)  # all 40: still running
        async with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            return [line async for line in response.aiter_lines() if line.startswith("data:")]

    running = asyncio.create_task(stream())

    async def held_on_vela() -> bool:
        return bool((await _leases(nc)).get("vela-1"))

    await eventually(held_on_vela, 5, "the stream's lease on vela-1")
    assert (await _leases(nc)).get("vela-1") == 1

    original = config_from_dict(data, env={})
    _, on_it, answering, _ = await apply_file(nc, original, data, "<removed>", wait=10)
    assert on_it == answering == 1
    assert not running.done(), "the stream ended before the provider was removed"
    gone = await http.post("/chat/completions", json=ask(MODEL))
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
    assert MODEL not in await listed() and "mistral" not in await listed()

    lines = await running
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert any(json.loads(x[5:]).get("choices") for x in lines[:-1])

    async def none_held() -> bool:
        return not await _leases(nc)

    # Its lease ends with the request (the edge's end message).
    await eventually(none_held, 5, "no lease left")
    assert await _leases(nc) == {}
    return {"ack": acknowledged, "served": first_answer}
