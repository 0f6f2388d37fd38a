"""Whether an upstream stream has begun: well-formed streams are never judged garbage, a stream
that starts wrong is, and the first data event decides."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.sse import MAX_START, StartKind, stream_start

CHUNK = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi\n\ndata: x"}}]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
data_event = st.builds(
    lambda payload, newline: (b"data: " + json.dumps(payload).encode() + b"\n\n").replace(
        b"\n", newline
    ),
    st.dictionaries(st.sampled_from(["id", "choices", "model"]), json_values, min_size=1),
    st.sampled_from([b"\n", b"\r\n"]),
)
preamble = st.lists(
    st.sampled_from([b": ping\n\n", b"event: message\n", b"id: 7\n", b"retry: 100\n"]),
    max_size=3,
)


@given(preamble, st.lists(data_event, min_size=1, max_size=3), st.data())
def test_a_well_formed_stream_is_incomplete_until_its_first_data_event_then_started(
    before, events, data
):
    stream = b"".join(before) + b"".join(events)
    first_end = len(b"".join(before)) + len(events[0])
    cut = data.draw(st.integers(0, len(stream)))
    verdict = stream_start(stream[:cut]).kind
    expected = StartKind.STARTED if cut >= first_end else StartKind.INCOMPLETE
    assert verdict is expected


@given(st.binary(min_size=1, max_size=64))
def test_bytes_that_do_not_begin_an_sse_line_are_garbage(noise):
    first = noise.split(b"\n")[0].split(b"\r")[0]
    if not first or first.startswith(b":"):
        return  # an empty line or a comment: legitimately not judged yet
    name, colon, _ = first.partition(b":")
    fields = (b"data", b"event", b"id", b"retry")
    if (name in fields) if colon else any(f.startswith(name) for f in fields):
        return
    assert stream_start(noise).kind is StartKind.GARBAGE


def test_what_the_misbehaving_engines_send():
    assert stream_start(b"").kind is StartKind.INCOMPLETE
    assert stream_start(b"da").kind is StartKind.INCOMPLETE
    assert stream_start(b"<html>502 Bad Gateway").kind is StartKind.GARBAGE
    assert stream_start(b"data: not json\n\n").kind is StartKind.GARBAGE
    assert stream_start(b"data: [1, 2]\n\n").kind is StartKind.GARBAGE
    assert stream_start(b"data: [DONE]\n\n").kind is StartKind.STARTED
    assert stream_start(b": keep-alive\n\n" * 3).kind is StartKind.INCOMPLETE
    assert stream_start(b":" + b"x" * MAX_START).kind is StartKind.GARBAGE
    ok = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
    assert stream_start(ok + b"\x00garbage later is the relay's business").kind is (
        StartKind.STARTED
    )


def test_an_error_event_in_place_of_the_first_token_is_the_engines_failure_unless_a_4xx():
    vllm = {"object": "error", "message": "engine dead", "type": "InternalServerError"}
    failed = stream_start(b"data: " + json.dumps({**vllm, "code": 500}).encode() + b"\n\n")
    assert (failed.kind, failed.message, failed.status) == (StartKind.ERROR, "engine dead", 500)
    openai = {"error": {"message": "slow down", "code": 429}}
    limited = stream_start(b"data: " + json.dumps(openai).encode() + b"\n\n")
    assert (limited.kind, limited.status) == (StartKind.ERROR, 429)
    uncoded = stream_start(b'data: {"error": "boom"}\n\n')
    assert (uncoded.kind, uncoded.status) == (StartKind.ERROR, None)
    judged = {"object": "error", "message": "prompt too long", "code": 400}
    assert stream_start(b"data: " + json.dumps(judged).encode() + b"\n\n").kind is (
        StartKind.STARTED
    )
