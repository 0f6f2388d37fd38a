"""Request validation: every client error is caught here, naming its parameter."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.requests import Feature, InvalidRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def body(**fields):
    return json.dumps({**CHAT, **fields}).encode()


def test_valid_chat_request_is_parsed():
    parsed = parse_request(
        Feature.CHAT, body(stream=True, stream_options={"include_usage": True}, user="u1")
    )
    assert (parsed.model, parsed.stream, parsed.include_usage, parsed.user) == (
        "m",
        True,
        True,
        "u1",
    )


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid"),
        (b"[]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b"[" * 2000 + b"]" * 2000, "nested too deeply"),
    ],
    ids=["empty", "malformed", "bad-utf8", "array", "null", "deep-nesting"],
)
def test_undecodable_bodies_are_rejected(raw, fragment):
    with pytest.raises(InvalidRequest) as exc:
        parse_request(Feature.CHAT, raw)
    assert fragment in exc.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 7}, "temperature"),
        ({"n": 0}, "n"),
        ({"stop": 3}, "stop"),
        ({"user": 5}, "user"),
        ({"model": 5}, "model"),
        ({"model": ""}, "model"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": ["x"]}, "messages[0]"),
        ({"stream_options": "x"}, "stream_options"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_wrong_parameter_types_name_the_parameter(fields, param):
    with pytest.raises(InvalidRequest) as exc:
        parse_request(Feature.CHAT, body(**fields))
    assert exc.value.param == param


def test_completions_and_embeddings_need_their_input():
    with pytest.raises(InvalidRequest) as exc:
        parse_request(Feature.COMPLETIONS, b'{"model": "m"}')
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequest) as exc:
        parse_request(Feature.EMBEDDINGS, b'{"model": "m", "input": ""}')
    assert exc.value.param == "input"
    assert parse_request(Feature.EMBEDDINGS, b'{"model": "m", "input": ["a", "b"]}').stream is False


def test_embeddings_never_stream():
    parsed = parse_request(Feature.EMBEDDINGS, b'{"model": "m", "input": "x", "stream": true}')
    assert parsed.stream is False


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
def test_any_json_document_either_parses_or_raises_invalid_request(document):
    raw = json.dumps(document).encode()
    for feature in Feature:
        try:
            parse_request(feature, raw)
        except InvalidRequest:
            pass
