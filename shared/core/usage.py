"""Token usage read from upstream responses as they pass through, without parsing whole bodies.

Pure. Two readers:

- `usage_in(body)`: a whole (non-streamed) response; only the ``usage`` object is decoded;
- `StreamUsage`: a Server-Sent-Events stream fed chunk by chunk (chunks may split events
  anywhere). It finds the usage chunk (``"choices": []`` with ``usage``, sent before
  ``data: [DONE]`` when ``stream_options.include_usage`` is set) and, for a client that did not
  ask for it (the edge asked on its behalf: ``router.inject_usage``), removes that event from the
  bytes it forwards. Everything else passes unchanged and in order.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from llmgw.core.records import record

__all__ = ["StreamUsage", "Usage", "usage_in"]

_USAGE_KEY = b'"usage"'
_EVENT_END = b"\n\n"
_BLANK_LINES = b"\n\n\n"  # a blank line after an event's end: `split`'s bounds differ
_DATA = b"data: {"
_TAIL = 4096  # bytes kept to find the usage chunk when it is forwarded, not removed
_DECODER = json.JSONDecoder()  # stateless: one for every read (making one costs a microsecond)


@record
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # of the input, read from the provider's prefix cache


def _decode_usage(raw: bytes) -> Usage | None:
    """The ``usage`` object after the last ``"usage"`` key in ``raw``, if it decodes."""
    at = raw.rfind(_USAGE_KEY)
    if at < 0:
        return None
    start = raw.find(b"{", at + len(_USAGE_KEY))
    if start < 0:
        return None
    try:
        value, _ = _DECODER.raw_decode(raw[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = value.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or not 0 <= cached <= prompt:
        cached = 0
    return Usage(prompt, completion, cached)


def usage_in(body: bytes) -> Usage | None:
    """The usage of a complete JSON response, or None when it has none."""
    return _decode_usage(body)


def _is_usage_event(event: bytes) -> bool:
    if not event.startswith(b"data: {") or _USAGE_KEY not in event:
        return False
    compact = event.replace(b" ", b"")
    return b'"choices":[]' in compact


class StreamUsage:
    """Follows an SSE stream for its usage; removes the usage event when ``remove`` is set, or
    with `annotate` (and not ``remove``) adds the fields it returns for the usage to the usage
    object (e.g. what the request cost: llmgw.core.spend), holding each event until it ends."""

    def __init__(
        self, *, remove: bool, annotate: Callable[[Usage], dict[str, object]] | None = None
    ) -> None:
        self.remove = remove
        self.annotate = annotate
        self._held = remove or annotate is not None
        self.usage: Usage | None = None
        # Data events seen (one per token for most engines): the output of a stream cut short
        # before its usage, as far as the edge can tell (llmgw.core.spend).
        self.events = 0
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward now for ``chunk`` (possibly fewer, held until an event ends)."""
        self.events += chunk.count(_DATA)
        if not self._held:
            self._buffer = (self._buffer + chunk)[-_TAIL:]
            return chunk
        self._buffer += chunk
        end = self._buffer.rfind(_EVENT_END)
        if end < 0:
            return b""
        complete, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
        if _USAGE_KEY not in complete:
            return complete
        if _BLANK_LINES not in complete:  # each event's bounds are the separators around it
            return self._usage_events_cut(complete)
        kept = []
        for event in complete.split(_EVENT_END)[:-1]:
            if _is_usage_event(event):
                forwarded = self._usage_event(event)
                if forwarded is None:
                    continue
                event = forwarded
            kept.append(event + _EVENT_END)
        return b"".join(kept)

    def _usage_event(self, event: bytes) -> bytes | None:
        """A usage event read: its usage kept, and what goes on in its place (None: nothing,
        it is removed; else the event, with the annotation's fields when there is one)."""
        usage = _decode_usage(event)
        self.usage = usage or self.usage
        if self.remove:
            return None
        if usage is not None and self.annotate is not None:
            return _with_fields(event, self.annotate(usage))
        return event

    def _usage_events_cut(self, complete: bytes) -> bytes:
        """`feed`'s answer for `complete` (whole events, no blank line between two): only the
        events holding the usage key are looked at, the rest is forwarded as it came (a whole
        stream in one chunk is one usage event, not a split and a join of every event)."""
        parts = []
        start = 0  # what is forwarded from `complete` next
        at = complete.find(_USAGE_KEY)
        while at >= 0:
            begin = complete.rfind(_EVENT_END, 0, at)
            begin = 0 if begin < 0 else begin + 2
            stop = complete.find(_EVENT_END, at)  # `complete` ends with one
            event = complete[begin:stop]
            if _is_usage_event(event):
                forwarded = self._usage_event(event)
                if forwarded is not event:  # removed, or annotated: cut out
                    parts.append(complete[start:begin])
                    if forwarded is None:
                        start = stop + 2
                    else:
                        parts.append(forwarded)
                        start = stop
            at = complete.find(_USAGE_KEY, stop)
        if not parts:
            return complete
        parts.append(complete[start:])
        return b"".join(parts)

    def finish(self) -> bytes:
        """At the end of the stream: what is still held (forwarded), and the usage if seen."""
        rest, self._buffer = self._buffer, b""
        if not self._held:
            for event in rest.split(_EVENT_END):
                if _is_usage_event(event.strip(b"\n")):
                    self.usage = _decode_usage(event) or self.usage
            return b""
        return rest


def _with_fields(event: bytes, fields: dict[str, object]) -> bytes:
    """The usage event with `fields` added to its ``usage`` object (unchanged if it does not
    decode): spliced in before the object's closing brace, the rest byte for byte."""
    if not fields:
        return event
    text = event.decode("utf-8", "replace")
    at = text.rfind('"usage"')
    start = text.find("{", at)
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return event
    extra = json.dumps(fields, separators=(",", ":"))[1:-1]
    close = end - 1  # the usage object's "}"
    inside = text[start + 1 : close].strip()
    joined = f",{extra}" if inside else extra
    return (text[:close] + joined + text[close:]).encode()
