"""The `responses` section: the OpenAI Responses API's stored responses (docs/config.md)."""

from __future__ import annotations

from pydantic import Field

from llmgw.config.common import StrictModel
from llmgw.config.durations import PositiveDuration

# The APIs an OpenAI-compatible vLLM serves: a provider's `apis` unless it says otherwise.
DEFAULT_APIS = ("chat_completions", "completions", "embeddings", "responses")


class ResponsesConfig(StrictModel):
    # JetStream KV bucket of the responses the edge served with `store: true` (one entry per
    # response: owner, input items, output, usage), and how long an entry is kept (the bucket's
    # max age, set when the bucket is created).
    bucket: str = Field("llmgw_responses", pattern=r"^[A-Za-z0-9_-]+$")
    retention: PositiveDuration = 30 * 24 * 3600.0
