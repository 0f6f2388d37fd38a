"""The Messages API request side (`llmgw.core.anthropic`): validation, sessions, translation.

Checked against recorded real payloads (tests/core/data/anthropic/README.md names them)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.anthropic import Untranslatable, opening, parse_messages_request, to_chat
from llmgw.core.requests import Feature, InvalidRequest
from llmgw.core.sessions import session_id

DATA = Path(__file__).parent / "data" / "anthropic"


def recorded(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def body(**fields) -> bytes:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({**base, **fields}).encode()


BAD = [
    pytest.param(b"[]", None, id="not-an-object"),
    pytest.param(json.dumps({"max_tokens": 1, "messages": []}).encode(), "model", id="no-model"),
    pytest.param(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(),
        "max_tokens",
        id="no-max-tokens",
    ),
    pytest.param(body(max_tokens=0), "max_tokens", id="max-tokens-zero"),
    pytest.param(body(messages=[]), "messages", id="no-messages"),
    pytest.param(body(messages=[{"role": "system", "content": "x"}]), "messages.0.role", id="role"),
    pytest.param(body(messages=[{"role": "user"}]), "messages.0.content", id="no-content"),
    pytest.param(
        body(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
        "messages.0.content.0.type",
        id="unknown-block-type",
    ),
    pytest.param(
        body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages.0.content.0.text",
        id="text-block-without-text",
    ),
    pytest.param(
        body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]),
        "messages.0.content.0",
        id="tool-use-without-name",
    ),
    pytest.param(
        body(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 3}]},
            ]
        ),
        "messages.0.content.0.tool_use_id",
        id="tool-result-without-id",
    ),
    pytest.param(body(temperature=1.5), "temperature", id="temperature-above-one"),
    pytest.param(body(stop_sequences="END"), "stop_sequences", id="stop-sequences-string"),
    pytest.param(body(metadata={"user_id": 7}), "metadata.user_id", id="user-id-not-string"),
    pytest.param(body(tools=[{"description": "x"}]), "tools.0.name", id="tool-without-name"),
    pytest.param(body(system=[{"type": "unknown"}]), "system.0.type", id="system-block-type"),
    pytest.param(body(cache_control="ephemeral"), "cache_control", id="cache-control-string"),
    pytest.param(
        body(system=[{"type": "text", "text": "s", "cache_control": {"ttl": "1h"}}]),
        "system.0.cache_control",
        id="cache-control-without-type",
    ),
    pytest.param(
        body(tools=[{"name": "t", "cache_control": {"type": "ephemeral", "ttl": 3600}}]),
        "tools.0.cache_control",
        id="cache-control-ttl-not-a-string",
    ),
    pytest.param(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "text", "text": "x", "cache_control": []}],
                        }
                    ],
                }
            ]
        ),
        "messages.0.content.0.content.0.cache_control",
        id="cache-control-of-a-nested-block",
    ),
]


@pytest.mark.parametrize(("raw", "param"), BAD)
def test_malformed_requests_are_refused_naming_the_field(raw, param):
    with pytest.raises(InvalidRequest) as caught:
        parse_messages_request(raw)
    assert caught.value.param == param


def test_the_recorded_tool_result_request_parses_as_a_messages_request():
    parsed = parse_messages_request(
        json.dumps(recorded("anthropic_request_tool_result.json")).encode()
    )
    assert parsed.feature is Feature.MESSAGES
    assert parsed.model == "claude-opus-4-1-20250805" and not parsed.stream


def test_the_recorded_tool_result_request_translates_to_chat_completions():
    chat = to_chat(recorded("anthropic_request_tool_result.json"), "upstream-model")
    assert chat["model"] == "upstream-model" and chat["max_tokens"] == 1024
    user, assistant, tool = chat["messages"]
    assert user == {"role": "user", "content": "What is the weather like in San Francisco?"}
    assert assistant["role"] == "assistant" and assistant["content"].startswith("<thinking>")
    (call,) = assistant["tool_calls"]
    assert call["id"] == "toolu_01A09q90qw90lq917835lq9" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {
        "location": "San Francisco, CA",
        "unit": "celsius",
    }
    assert tool == {
        "role": "tool",
        "tool_call_id": "toolu_01A09q90qw90lq917835lq9",
        "content": "15 degrees",
    }
    (function_tool,) = chat["tools"]
    assert function_tool["type"] == "function"
    assert function_tool["function"]["name"] == "get_weather"
    assert function_tool["function"]["parameters"]["required"] == ["location"]
    assert "stream" not in chat


def test_system_stop_sequences_tool_choice_images_and_streams_translate():
    request = json.loads(
        body(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            stop_sequences=["END"],
            temperature=0.2,
            tools=[{"name": "t", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stream=True,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAA"},
                        },
                    ],
                }
            ],
        )
    )
    chat = to_chat(request, "m")
    assert chat["messages"][0] == {"role": "system", "content": "Be brief.Be kind."}
    parts = chat["messages"][1]["content"]
    assert parts[1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}
    assert chat["stop"] == ["END"] and chat["temperature"] == 0.2
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


UNTRANSLATABLE = [
    pytest.param(
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, id="server-tool"
    ),
    pytest.param({"thinking": {"type": "enabled", "budget_tokens": 1024}}, id="thinking"),
    pytest.param({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, id="mcp"),
    pytest.param(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "document", "source": {"type": "text", "data": "x"}},
                    ],
                }
            ]
        },
        id="document-block",
    ),
]


@pytest.mark.parametrize("fields", UNTRANSLATABLE)
def test_what_chat_completions_cannot_express_is_refused_when_translating(fields):
    parsed = parse_messages_request(body(**fields))  # valid Messages input
    with pytest.raises(Untranslatable):
        to_chat(parsed.body, "m")


def test_thinking_disabled_and_earlier_thinking_blocks_are_fine():
    request = json.loads(
        body(
            thinking={"type": "disabled"},
            messages=[
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "b"},
                    ],
                },
                {"role": "user", "content": "c"},
            ],
        )
    )
    assert to_chat(request, "m")["messages"][1] == {"role": "assistant", "content": "b"}


# -- prompt caching (cache_control) ---------------------------------------------------------------

ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE_MINUTES = {"type": "ephemeral"}


def without_cache_control(value):
    """`value` with every `cache_control` key left out, at any depth."""
    if isinstance(value, dict):
        return {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_control(item) for item in value]
    return value


CACHED_AGENT_TURN = {
    "model": "m",
    "max_tokens": 16,
    "cache_control": FIVE_MINUTES,  # top level: the last cacheable block
    "system": [
        {"type": "text", "text": "You are an agent.", "cache_control": ONE_HOUR},
        {"type": "text", "text": "Project notes.", "cache_control": FIVE_MINUTES},
    ],
    "tools": [
        {
            "name": "Read",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            "cache_control": ONE_HOUR,
        }
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Read a.txt", "cache_control": FIVE_MINUTES},
                {
                    "type": "image",
                    "source": {"type": "url", "url": "https://example.com/a.png"},
                    "cache_control": FIVE_MINUTES,
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading.", "cache_control": FIVE_MINUTES},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "Read",
                    "input": {"path": "a.txt"},
                    "cache_control": FIVE_MINUTES,
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "alpha", "cache_control": ONE_HOUR}],
                    "cache_control": ONE_HOUR,
                },
                {"type": "text", "text": "Summarize it.", "cache_control": ONE_HOUR},
            ],
        },
    ],
}


def test_cache_control_with_its_ttl_is_valid_messages_input_everywhere_anthropic_takes_it():
    parsed = parse_messages_request(json.dumps(CACHED_AGENT_TURN).encode())
    assert parsed.body == CACHED_AGENT_TURN  # kept as sent: a native provider gets it all


def test_cache_control_is_left_out_of_the_chat_translation_which_is_that_of_the_unmarked_turn():
    chat = to_chat(CACHED_AGENT_TURN, "upstream")
    assert "cache_control" not in json.dumps(chat) and "ttl" not in json.dumps(chat)
    assert chat == to_chat(without_cache_control(CACHED_AGENT_TURN), "upstream")
    system, user, assistant, tool, question = chat["messages"]
    assert system == {"role": "system", "content": "You are an agent.Project notes."}
    assert user["content"] == [
        {"type": "text", "text": "Read a.txt"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    assert assistant["content"] == "Reading." and assistant["tool_calls"][0]["id"] == "toolu_1"
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "alpha"}
    assert question == {"role": "user", "content": "Summarize it."}
    assert set(chat["tools"][0]["function"]) == {"name", "description", "parameters"}


def test_a_breakpoint_moved_from_turn_to_turn_keeps_the_conversation_one_session():
    """An agent marks its latest message: the opening carries the mark in the first turn and
    not in the next; both are one session (as without marks)."""
    first = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "sys", "cache_control": ONE_HOUR}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello", "cache_control": FIVE_MINUTES}],
            }
        ],
    }
    second = {
        **first,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            {"role": "assistant", "content": "hi"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "more", "cache_control": FIVE_MINUTES}],
            },
        ],
    }
    assert session(first) == session(second) == session(without_cache_control(first))
    assert session(first) is not None


def session(request: dict, header: str | None = None) -> str | None:
    return session_id(Feature.CHAT, "m", opening(request), header_key=header)


def test_every_turn_of_a_conversation_has_the_session_of_its_opening():
    first = json.loads(body(system="sys", messages=[{"role": "user", "content": "hello"}]))
    later = json.loads(
        body(
            system="sys",
            messages=[
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "and now?"},
            ],
        )
    )
    other = json.loads(body(system="other", messages=[{"role": "user", "content": "hello"}]))
    assert session(first) == session(later) is not None
    assert session(other) != session(first)


def test_metadata_user_id_then_the_session_header_name_the_session():
    one = json.loads(body(metadata={"user_id": "u-1"}))
    two = json.loads(body(metadata={"user_id": "u-1"}, system="different opening"))
    assert session(one) == session(two) != session(json.loads(body()))
    assert session(one, header="conv-9") != session(one)


@given(st.text(min_size=1), st.text(min_size=1))
def test_a_messages_session_is_the_chat_session_of_the_same_conversation(system, question):
    chat = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]
    }
    messages = {"system": system, "messages": [{"role": "user", "content": question}]}
    assert session(messages) == session_id(Feature.CHAT, "m", chat)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "text", "role", "content", "id", "name", "input", "source"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_TEXT = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=6))
_IMAGE = st.builds(
    lambda source: {"type": "image", "source": source},
    st.sampled_from(
        [
            {"type": "base64", "media_type": "image/png", "data": "AAA"},
            {"type": "url", "url": "https://example.com/a.png"},
            {"type": "file", "file_id": "f"},
        ]
    )
    | _JSON,
)
_BLOCK = st.one_of(
    _TEXT,
    _IMAGE,
    st.builds(
        lambda i, n, a: {"type": "tool_use", "id": i, "name": n, "input": a},
        st.text(max_size=4),
        st.text(max_size=4),
        st.dictionaries(st.text(max_size=3), _JSON, max_size=2),
    ),
    st.builds(
        lambda i, c, e: {"type": "tool_result", "tool_use_id": i, "content": c, "is_error": e},
        st.text(max_size=4),
        st.none() | st.text(max_size=4) | st.lists(_TEXT | _IMAGE, max_size=2),
        st.booleans(),
    ),
    st.just({"type": "thinking", "thinking": "hm", "signature": "s"}),
    st.just({"type": "document", "source": {"type": "text", "data": "x"}}),
    st.dictionaries(st.sampled_from(["type", "text", "id"]), _JSON, max_size=3),  # junk
)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "user", "assistant", "system"]),
        "content": st.one_of(st.text(max_size=5), st.lists(_BLOCK, max_size=3), _JSON),
    }
)
_TOOL = st.fixed_dictionaries(
    {"name": st.text(max_size=4)},
    optional={
        "type": st.sampled_from(["custom", "web_search_20250305", "bash_20250124"]),
        "description": st.text(max_size=4) | _JSON,
        "input_schema": st.just({"type": "object"}) | _JSON,
    },
)
_REQUEST = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["m", "m", "m", "", 3]),
        "max_tokens": st.integers(min_value=1, max_value=64) | st.sampled_from([0, "8"]),
        "messages": st.lists(_MESSAGE, min_size=1, max_size=4) | _JSON,
    },
    optional={
        "system": st.one_of(st.text(max_size=5), st.lists(_TEXT, max_size=2), _JSON),
        "tools": st.lists(_TOOL, max_size=2) | _JSON,
        "tool_choice": st.sampled_from(
            [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "t"}, {"type": "?"}]
        )
        | _JSON,
        "thinking": st.sampled_from([{"type": "disabled"}, {"type": "enabled"}]) | _JSON,
        "metadata": st.just({"user_id": "u"}) | _JSON,
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | _JSON,
        "temperature": st.floats(min_value=0, max_value=1) | _JSON,
        "stream": st.booleans() | _JSON,
    },
)


@settings(max_examples=500)
@given(_REQUEST)
def test_any_body_is_a_request_or_a_400_and_a_request_is_chat_or_a_400(request):
    """Whatever a client sends: parsing raises nothing but InvalidRequest, and a request that
    parsed translates to chat completions or raises nothing but Untranslatable (or, for a
    tool_choice of no known type, InvalidRequest): never a 500."""
    try:
        parsed = parse_messages_request(json.dumps(request).encode())
    except InvalidRequest:
        return
    session_id(Feature.CHAT, "m", opening(parsed.body))  # a session, or none (no user message)
    try:
        chat = to_chat(parsed.body, "upstream")
    except InvalidRequest:  # Untranslatable is one
        return
    json.dumps(chat)  # a body that can be sent
    assert chat["messages"] and all(
        m["role"] in ("system", "user", "assistant", "tool") for m in chat["messages"]
    )
