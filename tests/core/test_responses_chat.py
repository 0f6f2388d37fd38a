"""Responses API <-> chat completions, checked against payloads recorded from OpenAI's API
(tests/core/data/responses) and against the openai SDK's own types of the Responses API."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from llmgw.core.responses import Turn, as_input
from llmgw.core.responses_chat import (
    Untranslatable,
    chat_messages,
    chat_request,
    response_from_chat,
)
from llmgw.core.responses_chat_stream import ChatToResponsesStream, delta_event

DATA = Path(__file__).parent / "data" / "responses"
TEXT_STREAM = (DATA / "chat_text_stream.sse").read_bytes()
TOOLS_STREAM = (DATA / "chat_tool_calls_stream.sse").read_bytes()
TOOLS_COMPLETION = json.loads((DATA / "chat_tool_calls.json").read_text())
RESPONSE_ID = "resp_" + "1" * 32
TURN = Turn(({"type": "message", "role": "user", "content": "hi"},), None, True, None)
BODY = {"model": "gpt-4o", "input": "hi"}
EVENTS = TypeAdapter(ResponseStreamEvent)


def translate(stream: bytes, cuts: list[int]) -> tuple[ChatToResponsesStream, bytes]:
    reader = ChatToResponsesStream(BODY, RESPONSE_ID, TURN, clock=lambda: 0.0)
    out, start = [], 0
    for cut in [*sorted(cuts), len(stream)]:
        out.append(reader.feed(stream[start:cut]))
        start = cut
    out.append(reader.finish())
    return reader, b"".join(out)


def events_of(sse: bytes) -> list:
    events = []
    for block in sse.decode().split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n", 1)
        event = EVENTS.validate_json(data.removeprefix("data: "))  # the SDK's own types
        assert name == f"event: {event.type}"
        events.append(event)
    return events


def test_a_recorded_text_stream_becomes_the_typed_events_with_text_and_usage():
    reader, out = translate(TEXT_STREAM, [])
    # The chat stream's data events, counted for a stream cut short (billed on them).
    assert reader.events == TEXT_STREAM.count(b"data:") > 0
    events = events_of(out)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    text = "".join(deltas)
    assert len(deltas) == 47 and text.startswith("I'm unable to provide real-time updates")
    completed = events[-1].response
    assert completed.id == RESPONSE_ID and completed.status == "completed"
    assert completed.output_text == text
    assert (completed.usage.input_tokens, completed.usage.output_tokens) == (14, 47)
    assert reader.completed and reader.usage.output_tokens == 47


def test_a_recorded_stream_of_two_parallel_tool_calls_becomes_two_function_call_items():
    _, out = translate(TOOLS_STREAM, [])
    events = events_of(out)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.call_id, i.name) for i in added] == [
        ("function_call", "call_lQnnsesjFMWMQ5IeWPHzR4th", "GetWeatherArgs"),
        ("function_call", "call_2xjOUgaCdiwAcl9ZBL9LyMUU", "get_stock_price"),
    ]
    done = {e.item_id: e.arguments for e in events if e.type.endswith("arguments.done")}
    assert [json.loads(a) for a in done.values()] == [
        {"city": "Edinburgh", "country": "UK", "units": "c"},
        {"ticker": "AAPL", "exchange": "NASDAQ"},
    ]
    final = events[-1].response
    assert final.status == "completed"
    assert [item.arguments for item in final.output] == list(done.values())
    assert (final.usage.input_tokens, final.usage.output_tokens) == (149, 60)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_translation_does_not_depend_on_where_the_stream_is_cut(data):
    stream = data.draw(st.sampled_from([TEXT_STREAM, TOOLS_STREAM]))
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    assert translate(stream, cuts)[1] == translate(stream, [])[1]


def test_a_recorded_completion_with_tool_calls_round_trips_through_the_responses_shape():
    response = response_from_chat(TOOLS_COMPLETION, BODY, RESPONSE_ID, TURN)
    parsed = Response.model_validate(response)  # the SDK's own type of a response
    assert [(o.type, o.call_id, o.name) for o in parsed.output] == [
        ("function_call", "call_fdNz3vOBKYgOIpMdWotB9MjY", "GetWeatherArgs"),
        ("function_call", "call_h1DWI1POMJLb0KwIyQHWXD4p", "get_stock_price"),
    ]
    assert parsed.usage.input_tokens == 149 and parsed.usage.output_tokens == 60
    # The next turn sends the calls back as input; as chat messages they are the recorded
    # assistant message's tool calls again, followed by the function outputs.
    outputs = [
        {"type": "function_call_output", "call_id": o.call_id, "output": "42"}
        for o in parsed.output
    ]
    messages = chat_messages(None, [*as_input(response["output"]), *outputs])
    recorded = TOOLS_COMPLETION["choices"][0]["message"]
    assert messages[0] == {
        "role": "assistant",
        "content": None,
        "tool_calls": recorded["tool_calls"],
    }
    assert messages[1:] == [
        {"role": "tool", "tool_call_id": call["id"], "content": "42"}
        for call in recorded["tool_calls"]
    ]


def test_a_length_stop_is_an_incomplete_response():
    completion = {
        "choices": [{"message": {"content": "cut"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    response = Response.model_validate(response_from_chat(completion, BODY, RESPONSE_ID, TURN))
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "cut"


def test_a_responses_request_becomes_the_chat_request_of_the_same_conversation():
    body = {
        "model": "gpt-4o",
        "instructions": "Be terse.",
        "max_output_tokens": 50,
        "temperature": 0.2,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            }
        ],
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {}, "strict": True}},
        "include": ["reasoning.encrypted_content"],  # extra output chat has none of: ignored
    }
    items = [
        {"type": "message", "role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in "},
                {"type": "input_image", "image_url": "https://example.com/a.png"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    chat = chat_request(body, items, "upstream-name", stream=True)
    assert chat["model"] == "upstream-name"
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "system", "content": "Use tools."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in "},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_completion_tokens"] == 50 and chat["temperature"] == 0.2
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {}, "strict": True},
    }
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "include" not in chat


@pytest.mark.parametrize(
    ("body", "items", "param"),
    [
        (
            {},
            [{"type": "message", "role": "user", "content": [{"type": "input_file"}]}],
            "input[0].content[0].type",
        ),
        ({"truncation": "auto"}, [], "truncation"),
        ({"tool_choice": {"type": "web_search"}}, [], "tool_choice"),
    ],
    ids=["file-part", "truncation", "built-in-tool-choice"],
)
def test_what_chat_completions_cannot_express_is_refused_naming_it(body, items, param):
    with pytest.raises(Untranslatable) as caught:
        chat_request({"model": "m", **body}, items, "m", stream=False)
    assert caught.value.param == param


def _chat_stream(pieces: list[tuple[str, int, str]], finish: str) -> bytes:
    """A chat completions stream of text pieces ('text', _, s) and tool call argument pieces
    ('call', index, s): each call's first piece names it."""
    chunks, named = [], set()
    for kind, index, text in pieces:
        if kind == "text":
            delta = {"content": text}
        else:
            call = {"index": index, "function": {"arguments": text}}
            if index not in named:
                named.add(index)
                call.update({"id": f"call_{index}", "type": "function"})
                call["function"]["name"] = f"f{index}"
            delta = {"tool_calls": [call]}
        chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return body.encode()


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.tuples(st.just("text"), st.just(0), st.text(min_size=1, max_size=8)),
            st.tuples(st.just("call"), st.integers(0, 2), st.text(min_size=1, max_size=8)),
        ),
        min_size=1,
        max_size=30,
    ),
    finish=st.sampled_from(["stop", "length", "tool_calls"]),
)
def test_any_chat_stream_becomes_events_whose_deltas_add_up_to_the_final_response(pieces, finish):
    reader, out = translate(_chat_stream(pieces, finish), [])
    events = events_of(out)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == (
        "response.incomplete" if finish == "length" else "response.completed"
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "".join(s for kind, _, s in pieces if kind == "text")
    assert final.output_text == text
    calls = {o.call_id: o.arguments for o in final.output if o.type == "function_call"}
    for index in {i for kind, i, _ in pieces if kind == "call"}:
        assert calls[f"call_{index}"] == "".join(
            s for kind, i, s in pieces if kind == "call" and i == index
        )
    assert reader.usage.input_tokens == 5 and reader.usage.output_tokens == 7


@given(
    text=st.text(),
    sequence=st.integers(min_value=0, max_value=10**9),
    index=st.integers(min_value=0, max_value=1000),
    item=st.text(min_size=1),
)
def test_the_templated_text_delta_is_the_generic_event_byte_for_byte(text, sequence, index, item):
    """The per-token delta event is written from a template; it is what the generic encoder
    writes for the same fields, whatever the text (quotes, control characters, non-ASCII)."""
    fields = {"item_id": item, "output_index": index, "content_index": 0, "delta": text}
    kind = "response.output_text.delta"
    payload = {"type": kind, "sequence_number": sequence, **fields, "logprobs": []}
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    expected = f"event: {kind}\ndata: {encoded}\n\n".encode()
    reader = ChatToResponsesStream(BODY, RESPONSE_ID, TURN, clock=lambda: 0.0)
    reader._sequence = sequence
    assert reader._emit(kind, **fields, logprobs=[]) == expected
    assert delta_event(sequence, item, index, text) == expected


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=12,
)


@given(value=JSON_VALUES)
def test_the_shared_encoders_write_what_json_dumps_writes(value):
    """The hot path's encoders, made once (`json.dumps` with arguments makes one per call), write
    byte for byte what the `json.dumps` call they stand for writes: session ids and prompt
    chains hash these bytes."""
    from llmgw.core import prefix, responses, sessions

    compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert responses.compact_json(value) == compact
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert prefix._canonical_json(value) == canonical
    assert sessions._stable_json(value) == json.dumps(value, sort_keys=True, ensure_ascii=False)
