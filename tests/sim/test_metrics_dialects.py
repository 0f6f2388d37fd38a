"""The simulator speaks each engine's metrics dialect, over HTTP, with its real batch and queue:
what the gateway's parser reads from it is the model's own state, whatever the names."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from sim_helpers import Serve
from timing import eventually

from llmgw.cli import build_parser
from llmgw.core.engine_capacity import CAPACITY_PATHS, parse_capacity
from llmgw.core.engine_metrics import EngineDialect, parse_engine_metrics
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.main import UsageError, resolve_settings
from llmgw.services.sim.params import METRICS_DIALECTS, EngineParams

MODEL = "m1"
# dialect: (what the parser detects, whether it reports KV usage, a name it must not show)
EXPECTED = {
    "vllm": (EngineDialect.VLLM, True, "vllm:gpu_cache_usage_perc"),
    "vllm-legacy": (EngineDialect.VLLM, True, "vllm:kv_cache_usage_perc"),
    "sglang": (EngineDialect.SGLANG, True, "vllm:"),
    "llamacpp": (EngineDialect.LLAMACPP, False, "vllm:"),
    "tgi": (EngineDialect.TGI, False, "vllm:"),
    "partial": (EngineDialect.VLLM, False, "vllm:kv_cache_usage_perc"),
}


def test_every_dialect_is_covered() -> None:
    assert set(EXPECTED) == set(METRICS_DIALECTS)


@pytest.mark.parametrize("dialect", METRICS_DIALECTS)
async def test_each_dialect_shows_the_real_batch_and_queue(serve: Serve, dialect: str) -> None:
    params = EngineParams(
        metrics_dialect=dialect,
        max_num_seqs=2,
        prefill_base=0.0,
        prefill_per_token=0.0,
        itl_base=0.05,
        itl_per_running_seq=0.0,
    )
    client = await serve(create_engine_app(params, [MODEL]))
    detected, has_kv, absent = EXPECTED[dialect]

    async def read():  # type: ignore[no-untyped-def]
        response = await client.get("/metrics")
        assert response.status_code == 200
        return response.text, parse_engine_metrics(response.text)

    text, idle = await read()
    assert absent not in text
    assert idle is not None and idle.dialect == detected
    assert (idle.running, idle.waiting) == (0, 0)
    assert (idle.kv_usage is not None) == has_kv

    body = {"model": MODEL, "prompt": "hold the batch", "max_tokens": 60, "ignore_eos": True}
    requests = [
        asyncio.create_task(client.post("/v1/completions", json=body, timeout=30)) for _ in range(3)
    ]
    try:

        async def queued() -> bool:
            state = (await client.get("/sim/state")).json()
            return (state["running"], state["waiting"]) == (2, 1)

        await eventually(queued)
        _, busy = await read()
        state = (await client.get("/sim/state")).json()
        assert busy is not None and (busy.running, busy.waiting) == (
            state["running"],
            state["waiting"],
        )
        if has_kv:
            assert busy.kv_usage is not None and busy.kv_usage > 0
        else:
            assert busy.kv_usage is None
    finally:
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)

    async def drained() -> bool:
        sample = (await read())[1]
        return sample is not None and (sample.running, sample.waiting) == (0, 0)

    await eventually(drained)


def test_the_dialect_comes_from_the_flag_the_set_or_the_simulate_block() -> None:
    def resolve(*argv: str) -> EngineParams:
        args = build_parser().parse_args(["sim", "engine", *argv])
        params = resolve_settings(args, "engine").params
        assert isinstance(params, EngineParams)
        return params

    assert resolve().metrics_dialect == "vllm"
    assert resolve("--metrics-dialect", "tgi").metrics_dialect == "tgi"
    assert resolve("--set", "metrics_dialect=llamacpp").metrics_dialect == "llamacpp"
    # The flag wins over --set, as --seed does.
    assert (
        resolve("--set", "metrics_dialect=sglang", "--metrics-dialect", "partial").metrics_dialect
        == "partial"
    )
    with pytest.raises(UsageError, match="metrics_dialect"):
        resolve_settings(
            argparse.Namespace(
                config=None,
                endpoint=None,
                host=None,
                port=None,
                model=None,
                seed=None,
                set=["metrics_dialect=triton"],
            ),
            "engine",
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", "engine", "--metrics-dialect", "triton"])


@pytest.mark.parametrize("dialect", METRICS_DIALECTS)
async def test_each_dialect_states_its_batch_capacity_where_that_engine_does(
    serve: Serve, dialect: str
) -> None:
    """SGLang's server info (both names), TGI's /info, llama-server's /props state
    max_num_seqs as the gateway reads them; vLLM's dialects state none (no such route)."""
    client = await serve(create_engine_app(EngineParams(metrics_dialect=dialect, max_num_seqs=7)))
    detected = EXPECTED[dialect][0]
    paths = CAPACITY_PATHS.get(detected, ())
    for path in paths:
        response = await client.get(path)
        assert response.status_code == 200, path
        assert parse_capacity(detected, response.text) == 7, path
    for path in {"/server_info", "/get_server_info", "/info", "/props"} - set(paths):
        assert (await client.get(path)).status_code == 404, path
