"""Anthropic's Messages API answers: from chat completions, read when passed through, and errors.

Pure. Three translators, each fed what the upstream sent:

- `message_from_chat`: a whole chat completion as a Messages API ``message`` object (text and
  tool_use blocks, stop reason, usage);
- `ChatToMessages`: a chat completions SSE stream (chunks split anywhere) as Anthropic's events:
  ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta``
  (``text_delta``, ``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop
  reason, usage) and ``message_stop`` once the upstream's ``data: [DONE]`` arrives. An error
  event of the upstream's (or the gateway's, OpenAI-shaped) becomes an Anthropic ``error`` event;
- `MessagesStreamReader`: a stream of an engine that serves the Messages API itself, passed
  through unchanged; it reads the usage (``message_start``'s counts, each replaced by a
  ``message_delta``'s cumulative one) and whether ``message_stop`` came (`completed`: such a
  stream has no ``[DONE]``).

Usage follows Anthropic's convention on the way out and is read back by it: a chat completion's
``prompt_tokens`` (cached tokens included) becomes ``input_tokens`` (the prompt tokens not read
from a cache) plus ``cache_read_input_tokens`` (``prompt_tokens_details.cached_tokens``); a
Messages usage is read as a prompt of ``input_tokens`` + ``cache_read_input_tokens`` +
``cache_creation_input_tokens``, of which the reads are cached (`messages_usage`).

Errors are Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}``, the ``type``
chosen by HTTP status as Anthropic's API does (`error_type`).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any

from llmgw.core.anthropic import stop_reason
from llmgw.core.usage import Usage

__all__ = [
    "ChatToMessages",
    "MessagesStreamReader",
    "anthropic_error",
    "error_type",
    "message_from_chat",
    "messages_usage",
    "messages_usage_in",
    "reshape_error",
]

_EVENT_END = b"\n\n"
_DECODER = json.JSONDecoder()
_ENCODER = json.JSONEncoder(separators=(",", ":"))
# The events of every token, written from templates: a JSON string literal is all that varies.
_TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"text_delta","text":%s}}\n\n'
)
_JSON_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"input_json_delta","partial_json":%s}}\n\n'
)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``api_error`` for other 5xx)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error(status: int, message: str) -> bytes:
    return json.dumps(
        {"type": "error", "error": {"type": error_type(status), "message": message}}
    ).encode()


def reshape_error(body: bytes, status: int) -> bytes:
    """An error body in Anthropic's shape: an OpenAI-shaped one (the gateway's own, or a chat
    engine's) is rewritten keeping its message; one already Anthropic-shaped is kept."""
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict) and value.get("type") == "error":
        return body
    message = None
    if isinstance(value, dict):
        error = value.get("error")
        detail: dict[str, Any] = error if isinstance(error, dict) else value
        message = detail.get("message")
    if not isinstance(message, str):
        message = f"The upstream answered with status {status}."
    return anthropic_error(status, message)


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {_ENCODER.encode(payload)}\n\n".encode()


def _usage_of(usage: object) -> Usage | None:
    """A chat completion's usage: its prompt (cached tokens included, as chat counts them), the
    cached part of it (``prompt_tokens_details.cached_tokens``) and its output."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    cached = _cached_tokens(usage)
    return Usage(prompt, completion, cached if isinstance(cached, int) and cached <= prompt else 0)


def _anthropic_usage(usage: Usage | None, cached: object = None) -> dict[str, Any]:
    """A Messages ``usage`` object for a chat completion's: by Anthropic's convention
    ``input_tokens`` counts the prompt tokens not read from a cache and
    ``cache_read_input_tokens`` those read (present when the engine said how many)."""
    read = cached if isinstance(cached, int) and usage and cached <= usage.input_tokens else None
    out: dict[str, Any] = {
        "input_tokens": (usage.input_tokens - (read or 0)) if usage else 0,
        "output_tokens": usage.output_tokens if usage else 0,
    }
    if read is not None:
        out["cache_read_input_tokens"] = read
    return out


def _cached_tokens(usage: object) -> object:
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if _is_count(cached) else None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _object(value: object) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one (an upstream's odd answer is read
    as far as it makes sense, never fails the translation)."""
    return value if isinstance(value, dict) else {}


def _objects(value: object) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _string(value: object) -> str:
    return value if isinstance(value, str) else ""


def _message_id(chat_id: object) -> str:
    if isinstance(chat_id, str) and chat_id:
        return "msg_" + chat_id.removeprefix("chatcmpl-")
    return "msg_llmgw"


def _tool_input(arguments: object) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        return {"_raw_arguments": arguments}  # the model's malformed arguments, kept visible
    return value if isinstance(value, dict) else {"value": value}


def message_from_chat(
    payload: bytes, model: str, stop_sequences: object = None
) -> tuple[bytes, Usage | None]:
    """A whole chat completion as a Messages API message, and its usage; ValueError when the
    payload is not a chat completion."""
    value = json.loads(payload)
    if not isinstance(value, dict) or not isinstance(value.get("choices"), list):
        raise ValueError("not a chat completion")
    choice = _object(value["choices"][0]) if value["choices"] else {}
    message = _object(choice.get("message"))
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in _objects(message.get("tool_calls")):
        function = _object(call.get("function"))
        content.append(
            {
                "type": "tool_use",
                "id": _string(call.get("id")) or "toolu_llmgw",
                "name": _string(function.get("name")),
                "input": _tool_input(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences
    )
    usage = _usage_of(value.get("usage"))
    body = {
        "id": _message_id(value.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _anthropic_usage(usage, _cached_tokens(value.get("usage"))),
    }
    return json.dumps(body).encode(), usage


def _data_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The data payloads of the complete events in ``buffer`` and what is left of it."""
    buffer = buffer.replace(b"\r\n", b"\n")
    end = buffer.rfind(_EVENT_END)
    if end < 0:
        return [], buffer
    payloads = []
    for event in buffer[:end].split(_EVENT_END):
        data = [
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        ]
        if data:
            payloads.append(b"\n".join(data))
    return payloads, buffer[end + 2 :]


class ChatToMessages:
    """A chat completions stream as Anthropic's stream events (see the module docstring).

    `feed` and `finish` return the bytes for the client; `usage` is the upstream's usage once its
    usage chunk passed (the edge asks for it: ``stream_options.include_usage``)."""

    def __init__(self, model: str, stop_sequences: object = None) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.usage: Usage | None = None
        self.events = 0  # the chat stream's data events read (one per token for most engines)
        self._cached: object = None
        self._buffer = b""
        self._started = False
        self._ended = False
        self._index = -1  # the open block's index
        self._open: str | None = None  # "text", or "tool:<chat index>"
        self._tool_id = ""  # the open tool_use block's id
        self._reason: tuple[str, Any] = ("end_turn", None)

    def feed(self, chunk: bytes) -> bytes:
        payloads, self._buffer = _data_events(self._buffer + chunk)
        self.events += len(payloads)
        return b"".join(self._translate(p) for p in payloads)

    def finish(self) -> bytes:
        payloads, self._buffer = _data_events(self._buffer + b"\n\n")
        self.events += len(payloads)
        return b"".join(self._translate(p) for p in payloads)

    def _start(self, chat_id: object) -> bytes:
        self._started = True
        message: dict[str, Any] = {
            "id": _message_id(chat_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _event(
            "ping", {"type": "ping"}
        )

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _open_block(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close_block()
        self._index += 1
        self._open = kind
        return out + _event(
            "content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _delta(self, template: bytes, text: str) -> bytes:
        return template % (self._index, encode_basestring_ascii(text).encode())

    def _translate(self, payload: bytes) -> bytes:
        if self._ended:
            return b""
        if payload.strip() == b"[DONE]":
            return self._end()
        try:
            value = _DECODER.decode(payload.decode())
        except ValueError:
            return b""
        if not isinstance(value, dict):
            return b""
        if "error" in value or value.get("object") == "error":
            return self._error(value)
        out = b"" if self._started else self._start(value.get("id"))
        if value.get("usage"):
            self.usage = _usage_of(value["usage"]) or self.usage
            self._cached = _cached_tokens(value["usage"])
        for choice in _objects(value.get("choices")):
            delta = _object(choice.get("delta"))
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open != "text":
                    out += self._open_block("text", {"type": "text", "text": ""})
                out += self._delta(_TEXT_DELTA, text)
            for call in _objects(delta.get("tool_calls")):
                key = f"tool:{call.get('index', 0)}"
                function = _object(call.get("function"))
                call_id = _string(call.get("id"))
                # a new call: another index, or (servers that send no index) another id
                if self._open != key or (call_id and call_id != self._tool_id):
                    self._tool_id = call_id or f"toolu_llmgw_{self._index + 1}"
                    block: dict[str, Any] = {
                        "type": "tool_use",
                        "id": self._tool_id,
                        "name": _string(function.get("name")),
                        "input": {},
                    }
                    out += self._open_block(key, block)
                arguments = function.get("arguments")
                if isinstance(arguments, str) and arguments:
                    out += self._delta(_JSON_DELTA, arguments)
            if choice.get("finish_reason"):
                self._reason = stop_reason(
                    choice["finish_reason"], choice.get("stop_reason"), self.stop_sequences
                )
        return out

    def _end(self) -> bytes:
        self._ended = True
        out = b"" if self._started else self._start(None)
        out += self._close_block()
        reason, sequence = self._reason
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": _anthropic_usage(self.usage, self._cached),
        }
        return (
            out + _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"})
        )

    def _error(self, value: dict[str, Any]) -> bytes:
        self._ended = True
        detail = value.get("error") if isinstance(value.get("error"), dict) else value
        message = detail.get("message") if isinstance(detail, dict) else None
        code = detail.get("code") if isinstance(detail, dict) else None
        status = code if isinstance(code, int) else 500
        if code in ("lease_lost", "shutting_down"):
            status = 503
        return _event(
            "error",
            {
                "type": "error",
                "error": {
                    "type": error_type(status),
                    "message": message if isinstance(message, str) else "The stream failed.",
                },
            },
        )


def messages_usage_in(payload: bytes) -> Usage | None:
    """The usage of a whole Messages API response; only its ``usage`` object is decoded (the
    last one: a content block's text may quote the key, the response's own comes after)."""
    at = payload.rfind(b'"usage"')
    start = payload.find(b"{", at) if at >= 0 else -1
    if start < 0:
        return None
    try:
        value, _ = _DECODER.raw_decode(payload[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return messages_usage(value)


_CACHE_COUNTS = ("cache_read_input_tokens", "cache_creation_input_tokens")


def messages_usage(usage: object) -> Usage | None:
    """The Usage of a Messages API ``usage`` object. Anthropic's ``input_tokens`` leaves out the
    prompt tokens read from a cache (``cache_read_input_tokens``) and those written to one
    (``cache_creation_input_tokens``): the prompt is their sum, and its cached part the reads."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("input_tokens"), usage.get("output_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    read, written = (_count(usage.get(name)) for name in _CACHE_COUNTS)
    return Usage(prompt + read + written, completion, read)


def _count(value: object) -> int:
    """A token count, or 0 when `value` is none (absent, null, not a count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class MessagesStreamReader:
    """Follows a Messages API stream passed through unchanged: its usage and its end."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.completed = False  # message_stop arrived: the stream ended well
        self.events = 0  # content_block_delta events read
        self._counts: dict[str, Any] = {}  # the usage so far: message_start's, then the deltas'
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        payloads, self._buffer = _data_events(self._buffer + chunk)
        for payload in payloads:
            self._read(payload)
        return chunk

    def finish(self) -> bytes:
        payloads, self._buffer = _data_events(self._buffer + b"\n\n")
        for payload in payloads:
            self._read(payload)
        return b""

    def _read(self, payload: bytes) -> None:
        if b'"message_' not in payload:
            if b'"content_block_delta"' in payload:
                self.events += 1
            return  # deltas and pings: nothing more to read
        try:
            value = json.loads(payload)
        except ValueError:
            return
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "message_start":
            self._counts = dict(_object(_object(value.get("message")).get("usage")))
            self.usage = messages_usage(self._counts)
        elif kind == "message_delta":
            # Its counts are cumulative: each one given replaces message_start's (an absent
            # or null one keeps it), as Anthropic's SDKs read them.
            counts = _object(value.get("usage"))
            if isinstance(counts.get("output_tokens"), int):
                given = {k: v for k, v in counts.items() if v is not None}
                self._counts = {"input_tokens": 0, **self._counts, **given}
                self.usage = messages_usage(self._counts)
        elif kind == "message_stop":
            self.completed = True
