"""Composition roots: build an engine or provider simulator as an ASGI app (no I/O until served,
but for reading the tokenizer files an engine is given).

Each call builds independent state (model, KV cache, metrics registry, RNGs), so several
simulators can run in one process, e.g. in tests.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs

from llmgw.services.sim.asgi import (
    Receive,
    Scope,
    Send,
    install_crash_log_filter,
    send_bytes,
)
from llmgw.services.sim.engine_runtime import EngineBackend
from llmgw.services.sim.model_tokenizer import ModelTokenizer
from llmgw.services.sim.openai_app import AppHooks, Handler, SimApp
from llmgw.services.sim.params import EngineParams, ProviderParams
from llmgw.services.sim.provider_runtime import ProviderBackend

__all__ = ["DEFAULT_MODEL", "create_engine_app", "create_provider_app"]

DEFAULT_MODEL = "sim-model"


def _served(params_models: Sequence[str], models: Sequence[str] | None) -> list[str]:
    served = list(params_models) or list(models or []) or [DEFAULT_MODEL]
    return list(dict.fromkeys(served))  # unique, in order


def _adapter(module: str) -> tuple[str, str]:
    """``NAME=PATH`` (or ``NAME``) as vLLM's ``--lora-modules`` writes one adapter."""
    name, _, path = module.partition("=")
    return name.strip(), path.strip() or name.strip()


def create_engine_app(
    params: EngineParams,
    models: Sequence[str] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> SimApp:
    """A vLLM-like engine. Served names: ``params.served_models``, else `models`, else a default.

    `rng` (default: seeded with ``params.seed``) drives output lengths, generated text and, via a
    derived generator, fault draws. Besides the common routes it serves vLLM's
    ``POST /reset_prefix_cache``, where its metrics dialect's engine tells its context window and
    batch capacity that engine's routes (`_server_info`), and with ``kv_events_endpoint`` it publishes KV
    cache events from start-up to shutdown. With ``params.tokenizer`` its files are read here
    (TokenizerFilesError when unusable, ImportError without the ``tokenizer`` extra).
    """
    tokenizer = ModelTokenizer(params.tokenizer) if params.tokenizer is not None else None
    rng = rng if rng is not None else random.Random(params.seed)
    fault_rng = random.Random(rng.getrandbits(64))
    served = _served(params.served_models, models)
    backend = EngineBackend(params, served[0], clock=clock, rng=rng)
    install_crash_log_filter()
    return SimApp(
        backend,
        on_adapter_loaded=backend.enable_lora,
        kind="engine",
        models=served,
        adapters=dict(_adapter(module) for module in params.lora_modules),
        faults=params.faults(),
        embedding_dim=params.embedding_dim,
        max_model_len=params.max_model_len,
        fault_rng=fault_rng,
        responses_api=params.responses_api,
        messages_api=params.messages_api,
        hooks=AppHooks(
            routes={
                ("POST", "/reset_prefix_cache"): _reset_prefix_cache(backend),
                **_server_info(params, served[0]),
            },
            startup=backend.startup,
            shutdown=backend.aclose,
            faults_changed=backend.apply_faults,
        ),
        tokenizer=tokenizer,
    )


def _server_info(params: EngineParams, model: str) -> dict[tuple[str, str], Handler]:
    """Where the engine whose metrics dialect the simulator speaks tells its context window
    besides `GET /v1/models` (`max_model_len`, every dialect) and its batch capacity
    (``max_num_seqs``), with a few of their neighbouring fields (shapes as the gateway reads
    them: llmgw.services.scraper.reports.read_window, llmgw.core.engine_capacity):
    llama.cpp's ``GET /props`` (``default_generation_settings.n_ctx``, the context of one slot;
    ``total_slots``), TGI's ``GET /info`` (``max_input_tokens``, ``max_total_tokens``;
    ``max_concurrent_requests``: TGI refuses requests past it, the simulator queues them), and
    SGLang's ``GET /server_info`` and its older name ``GET /get_server_info``
    (``max_running_requests``, one ``internal_states`` entry with
    ``effective_max_running_requests_per_dp``: no data parallelism). vLLM states no capacity."""
    dialect = params.metrics_dialect
    slots = params.max_num_seqs
    paths: tuple[str, ...]
    if dialect == "llamacpp":
        paths, body = (
            ("/props",),
            {
                "default_generation_settings": {
                    "n_ctx": params.max_model_len,
                    "params": {"n_predict": -1, "temperature": 0.8},
                },
                "total_slots": slots,
                "model_alias": model,
                "model_path": model,
            },
        )
    elif dialect == "tgi":
        paths, body = (
            ("/info",),
            {
                "model_id": model,
                "max_concurrent_requests": slots,
                "max_input_tokens": params.max_model_len - 1,
                "max_total_tokens": params.max_model_len,
                "max_client_batch_size": 4,
                "router": "text-generation-router",
            },
        )
    elif dialect == "sglang":
        paths, body = (
            ("/server_info", "/get_server_info"),
            {
                "model_path": model,
                "max_running_requests": slots,
                "context_length": params.max_model_len,
                "dp_size": 1,
                "max_total_num_tokens": params.num_gpu_blocks * params.block_size,
                "internal_states": [{"effective_max_running_requests_per_dp": slots}],
                "version": "sim",
            },
        )
    else:
        return {}
    payload = json.dumps(body).encode()

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, payload, b"application/json")

    return {("GET", path): handle for path in paths}


def _reset_prefix_cache(backend: EngineBackend) -> Handler:
    """vLLM's route: 200 with an empty body whether or not the reset happened (vLLM does not
    check either; a reset is refused while requests run, unless ``reset_running_requests``)."""

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        flag = query.get("reset_running_requests", ["false"])[-1]
        backend.reset_prefix_cache(reset_running_requests=flag.lower() in _TRUE)
        await send_bytes(send, 200, b"", b"text/plain; charset=utf-8")

    return handle


_TRUE = frozenset({"1", "true", "yes", "on"})  # how FastAPI reads a true boolean query value


def create_provider_app(
    params: ProviderParams,
    models: Sequence[str] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> SimApp:
    """A third-party-API-like server; the drift schedule's time 0 is this call."""
    rng = rng if rng is not None else random.Random(params.seed)
    fault_rng = random.Random(rng.getrandbits(64))
    served = _served(params.served_models, models)
    backend = ProviderBackend(params, clock=clock, rng=rng)
    install_crash_log_filter()
    return SimApp(
        backend,
        kind="provider",
        models=served,
        faults=params.faults(),
        embedding_dim=params.embedding_dim,
        max_model_len=params.max_model_len,
        fault_rng=fault_rng,
        responses_api=params.responses_api,
        messages_api=params.messages_api,
    )
