"""Usage read from responses in passing; the injected usage event removed for clients who did not ask."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.usage import StreamUsage, Usage, usage_in

USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 3,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 0},
}
CHUNKS = [
    {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    {"id": "c", "choices": [{"index": 0, "delta": {"content": "usage is a word"}}]},
    {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
]
USAGE_EVENT = b"data: " + json.dumps({"id": "c", "choices": [], "usage": USAGE}).encode() + b"\n\n"
BODY = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in CHUNKS)
STREAM = BODY + USAGE_EVENT + b"data: [DONE]\n\n"


def test_usage_of_a_whole_response():
    body = json.dumps(
        {"id": "x", "choices": [{"message": {"content": '"usage" {'}}], "usage": USAGE}
    ).encode()
    assert usage_in(body) == Usage(12, 3)
    assert usage_in(b'{"id": "x"}') is None
    assert usage_in(b'{"usage": {"prompt_tokens": "many"}}') is None


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[last:point])
        last = point
    return pieces


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_the_injected_usage_event_is_removed_wherever_the_chunks_split(cuts):
    reader = StreamUsage(remove=True)
    out = b"".join(reader.feed(piece) for piece in split(STREAM, cuts)) + reader.finish()
    assert out == BODY + b"data: [DONE]\n\n"
    assert reader.usage == Usage(12, 3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_a_client_that_asked_gets_every_byte_and_the_usage_is_still_read(cuts):
    reader = StreamUsage(remove=False)
    out = b"".join(reader.feed(piece) for piece in split(STREAM, cuts)) + reader.finish()
    assert out == STREAM
    assert reader.usage == Usage(12, 3)


def test_a_stream_without_usage_passes_unchanged():
    reader = StreamUsage(remove=True)
    data = BODY + b"data: [DONE]\n\n"
    assert reader.feed(data) + reader.finish() == data
    assert reader.usage is None


def test_a_kept_usage_event_can_carry_added_fields_and_the_rest_passes_byte_for_byte():
    head = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    usage = (
        b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":3}}}\n\n'
    )
    stream = StreamUsage(remove=False, annotate=lambda u: {"cost": f"{u.input_tokens}.5"})
    out = b"".join(
        stream.feed(part) for part in (head + usage[:30], usage[30:], b"data: [DONE]\n\n")
    )
    out += stream.finish()
    assert out.startswith(head) and out.endswith(b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if b'"usage"' in e]
    (event,) = events
    body = json.loads(event[len(b"data: ") :])
    assert body["usage"]["cost"] == "7.5" and body["usage"]["completion_tokens"] == 2
    assert stream.usage == Usage(7, 2, 3)


def _feed_event_by_event(reader: StreamUsage, chunks: list[bytes]) -> bytes:
    """What a reader that holds events forwards, written out event by event: each whole
    chunk's events split off, checked and joined again (the reader's own way may differ)."""
    from llmgw.core.usage import _decode_usage, _is_usage_event, _with_fields

    out, buffer = [], b""
    for chunk in chunks:
        buffer += chunk
        end = buffer.rfind(b"\n\n")
        if end < 0:
            continue
        complete, buffer = buffer[: end + 2], buffer[end + 2 :]
        if b'"usage"' not in complete:
            out.append(complete)
            continue
        for event in complete.split(b"\n\n")[:-1]:
            if _is_usage_event(event):
                usage = _decode_usage(event)
                reader.usage = usage or reader.usage
                if reader.remove:
                    continue
                if usage is not None and reader.annotate is not None:
                    event = _with_fields(event, reader.annotate(usage))
            out.append(event + b"\n\n")
    return b"".join(out) + buffer


def _usage_event(prompt: int) -> bytes:
    body = {"id": "c", "choices": [], "usage": {**USAGE, "prompt_tokens": prompt}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


_EVENTS = st.sampled_from(
    [
        *(b"data: " + json.dumps(c).encode() + b"\n\n" for c in CHUNKS),
        b"data: " + json.dumps({**CHUNKS[1], "usage": None}).encode() + b"\n\n",  # OpenAI's
        b'data: {"id": "c", "choices": [], "usage": null}\n\n',
        b'data: {"id": "c", "choices": [ ], "usage": {"prompt_tokens": 7}}\n\n',
        b'event: chunk\ndata: {"id": "c", "choices": [], "usage": {"prompt_tokens": 8}}\n\n',
        b"\n" + _usage_event(5),  # a blank line before an event
        _usage_event(9),
        _usage_event(11),
        b": a comment\n\n",
        b"data: [DONE]\n\n",
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    events=st.lists(_EVENTS, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
    mode=st.sampled_from(["remove", "annotate"]),
)
def test_the_reader_forwards_what_an_event_by_event_reading_forwards(events, cuts, mode):
    """A reader that holds events (it removes the injected usage event, or adds fields to the
    usage event) forwards the same bytes, and reads the same usage, as one that splits every
    event off, checks it and joins it again."""

    def reader() -> StreamUsage:
        annotate = (lambda u: {"cost": str(u.input_tokens)}) if mode == "annotate" else None
        return StreamUsage(remove=mode == "remove", annotate=annotate)

    stream = b"".join(events)
    fast, slow = reader(), reader()
    forwarded = b"".join(fast.feed(piece) for piece in split(stream, cuts)) + fast.finish()
    assert forwarded == _feed_event_by_event(slow, split(stream, cuts))
    assert fast.usage == slow.usage
