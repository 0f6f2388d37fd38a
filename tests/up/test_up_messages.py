"""The official anthropic SDK against `llmgw up` with the shipped config/local.yaml, unchanged:
its engines serve the Messages API (passed through); with their provider declared chat-only,
the same calls are translated to chat completions and back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from anthropic import Anthropic
from up_harness import UpProcess, write_cluster_config

pytestmark = pytest.mark.e2e

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+)/v1, API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)
# Anthropic's tool-use example: a turn returning a tool result (tests/core/data/anthropic)
RECORDED = json.loads(
    (
        Path(__file__).parent.parent / "core/data/anthropic/anthropic_request_tool_result.json"
    ).read_text()
)


def _sdk_calls(base_url: str, key: str) -> str:
    """create, stream and a tool-result turn with the SDK as it is; the provider that served."""
    client = Anthropic(base_url=base_url, api_key=key, max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="llama",
        max_tokens=8,
        system="You are terse.",
        metadata={"user_id": "e2e-user"},
        messages=[{"role": "user", "content": "Hello!"}],
    )
    message = raw.parse()
    assert message.type == "message" and message.content[0].text
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    with client.messages.stream(
        model="qwen", max_tokens=8, messages=[{"role": "user", "content": "Stream it"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and text == final.content[0].text and final.usage.output_tokens > 0
    turn = client.messages.create(
        model="llama", max_tokens=8, tools=RECORDED["tools"], messages=RECORDED["messages"]
    )
    assert turn.content and turn.stop_reason in ("end_turn", "max_tokens")
    return raw.headers["x-llmgw-provider"]


def test_the_sdk_against_llmgw_up_passes_through_to_engines_serving_messages(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config)
    base_url, key = up.wait_for(READY, timeout=90).groups()
    assert _sdk_calls(base_url, key) == "iris"


def test_the_sdk_against_llmgw_up_is_translated_for_chat_only_engines(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml")
    data = yaml.safe_load(config.read_text())
    data["providers"][0]["apis"] = ["chat_completions", "completions", "embeddings"]
    for endpoint in data["endpoints"]:  # a request passed through would get a 404 here
        endpoint["simulate"]["messages_api"] = False
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    up = start_up(config)
    base_url, key = up.wait_for(READY, timeout=90).groups()
    assert _sdk_calls(base_url, key) == "iris"
