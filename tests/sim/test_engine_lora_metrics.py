"""vLLM's vllm:lora_requests_info and vllm:cache_config_info on the simulated engine's /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import Serve
from timing import eventually

from llmgw.core.engine_metrics import parse_engine_metrics
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams

MODEL = "sim-llama"


def lora_series(text: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every vllm:lora_requests_info series, latest value first."""
    found = [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:lora_requests_info"
        for sample in family.samples
    ]
    return sorted(found, key=lambda item: -item[1])


async def hold(client: httpx.AsyncClient, model: str) -> None:
    """A long streamed request for `model` (runs until cancelled)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "keep going"}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            pass


async def test_lora_info_names_the_adapters_of_running_and_waiting_requests(serve: Serve) -> None:
    params = EngineParams(
        lora_modules=["sql-lora=/adapters/sql", "chat-lora"],
        max_loras=2,
        max_num_seqs=1,
        itl_base=0.02,
    )
    client = await serve(create_engine_app(params, [MODEL]))

    async def state_is(running: int, waiting: int) -> bool:
        state = (await client.get("/sim/state")).json()
        return (state["running"], state["waiting"]) == (running, waiting)

    tasks = [asyncio.create_task(hold(client, "sql-lora"))]
    try:
        await eventually(lambda: state_is(1, 0))
        tasks += [asyncio.create_task(hold(client, name)) for name in ("chat-lora", MODEL)]
        await eventually(lambda: state_is(1, 2))
        before = time.time()
        text = (await client.get("/metrics")).text
        after = time.time()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    (labels, value), *_ = lora_series(text)
    # The base model's waiting request is no adapter's.
    assert labels == {
        "max_lora": "2",
        "running_lora_adapters": "sql-lora",
        "waiting_lora_adapters": "chat-lora",
    }
    assert before <= value <= after  # the Unix time it was set

    await eventually(lambda: state_is(0, 0))  # the clients left: their requests were aborted
    series = lora_series((await client.get("/metrics")).text)
    assert series[0][0] == {
        "max_lora": "2",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    # The earlier label sets stay with the time they were last set, as in vLLM: readers take
    # the latest.
    assert (labels, value) in series[1:]


async def test_lora_info_appears_once_an_adapter_is_loaded_and_stays(
    serve: Serve,
) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    assert lora_series((await client.get("/metrics")).text) == []
    load = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
    assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 200
    [(labels, _)] = lora_series((await client.get("/metrics")).text)
    assert labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    # Unloading the adapter does not turn LoRA off (vLLM's --enable-lora stays).
    assert (await client.post("/v1/unload_lora_adapter", json=load)).status_code == 200
    assert lora_series((await client.get("/metrics")).text)


@pytest.mark.parametrize(
    ("dialect", "shown"),
    [("vllm", True), ("vllm-legacy", True), ("partial", False), ("sglang", False)],
)
async def test_only_vllms_dialects_show_lora_info(serve: Serve, dialect: str, shown: bool) -> None:
    params = EngineParams.zero_delay(lora_modules=["sql-lora"], metrics_dialect=dialect)
    client = await serve(create_engine_app(params, [MODEL]))
    assert bool(lora_series((await client.get("/metrics")).text)) is shown


async def test_cache_config_info_carries_the_blocks_the_scraper_reads(serve: Serve) -> None:
    params = EngineParams.zero_delay(block_size=32, num_gpu_blocks=1234, lora_modules=["a"])
    client = await serve(create_engine_app(params, [MODEL]))
    text = (await client.get("/metrics")).text
    [info] = [
        sample
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:cache_config_info"
        for sample in family.samples
    ]
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.value) == (
        "32",
        "1234",
        1.0,
    )
    sample = parse_engine_metrics(text)  # what the scraper makes of it, LoRA series and all
    assert sample is not None and (sample.block_size, sample.num_gpu_blocks) == (32, 1234)
