"""What an engine says about its own batch capacity: how many requests it runs at once.

Pure: the scraper fetches the dialect's paths (`CAPACITY_PATHS`, in order, the first that
answers 200) and passes the JSON body to `parse_capacity`. What each engine exposes, as read in
its source:

- SGLang: ``GET /server_info`` (``/get_server_info`` in older releases, kept as a deprecated
  alias in newer ones; ``python/sglang/srt/entrypoints/http_server.py``): the server arguments,
  the scheduler's info and ``internal_states``, one per data-parallel rank, each with
  ``effective_max_running_requests_per_dp`` (the scheduler's ``max_running_requests``). The
  capacity is their sum; a release without that field, its top-level ``max_running_requests``
  when set (None while SGLang sizes it itself);
- Text Generation Inference: ``GET /info`` (``router/src/lib.rs``, ``Info``):
  ``max_concurrent_requests``, the most it accepts at once (launcher default 128; past it TGI
  answers 429). Its batch may be smaller (a token budget, ``max_batch_total_tokens``): then its
  ``tgi_queue_size`` shows requests waiting, and the saturation detector counts what it runs;
- llama.cpp's ``llama-server``: ``GET /props`` (``tools/server``): ``total_slots`` (its
  ``--parallel``);
- vLLM: nothing. Its ``max_num_seqs`` is a scheduler setting: not among
  ``vllm:cache_config_info``'s labels (the cache config's fields), not in ``/v1/models`` (which
  gives ``max_model_len``); only the development-mode ``/server_info``
  (``VLLM_SERVER_DEV_MODE=1``, not for production) dumps the whole configuration. A vLLM
  endpoint's capacity is configured (``endpoints[].capacity``) or learned.

An answer without a usable figure (not JSON, not an object, a field missing, not a positive
integer) states nothing: None, never an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llmgw.core.engine_metrics import EngineDialect

__all__ = ["CAPACITY_PATHS", "parse_capacity"]

CAPACITY_PATHS: Mapping[EngineDialect, tuple[str, ...]] = {
    EngineDialect.SGLANG: ("/server_info", "/get_server_info"),
    EngineDialect.TGI: ("/info",),
    EngineDialect.LLAMACPP: ("/props",),
}


def _count(value: Any) -> int | None:
    """A positive integer (a JSON number with no fraction), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    return None


def parse_capacity(dialect: EngineDialect, body: str) -> int | None:
    """The batch capacity an engine of `dialect` states in `body` (its answer to one of the
    dialect's `CAPACITY_PATHS`); None when it states none."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    if dialect is EngineDialect.SGLANG:
        states = document.get("internal_states")
        if isinstance(states, list) and states:
            per_rank = [
                _count(s.get("effective_max_running_requests_per_dp"))
                if isinstance(s, dict)
                else None
                for s in states
            ]
            if all(n is not None for n in per_rank):
                return sum(n for n in per_rank if n is not None)
        return _count(document.get("max_running_requests"))
    if dialect is EngineDialect.TGI:
        return _count(document.get("max_concurrent_requests"))
    if dialect is EngineDialect.LLAMACPP:
        return _count(document.get("total_slots"))
    return None
