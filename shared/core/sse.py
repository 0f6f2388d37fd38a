"""Whether an upstream Server-Sent-Events stream has begun: the edge's test before it commits.

Pure. The edge sends a stream's 200 and headers to the client only once the upstream's first
event has arrived and looks like one (`stream_start` says STARTED); until then a failure is
retried on another endpoint like a non-streamed request. `stream_start` reads the bytes received
so far (chunks may split events anywhere) and says:

- INCOMPLETE: nothing wrong yet, no data event complete (a comment-only event, e.g. a keep-alive
  ``: ping``, does not begin the stream);
- STARTED: the first data event is complete and is JSON (or ``[DONE]``): relay everything;
- ERROR: the first data event is the engine's error object (vLLM's ``{"object": "error", ...}``
  or OpenAI's ``{"error": {...}}``) for a failure of the engine (a 5xx or 429 code, or none);
  `message` and `status` say which. An error with a 4xx code judges the request itself and is
  STARTED: the client gets it as the engine sent it;
- GARBAGE: a line that is not an SSE field, a data event that is not JSON, or more than
  `MAX_START` bytes without a data event.

Invariants: the verdict for a prefix of a well-formed stream is INCOMPLETE or STARTED, never
GARBAGE or ERROR (tests/core/test_sse.py, hypothesis); once STARTED, every longer buffer is
STARTED too (the verdict depends on the first data event only).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

__all__ = ["MAX_START", "StartKind", "StreamStart", "stream_start"]

MAX_START = 64 * 1024  # bytes an upstream may send before its first data event
_FIELDS = (b"data", b"event", b"id", b"retry")


class StartKind(enum.StrEnum):
    INCOMPLETE = "incomplete"
    STARTED = "started"
    ERROR = "error"
    GARBAGE = "garbage"


@dataclass(frozen=True, slots=True)
class StreamStart:
    kind: StartKind
    message: str | None = None  # ERROR: the engine's message; GARBAGE: what was wrong
    status: int | None = None  # ERROR: the engine's code, when it gave one


_INCOMPLETE = StreamStart(StartKind.INCOMPLETE)
_STARTED = StreamStart(StartKind.STARTED)


def stream_start(buffer: bytes) -> StreamStart:
    """The verdict on the bytes an upstream stream sent so far (see the module docstring)."""
    text = buffer.replace(b"\r\n", b"\n")
    position = 0
    while (end := text.find(b"\n\n", position)) >= 0:
        event, position = text[position:end], end + 2
        data: list[bytes] = []
        for line in event.split(b"\n"):
            if line.startswith(b":"):
                continue  # a comment
            name, colon, value = line.partition(b":")
            if name not in _FIELDS:
                return _garbage(line)
            if name == b"data":
                data.append(value[1:] if colon and value.startswith(b" ") else value)
        if data:
            return _first_event(b"\n".join(data))
    # No data event complete yet: the complete lines so far must be SSE lines, the last one
    # (maybe cut) the beginning of one.
    pending = text[position:].split(b"\n")
    for line in pending[:-1]:
        if line and not line.startswith(b":") and line.partition(b":")[0] not in _FIELDS:
            return _garbage(line)
    last = pending[-1].removesuffix(b"\r")  # maybe half a CRLF
    if last and not last.startswith(b":"):
        name, colon, _ = last.partition(b":")
        if name not in _FIELDS if colon else not any(f.startswith(name) for f in _FIELDS):
            return _garbage(last)
    if len(buffer) > MAX_START:
        return StreamStart(
            StartKind.GARBAGE, f"no stream event in the first {MAX_START} bytes", None
        )
    return _INCOMPLETE


def _garbage(line: bytes) -> StreamStart:
    shown = line[:40].decode("utf-8", "replace")
    return StreamStart(StartKind.GARBAGE, f"not a server-sent event: {shown!r}")


def _first_event(payload: bytes) -> StreamStart:
    if payload == b"[DONE]":
        return _STARTED
    try:
        value = json.loads(payload)
    except ValueError:
        return _garbage(payload)
    if not isinstance(value, dict):
        return _garbage(payload)
    error = value.get("error") if "error" in value else None
    if error is None and value.get("object") != "error":
        return _STARTED
    detail = error if isinstance(error, dict) else value
    code = detail.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else None
    if status is not None and status < 500 and status != 429:
        return _STARTED  # the engine judged the request itself: its answer is the client's
    message = detail.get("message")
    return StreamStart(
        StartKind.ERROR,
        message if isinstance(message, str) else "The upstream's stream began with an error.",
        status,
    )
