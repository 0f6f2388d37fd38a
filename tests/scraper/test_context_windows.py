"""The scraper reads each engine's context window where its dialect tells it (vLLM's and
SGLang's `GET /v1/models`, llama.cpp's `GET /props`, TGI's `GET /info`) and carries it in the
endpoint's report: the parsing (pure), then simulated engines of each dialect, the real scraper
and NATS."""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client as NatsClient
from scraper_helpers import EventLog, StartEngine, config_data, running_scraper

from llmgw.config import config_from_dict
from llmgw.core.context import ContextWindow
from llmgw.core.engine_metrics import EngineDialect
from llmgw.services.scraper.reports import Fetched, read_window, window_paths

# ---- parsing ---------------------------------------------------------------------------------


def _answer(body: object, status: int = 200) -> Fetched:
    return Fetched(status=status, body=json.dumps(body))


VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "meta-llama/Llama-3.3-70B", "object": "model", "max_model_len": 32768},
        # a LoRA adapter: vLLM lists no window of its own (its base model's holds)
        {"id": "sql-lora", "parent": "meta-llama/Llama-3.3-70B", "max_model_len": None},
    ],
}


def test_a_model_list_gives_the_window_of_the_models_the_endpoint_serves() -> None:
    window = read_window("/v1/models", _answer(VLLM_MODELS), {"meta-llama/Llama-3.3-70B"})
    assert window == ContextWindow(32768)
    # Served under names the list does not show: the list's windows still count.
    assert read_window("/v1/models", _answer(VLLM_MODELS), {"other"}) == ContextWindow(32768)
    several = {"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "context_length": 8192}]}
    assert read_window("/v1/models", _answer(several), {"a"}) == ContextWindow(4096)
    assert read_window("/v1/models", _answer(several), set()) == ContextWindow(8192)


def test_llama_cpp_props_give_a_slots_context_that_does_not_hold_the_output() -> None:
    props = {"default_generation_settings": {"n_ctx": 8192, "params": {}}, "total_slots": 4}
    assert read_window("/props", _answer(props), set()) == ContextWindow(8192, hold_output=False)


def test_tgi_info_gives_its_max_total_tokens() -> None:
    info = {"model_id": "m", "max_input_tokens": 4095, "max_total_tokens": 4096}
    assert read_window("/info", _answer(info), set()) == ContextWindow(4096)


@pytest.mark.parametrize(
    "fetched",
    [
        Fetched(status=404, body="{}"),
        Fetched(error="ConnectError"),
        Fetched(status=200, body="not json"),
        _answer([1, 2]),
        _answer({"data": [{"id": "m", "max_model_len": True}, {"id": "n"}]}),
        _answer({"data": "nope"}),
        _answer({"default_generation_settings": {"n_ctx": 0}}),
    ],
)
def test_an_answer_without_a_window_tells_none(fetched: Fetched) -> None:
    for path in ("/v1/models", "/props", "/info"):
        assert read_window(path, fetched, {"m"}) is None


def test_each_dialect_has_its_source_and_an_unknown_engine_tries_them_all() -> None:
    assert window_paths(EngineDialect.VLLM) == ("/v1/models",)
    assert window_paths(EngineDialect.SGLANG) == ("/v1/models",)
    assert window_paths(EngineDialect.LLAMACPP) == ("/props",)
    assert window_paths(EngineDialect.TGI) == ("/info",)
    assert window_paths(None) == ("/v1/models", "/props", "/info")


# ---- the scraper against simulated engines ---------------------------------------------------


async def test_the_scraper_reports_each_dialects_window(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    nats_client: NatsClient,
    start_engine: StartEngine,
    events: EventLog,
) -> None:
    windows = {"vllm": 2048, "sglang": 3072, "llamacpp": 4096, "tgi": 5120}
    engines = {
        dialect: await start_engine(metrics_dialect=dialect, max_model_len=size)
        for dialect, size in windows.items()
    }
    data = config_data(nats_url, load_bucket, unique_id, {d: e.url for d, e in engines.items()})
    data["endpoints"][0]["context_window"] = 1000  # the config's own: admission's, not the report's
    config = config_from_dict(data, env={})
    async with running_scraper(config, instance="scraper-windows"):
        for dialect, size in windows.items():
            report = await events.wait_for_report(dialect, lambda r: r.context_window is not None)
            assert report.context_window == size, dialect
            assert report.window_holds_output is (dialect != "llamacpp"), dialect
            assert report.sample is not None and report.sample.dialect.value == dialect
