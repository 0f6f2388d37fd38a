"""The Messages API answer side (`llmgw.core.anthropic_chat`), checked against recorded real
payloads (tests/core/data/anthropic/README.md) and read back by the official anthropic SDK."""

import json
from pathlib import Path

import pytest
from anthropic import AsyncAnthropic
from anthropic.types import Message
from hypothesis import given
from hypothesis import strategies as st
from sse_app import FixedStream

from llmgw.core.anthropic_chat import (
    ChatToMessages,
    MessagesStreamReader,
    message_from_chat,
    messages_usage_in,
    reshape_error,
)
from llmgw.core.usage import Usage
from llmgw.serving import start_server

DATA = Path(__file__).parent / "data" / "anthropic"
TOOL_STREAM = (DATA / "openai_chat_stream_tool_calls.txt").read_bytes()
TEXT_STREAM = (DATA / "openai_chat_stream_text.txt").read_bytes()


async def sdk_final_message(events: bytes) -> Message:
    """What the official SDK's `messages.stream` makes of these bytes, served over HTTP."""
    server = await start_server(FixedStream(events))
    try:
        client = AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0)
        async with client.messages.stream(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        ) as stream:
            return await stream.get_final_message()
    finally:
        await server.stop()


def translated(stream: bytes, cuts: list[int] = ()) -> tuple[bytes, ChatToMessages]:
    events = ChatToMessages("gpt-4o")
    out, last = b"", 0
    for cut in sorted(cuts):
        out += events.feed(stream[last:cut])
        last = cut
    out += events.feed(stream[last:]) + events.finish()
    return out, events


def test_a_recorded_whole_chat_completion_with_two_tool_calls_is_a_message():
    body, usage = message_from_chat((DATA / "openai_chat_tool_calls.json").read_bytes(), "gpt-4o")
    message = Message.model_validate_json(body)
    assert message.stop_reason == "tool_use" and message.model == "gpt-4o"
    weather, stock = message.content
    assert weather.type == "tool_use" and weather.id == "call_fdNz3vOBKYgOIpMdWotB9MjY"
    assert weather.input == {"city": "Edinburgh", "country": "GB", "units": "c"}
    assert stock.name == "get_stock_price" and stock.input == {
        "ticker": "AAPL",
        "exchange": "NASDAQ",
    }
    assert (message.usage.input_tokens, message.usage.output_tokens) == (149, 60)
    assert usage == Usage(149, 60)


def test_a_recorded_whole_text_completion_is_a_message():
    body, usage = message_from_chat((DATA / "openai_chat_text.json").read_bytes(), "gpt-4o")
    message = Message.model_validate_json(body)
    assert message.stop_reason == "end_turn" and message.content[0].type == "text"
    assert message.content[0].text.startswith("I'm unable to provide real-time weather")
    assert usage == Usage(14, 37)


async def test_a_recorded_tool_call_stream_is_read_by_the_sdk_as_two_tool_uses():
    events, translator = translated(TOOL_STREAM)
    message = await sdk_final_message(events)
    assert message.stop_reason == "tool_use"
    weather, stock = message.content
    assert (weather.id, weather.name) == ("call_lQnnsesjFMWMQ5IeWPHzR4th", "GetWeatherArgs")
    assert weather.input == {"city": "Edinburgh", "country": "UK", "units": "c"}
    assert (stock.id, stock.input) == (
        "call_2xjOUgaCdiwAcl9ZBL9LyMUU",
        {"ticker": "AAPL", "exchange": "NASDAQ"},
    )
    assert (message.usage.input_tokens, message.usage.output_tokens) == (149, 60)
    assert translator.usage == Usage(149, 60)


async def test_a_recorded_text_stream_is_read_by_the_sdk_as_its_text():
    events, _ = translated(TEXT_STREAM)
    message = await sdk_final_message(events)
    expected = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in TEXT_STREAM.decode().split("\n\n")
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    assert message.content[0].text == expected and expected
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (14, 47)
    kinds = [e.split("\n")[0] for e in events.decode().split("\n\n") if e]
    assert kinds[:3] == ["event: message_start", "event: ping", "event: content_block_start"]
    assert kinds[-3:] == [
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]


@given(st.lists(st.integers(min_value=0, max_value=len(TOOL_STREAM)), max_size=12))
def test_the_translation_does_not_depend_on_where_the_chunks_split(cuts):
    assert translated(TOOL_STREAM, cuts)[0] == translated(TOOL_STREAM)[0]


def test_an_error_event_of_the_upstream_becomes_an_anthropic_error_event():
    stream = TEXT_STREAM.split(b"\n\n")[1] + b"\n\n"
    stream += b'data: {"error": {"message": "engine died", "code": "upstream_broken_stream"}}\n\n'
    events, _ = translated(stream)
    last = events.decode().strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    assert json.loads(last.split("data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "engine died"},
    }


def test_a_stream_cut_before_done_never_says_message_stop():
    events, _ = translated(TOOL_STREAM[: TOOL_STREAM.index(b"data: [DONE]")])
    assert b"message_stop" not in events


def test_a_translated_stream_counts_the_chat_streams_data_events_wherever_it_is_cut():
    stream = (DATA / "openai_chat_stream_text.txt").read_bytes()
    for cuts in ([], [5, 40, 41, 300], list(range(0, len(stream), 9))):
        _, events = translated(stream, cuts)
        assert events.events == stream.count(b"data:") > 0  # billed on them if cut short


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("anthropic_stream_text.txt", Usage(11, 6)),
        ("anthropic_stream_tool_use.txt", Usage(377, 65)),
    ],
)
def test_a_passed_through_stream_is_read_for_usage_and_end_unchanged(name, usage):
    stream = (DATA / name).read_bytes()
    reader = MessagesStreamReader()
    out = b"".join(reader.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
    out += reader.finish()
    assert out == stream and reader.usage == usage and reader.completed
    # Its output events, counted for a stream cut short (billed on them): the deltas.
    assert reader.events == stream.count(b"event: content_block_delta") > 0
    cut = MessagesStreamReader()
    cut.feed(stream[: stream.index(b"event: message_stop")])
    cut.finish()
    assert not cut.completed and cut.events == reader.events


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_openai_shaped_errors_are_reshaped_by_status(status, kind):
    body = json.dumps({"error": {"message": "why", "type": "x", "code": "y", "param": None}})
    assert json.loads(reshape_error(body.encode(), status)) == {
        "type": "error",
        "error": {"type": kind, "message": "why"},
    }


def test_anthropic_shaped_errors_are_kept():
    body = b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}'
    assert reshape_error(body, 529) == body


def test_the_usage_of_a_whole_messages_response_is_read_without_decoding_all_of_it():
    body = json.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "content": [{"type": "text", "text": 'a quoted "usage": {"input_tokens": 1}'}],
            "usage": {"input_tokens": 25, "output_tokens": 7, "cache_read_input_tokens": 0},
        }
    ).encode()
    assert messages_usage_in(body) == Usage(25, 7)
    assert messages_usage_in(b'{"type": "message"}') is None


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "delta",
                    "message",
                    "content",
                    "tool_calls",
                    "function",
                    "arguments",
                    "index",
                    "id",
                    "name",
                    "finish_reason",
                    "usage",
                    "prompt_tokens",
                    "error",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=16,
)


@given(st.lists(_ANY, max_size=5))
def test_whatever_json_an_upstream_streams_the_translation_does_not_fail(values):
    stream = b"".join(b"data: " + json.dumps(v).encode() + b"\n\n" for v in values)
    translated(stream + b"data: [DONE]\n\n")


_KINDS = st.sampled_from(["message_start", "message_delta", "message_stop"])


@given(st.lists(st.tuples(_KINDS, _ANY, _ANY), max_size=5))
def test_whatever_json_a_passed_through_stream_carries_the_reader_does_not_fail(events):
    reader = MessagesStreamReader()
    for kind, message, usage in events:
        payload = {"type": kind, "message": message, "usage": usage}
        reader.feed(b"data: " + json.dumps(payload).encode() + b"\n\n")
    reader.finish()


@given(_ANY)
def test_whatever_json_an_upstream_answers_is_a_message_or_a_value_error(value):
    try:
        body, _ = message_from_chat(json.dumps(value).encode(), "m")
    except ValueError:
        return
    Message.model_validate_json(body)


async def test_tool_calls_without_an_index_are_told_apart_by_their_ids():
    """Some chat servers send each call whole, without `index`: two calls, two tool_use blocks."""

    def call(call_id: str, name: str, n: int) -> dict:
        function = {"name": name, "arguments": json.dumps({"q": n})}
        return {"id": call_id, "type": "function", "function": function}

    chunks = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [call("call_a", "search", 1)]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [call("call_b", "fetch", 2)]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    message = await sdk_final_message(translated(stream + b"data: [DONE]\n\n")[0])
    assert [(b.id, b.name, b.input) for b in message.content] == [
        ("call_a", "search", {"q": 1}),
        ("call_b", "fetch", {"q": 2}),
    ]


# -- cached prompt tokens, by Anthropic's convention ------------------------------------------------

CACHED_USAGE = {
    "prompt_tokens": 1200,
    "completion_tokens": 5,
    "total_tokens": 1205,
    "prompt_tokens_details": {"cached_tokens": 1024},
}
CACHED_COMPLETION = {
    "id": "chatcmpl-c",
    "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": CACHED_USAGE,
}


def cached_chat_stream() -> bytes:
    chunk = {"id": "chatcmpl-c", "object": "chat.completion.chunk"}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**chunk, "choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**chunk, "choices": [], "usage": CACHED_USAGE},
    ]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def test_a_chat_completions_cached_tokens_are_cache_reads_left_out_of_input_tokens():
    body, usage = message_from_chat(json.dumps(CACHED_COMPLETION).encode(), "m")
    message = Message.model_validate_json(body)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (176, 1024)
    assert usage == Usage(1200, 5, 1024)  # the prompt, of which 1024 cached: what is priced
    assert messages_usage_in(body) == usage  # read back as a passed-through answer is


async def test_a_translated_streams_cached_tokens_reach_the_sdk_as_cache_reads():
    events, translator = translated(cached_chat_stream())
    message = await sdk_final_message(events)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (176, 1024)
    assert message.usage.output_tokens == 5
    assert translator.usage == Usage(1200, 5, 1024)
    reader = MessagesStreamReader()  # the same bytes passed through (an engine's own API)
    reader.feed(events)
    reader.finish()
    assert reader.usage == Usage(1200, 5, 1024) and reader.completed


def test_a_chat_completion_without_cached_tokens_has_no_cache_reads():
    body, usage = message_from_chat((DATA / "openai_chat_text.json").read_bytes(), "m")
    assert "cache_read_input_tokens" not in json.loads(body)["usage"]
    assert usage == Usage(14, 37, 0)


def anthropic_stream(start_usage: dict, delta_usage: dict) -> bytes:
    def event(name: str, data: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    return b"".join(
        [
            event(
                "message_start",
                {"type": "message_start", "message": {**message, "usage": start_usage}},
            ),
            event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "hi"},
                },
            ),
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": delta_usage,
                },
            ),
            event("message_stop", {"type": "message_stop"}),
        ]
    )


@pytest.mark.parametrize(
    ("start", "delta", "usage"),
    [
        pytest.param(
            {
                "input_tokens": 12,
                "cache_read_input_tokens": 900,
                "cache_creation_input_tokens": 100,
                "output_tokens": 1,
            },
            {"output_tokens": 6},
            Usage(1012, 6, 900),
            id="counts-of-message-start",
        ),
        pytest.param(
            {"input_tokens": 0, "output_tokens": 0},
            {"input_tokens": 176, "cache_read_input_tokens": 1024, "output_tokens": 5},
            Usage(1200, 5, 1024),
            id="cumulative-counts-of-message-delta",
        ),
        pytest.param(
            {"input_tokens": 30, "cache_read_input_tokens": 70, "output_tokens": 1},
            {"output_tokens": 4, "input_tokens": None, "cache_read_input_tokens": None},
            Usage(100, 4, 70),
            id="null-counts-keep-message-starts",
        ),
    ],
)
def test_a_passed_through_streams_prompt_is_input_plus_cache_reads_and_writes(start, delta, usage):
    reader = MessagesStreamReader()
    stream = anthropic_stream(start, delta)
    out = b"".join(reader.feed(stream[i : i + 5]) for i in range(0, len(stream), 5))
    assert out + reader.finish() == stream and reader.usage == usage
