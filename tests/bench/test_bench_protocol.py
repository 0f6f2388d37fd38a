"""The wire format: URL forms, request bodies and headers, SSE decoding under any chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.services.bench.protocol import (
    SseDecoder,
    api_urls,
    chunk_text,
    request_body,
    request_headers,
)
from llmgw.services.bench.workload import Message, RequestPlan


@pytest.mark.parametrize(
    ("url", "root", "api"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080", None),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080", None),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080", None),
        ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080", None),
        ("https://gw.example/llm/v1", "https://gw.example/llm", None),
        ("http://h:1/v1/chat/completions", "http://h:1", "chat"),
        ("http://h:1/v1/completions", "http://h:1", "completions"),
    ],
)
def test_api_urls_accept_a_base_a_v1_base_or_a_route(url, root, api):
    urls = api_urls(url)
    assert (urls.root, urls.v1, urls.api) == (root, root + "/v1", api)
    assert urls.metrics == root + "/metrics"
    assert urls.generation("chat") == root + "/v1/chat/completions"
    assert urls.generation("completions") == root + "/v1/completions"


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://h/v1", "http://", "http://h/v1?x=1"])
def test_api_urls_refuse_what_is_not_an_api_base(url):
    with pytest.raises(ValueError):
        api_urls(url)


PLAN = RequestPlan(
    index=3,
    conversation=1,
    session_id="run-s1",
    turn=1,
    messages=(Message("user", "hi"), Message("assistant", "hello"), Message("user", "more")),
    max_tokens=42,
    new_prompt_tokens=1,
    band="bronze",
    api_key="team-a",
)


def test_chat_body_streams_with_usage_and_merges_extra_fields_last():
    body = request_body(PLAN, model="m", api="chat", stream=True, extra={"ignore_eos": True})
    assert body == {
        "model": "m",
        "max_tokens": 42,
        "stream": True,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def test_completions_body_renders_the_history_as_one_prompt():
    body = request_body(PLAN, model="m", api="completions", stream=False)
    assert body["prompt"] == "User: hi\nAssistant: hello\nUser: more\nAssistant:"
    assert "messages" not in body and "stream_options" not in body


def test_headers_carry_key_band_and_session():
    headers = request_headers(
        PLAN, band_header="x-llmgw-band", session_header="x-session-id", extra={"x-a": "1"}
    )
    assert headers == {
        "content-type": "application/json",
        "authorization": "Bearer team-a",
        "x-llmgw-band": "bronze",
        "x-session-id": "run-s1",
        "x-a": "1",
    }
    bare = RequestPlan(0, 0, None, 0, (Message("user", "x"),), 1, 1, None, None)
    assert request_headers(bare, band_header="b", session_header="s") == {
        "content-type": "application/json"
    }


@pytest.mark.parametrize(
    ("chunk", "text"),
    [
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, ""),
        ({"choices": [{"delta": {"content": " word"}}]}, " word"),
        ({"choices": [{"delta": {"reasoning_content": "think"}}]}, "think"),
        ({"choices": [{"text": " done"}]}, " done"),
        ({"choices": [{"message": {"content": "whole"}}]}, "whole"),
        ({"choices": [], "usage": {"completion_tokens": 3}}, ""),
        ({"object": "odd"}, ""),
    ],
)
def test_chunk_text_finds_generated_text(chunk, text):
    assert chunk_text(chunk) == text


EVENTS = [json.dumps({"choices": [{"delta": {"content": f" w{i}"}}]}) for i in range(5)]


@given(
    st.lists(st.integers(1, 40), max_size=30),
    st.sampled_from(["\n", "\r\n", "\r"]),
)
def test_sse_decoder_gives_the_same_events_however_the_bytes_are_split(cuts, newline):
    stream = ": keep-alive comment\n" + "".join(f"data: {e}\n\n" for e in EVENTS)
    stream += "event: ignored\ndata: [DONE]\n\n"
    raw = stream.replace("\n", newline).encode()
    decoder = SseDecoder()
    events, position = [], 0
    for cut in cuts:
        events += decoder.feed(raw[position : position + cut])
        position += cut
    events += decoder.feed(raw[position:])
    events += decoder.close()
    assert events == [*EVENTS, "[DONE]"]


def test_sse_decoder_joins_multi_line_data_and_flushes_an_unterminated_event():
    decoder = SseDecoder()
    assert decoder.feed(b"data: a\ndata: b\n\ndata:c") == ["a\nb"]
    assert decoder.close() == ["c"]
