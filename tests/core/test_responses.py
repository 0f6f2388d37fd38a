"""The Responses API's pure core: request checks, chains, the stored record, and the reader of
a Responses stream (llmgw.core.responses)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.requests import InvalidRequest
from llmgw.core.responses import (
    ResponsesStream,
    StoredResponse,
    Turn,
    expand,
    new_response_id,
    parse_responses_request,
    response_usage,
    upstream_body,
)
from llmgw.core.usage import Usage

RECORDED = json.loads((Path(__file__).parent / "data/responses/response_text.json").read_text())
OURS = "resp_" + "2" * 32
TURN = Turn(({"type": "message", "role": "user", "content": "hi"},), "resp_" + "3" * 32, True, None)


def _event(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def recorded_stream() -> bytes:
    """A Responses stream whose final response is the one recorded from OpenAI's API."""
    upstream = {**RECORDED, "id": "resp_upstream", "store": False}
    started = {**upstream, "status": "in_progress", "output": [], "usage": None}
    item = RECORDED["output"][0]
    words = item["content"][0]["text"].split(" ")
    deltas = [w if i == 0 else " " + w for i, w in enumerate(words)]
    return b"".join(
        [
            _event("response.created", response=started, sequence_number=0),
            _event("response.in_progress", response=started, sequence_number=1),
            _event("response.output_item.added", output_index=0, item={**item, "content": []}),
            *(
                _event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=0,
                    content_index=0,
                    delta=d,
                )
                for d in deltas
            ),
            _event("response.output_item.done", output_index=0, item=item),
            _event("response.completed", response=upstream, sequence_number=99),
        ]
    )


def read(stream: bytes, cuts: list[int]) -> tuple[ResponsesStream, bytes]:
    reader = ResponsesStream(OURS, TURN)
    out, start = [], 0
    for cut in [*sorted(cuts), len(stream)]:
        out.append(reader.feed(stream[start:cut]))
        start = cut
    return reader, b"".join([*out, reader.finish()])


def test_the_stream_reader_gives_lifecycle_events_our_id_and_passes_the_rest_as_it_came():
    stream = recorded_stream()
    reader, out = read(stream, [])
    events_in = stream.split(b"\n\n")[:-1]
    events_out = out.split(b"\n\n")[:-1]
    assert len(events_in) == len(events_out)
    for before, after in zip(events_in, events_out, strict=True):
        if b'"response": {' in before:
            payload = json.loads(after.split(b"\ndata: ", 1)[1])
            assert payload["response"]["id"] == OURS
            assert payload["response"]["previous_response_id"] == TURN.previous_response_id
            assert payload["response"]["store"] is True
        else:
            assert after == before  # deltas: the upstream's bytes
    assert reader.completed and reader.response is not None
    assert reader.response["output"] == RECORDED["output"]
    assert (reader.usage.input_tokens, reader.usage.output_tokens) == (14, 50)
    # The deltas, counted for a stream cut short (billed on them).
    assert reader.events == stream.count(b"event: response.output_text.delta") > 0


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 4000), max_size=25))
def test_the_stream_reader_does_not_depend_on_where_the_stream_is_cut(cuts):
    stream = recorded_stream()
    assert read(stream, [c % (len(stream) + 1) for c in cuts])[1] == read(stream, [])[1]


def test_a_failed_response_ends_the_stream_but_not_well():
    failed = {**RECORDED, "status": "failed", "error": {"code": "server_error", "message": "x"}}
    reader, _ = read(_event("response.failed", response=failed), [])
    assert reader.response is not None and not reader.completed


_TEXT = st.text(max_size=30)
_ITEM = st.one_of(
    st.builds(
        lambda role, text: {"type": "message", "role": role, "content": text},
        st.sampled_from(["user", "system", "developer"]),
        _TEXT,
    ),
    st.builds(
        lambda cid, out: {"type": "function_call_output", "call_id": cid, "output": out},
        _TEXT,
        _TEXT,
    ),
)
_OUTPUT = st.one_of(
    st.builds(
        lambda text: {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        },
        _TEXT,
    ),
    st.builds(
        lambda cid: {"type": "function_call", "call_id": cid, "name": "f", "arguments": "{}"},
        _TEXT,
    ),
    st.just({"type": "web_search_call", "id": "ws_1"}),  # not carried into the next turn
)


@st.composite
def chains(draw):
    turns = draw(
        st.lists(st.tuples(st.lists(_ITEM, max_size=3), st.lists(_OUTPUT, max_size=3)), max_size=5)
    )
    chain, previous = [], None
    for index, (items, output) in enumerate(turns):
        rid = new_response_id(index + 1, "0" * 12)
        chain.append(
            StoredResponse(
                rid,
                "owner",
                new_response_id(1, "0" * 12),
                previous,
                tuple(items),
                {"output": output},
                0.0,
            )
        )
        previous = rid
    return chain


@settings(max_examples=100, deadline=None)
@given(chain=chains(), new=st.lists(_ITEM, min_size=1, max_size=3))
def test_expanding_a_chain_gives_every_turn_in_order_then_the_new_input(chain, new):
    items = expand(chain, new)
    expected = []
    for stored in chain:
        expected += list(stored.input)
        expected += [o for o in stored.response["output"] if o["type"] != "web_search_call"]
    assert items == expected + new
    for stored in chain:  # and the record survives the store
        assert StoredResponse.decode(stored.encode()) == stored


def test_the_upstream_body_carries_the_expansion_and_asks_the_engine_to_keep_nothing():
    body = {
        "model": "llama",
        "input": "x",
        "previous_response_id": "resp_x",
        "store": True,
        "top_p": 1,
    }
    sent = upstream_body(body, [{"type": "message", "role": "user", "content": "a"}], "meta/llama")
    assert sent == {
        "model": "meta/llama",
        "input": [{"type": "message", "role": "user", "content": "a"}],
        "store": False,
        "top_p": 1,
    }
    assert body["store"] is True  # the client's body is left as it was


def test_requests_are_normalized_to_items():
    parsed, turn = parse_responses_request(
        b'{"model": "m", "input": [{"role": "user", "content": "a"}], "store": false, "stream": true}'
    )
    assert turn.input == ({"type": "message", "role": "user", "content": "a"},)
    assert turn.store is False and parsed.stream is True
    _, turn = parse_responses_request(b'{"model": "m", "input": "hello"}')
    assert turn.input == ({"type": "message", "role": "user", "content": "hello"},)
    assert turn.store is True and turn.previous_response_id is None


def test_a_built_in_tool_is_refused_naming_it():
    with pytest.raises(InvalidRequest) as caught:
        parse_responses_request(b'{"model": "m", "input": "x", "tools": [{"type": "file_search"}]}')
    assert caught.value.param == "tools[0].type" and "file_search" in caught.value.message


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["", "x", "user", "message"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "role",
                    "content",
                    "text",
                    "call_id",
                    "name",
                    "arguments",
                    "output",
                    "image_url",
                    "input",
                    "tools",
                    "model",
                    "store",
                    "stream",
                    "tool_choice",
                ]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=20,
)
_ITEM_TYPES = st.sampled_from(
    ["message", "function_call", "function_call_output", "reasoning", "input_text", "web_search"]
)


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(
        st.fixed_dictionaries(
            {"type": _ITEM_TYPES},
            optional={
                "role": _JSON,
                "content": _JSON,
                "call_id": _JSON,
                "name": _JSON,
                "arguments": _JSON,
                "output": _JSON,
            },
        ),
        max_size=4,
    ),
    extra=st.dictionaries(st.sampled_from(["tools", "tool_choice", "store", "stream"]), _JSON),
)
def test_any_body_is_parsed_and_translated_or_refused_with_a_named_field(items, extra):
    """Whatever a client sends, the checks and the translation answer it or name what is wrong:
    no other exception escapes (it would be a 500)."""
    from llmgw.core.responses_chat import chat_request

    body = {"model": "m", "input": items or "x", **extra}
    try:
        parsed, turn = parse_responses_request(json.dumps(body).encode())
    except InvalidRequest as exc:
        assert exc.message
        return
    try:
        chat_request(parsed.body, list(turn.input), "m", stream=parsed.stream)
    except InvalidRequest as exc:
        assert exc.param


def test_a_stream_without_event_lines_is_read_by_its_data_types():
    stream = b"\n\n".join(
        b"\n".join(line for line in event.split(b"\n") if not line.startswith(b"event:"))
        for event in recorded_stream().split(b"\n\n")
    )
    reader, out = read(stream, [])
    assert reader.completed and reader.response["id"] == OURS
    assert out.count(b'"id":"' + OURS.encode() + b'"') == 3  # created, in_progress, completed
    assert b"resp_upstream" not in out


@pytest.mark.parametrize(
    ("usage", "read"),
    [
        (
            {
                "input_tokens": 1200,
                "output_tokens": 5,
                "input_tokens_details": {"cached_tokens": 1024},
            },
            Usage(1200, 5, 1024),
        ),
        ({"input_tokens": 14, "output_tokens": 3}, Usage(14, 3, 0)),
        (
            {"input_tokens": 14, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 99}},
            Usage(14, 3, 0),
        ),
        (
            {
                "input_tokens": 14,
                "output_tokens": 3,
                "input_tokens_details": {"cached_tokens": True},
            },
            Usage(14, 3, 0),
        ),
    ],
)
def test_a_responses_usage_counts_its_cached_input_tokens_within_its_input(usage, read):
    """OpenAI's convention: `input_tokens` is the whole prompt, its cached part a detail (one
    larger than the prompt, or not a count, is no cached count)."""
    assert response_usage({"usage": usage}) == read
