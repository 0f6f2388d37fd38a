"""The official anthropic SDK against `llmgw up` with the shipped config/local.yaml, unchanged:
its engines serve the Messages API (passed through); with their provider declared chat-only,
the same calls are translated to chat completions and back."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from anthropic import Anthropic
from up_harness import UpProcess, llmgw_cli, write_cluster_config

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


NATS = r"^llmgw up: edge \S+, admin \S+, NATS (\S+)$"


def test_a_claude_code_session_whose_opening_changes_is_one_session_and_one_pin(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    """The user's case, through `llmgw up` with the shipped config: two Messages requests of
    one Claude Code session (its `x-claude-code-session-id`) with different openings, and a
    sub-agent of it: one session, one pin, on one engine; the sub-agent's pin names it."""
    up = start_up(cluster_config)
    base_url, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    claude = Anthropic(
        base_url=base_url,
        api_key=key,
        max_retries=0,
        default_headers={"x-claude-code-session-id": "2c7e-session"},
    )
    first = claude.messages.with_raw_response.create(
        model="llama",
        max_tokens=8,
        system="You are Claude Code.",
        messages=[{"role": "user", "content": "Fix the failing test."}],
    )
    second = claude.messages.with_raw_response.create(
        model="llama",
        max_tokens=8,
        system="This session is being continued from a previous conversation.",
        messages=[{"role": "user", "content": "Go on."}],
    )
    for _ in range(2):  # the sub-agent's second turn writes its pin to the bucket
        sub = claude.messages.with_raw_response.create(
            model="llama",
            max_tokens=8,
            system="You are an agent that explores a code base.",
            messages=[{"role": "user", "content": "Find the test."}],
            extra_headers={"x-claude-code-agent-id": "agent-explore-1"},
        )
    session = first.headers["x-llmgw-session"]
    assert second.headers["x-llmgw-session"] == session
    assert (second.headers["x-llmgw-route"], second.headers["x-llmgw-endpoint"]) == (
        "pinned",
        first.headers["x-llmgw-endpoint"],
    )
    assert sub.headers["x-llmgw-session"] != session
    expected = {session: None, sub.headers["x-llmgw-session"]: session}
    deadline = time.monotonic() + 20
    while True:  # the pins' writes to the bucket follow the decisions (never waited for)
        done = llmgw_cli(
            cluster_config,
            "state",
            "--json",
            "--session",
            "2c7e-session",
            env={"LLMGW_NATS__URL": nats_url},
        )
        assert done.returncode == 0, done.stderr
        pins = {p["session"]: p["parent"] for p in json.loads(done.stdout)["pins"]}
        if pins == expected or time.monotonic() > deadline:
            break
    assert pins == expected
