"""The OpenAI Responses API at the gateway: validation, chains, the stored record. Pure.

The gateway is the source of truth for a conversation chained by ``previous_response_id``:
each response it serves with ``store: true`` is kept (`StoredResponse`: this turn's input items
and the response object), and the next turn is sent upstream *expanded* (`expand`): every
earlier turn's input and output items, oldest first, then the new input, with ``store: false``.
So any engine can serve any turn, and the replica a chain is pinned to still finds the whole
prefix in its cache. A chain's session is its first response's id (`llmgw.core.sessions.chain_session`).

What a request may hold is checked here, before anything is admitted (`parse_responses_request`
raises `InvalidRequest`, whose ``param`` names the field): input items must be messages,
function calls, their outputs or reasoning items; tools must be functions (built-in tools, such
as web search or a code interpreter, run at OpenAI and nowhere else: a 400 that names them);
``background`` and ``conversation`` are refused (not served here).

`ResponsesStream` follows a Responses SSE stream chunk by chunk: it rewrites the few lifecycle
events that carry the response object (``response.created`` ... ``response.completed``) with the
gateway's id, and passes every other event through as its bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from llmgw.core.requests import Feature, InvalidRequest, ParsedRequest, decode_json_object
from llmgw.core.usage import Usage

__all__ = [
    "LIFECYCLE_EVENTS",
    "RESPONSE_ID_PATTERN",
    "ResponsesStream",
    "StoredResponse",
    "Turn",
    "as_input",
    "compact_json",
    "expand",
    "finalize",
    "new_response_id",
    "parse_responses_request",
    "response_usage",
    "upstream_body",
    "writer_of",
]

RESPONSE_ID_PATTERN = re.compile(r"^resp_[0-9a-f]{32}$")
ROLES = frozenset({"user", "assistant", "system", "developer"})
_INPUT_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
# Output item types that are input again in the next turn; others (none a function-only
# request can produce) are dropped.
_CARRIED = frozenset({"message", "function_call", "reasoning"})
# Events whose payload is the whole response object (`response`): rewritten with our id.
LIFECYCLE_EVENTS = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)
_ENDED_OK = frozenset({"response.completed", "response.incomplete"})


WRITER_DIGITS = 12  # an id's first hex digits: the token of the edge process that wrote it


def new_response_id(bits: int, writer: str) -> str:
    """A response id: the writing edge process's token (`WRITER_DIGITS` hex digits, random per
    process), then 80 of the caller's random bits. Another edge that cannot find the response
    yet asks its writer by that token (`llmgw.state.responses`)."""
    return f"resp_{writer}{bits & ((1 << 80) - 1):020x}"


def writer_of(response_id: str) -> str:
    """The writer token of a response id (`new_response_id`); of an id minted before writer
    tokens existed, 12 random digits that name no edge."""
    return response_id[5 : 5 + WRITER_DIGITS]


@dataclass(frozen=True, slots=True)
class Turn:
    """One Responses request as the gateway understood it."""

    input: tuple[dict[str, Any], ...]  # the new input items, normalized
    previous_response_id: str | None
    store: bool
    instructions: str | None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


_SCALARS: dict[str, tuple[Any, str]] = {
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "store": (lambda v: isinstance(v, bool), "a boolean"),
    "instructions": (lambda v: isinstance(v, str), "a string"),
    "previous_response_id": (lambda v: isinstance(v, str) and v, "a non-empty string"),
    "max_output_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 2,
        "a number between 0 and 2",
    ),
    "top_p": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1,
        "a number between 0 and 1",
    ),
    "user": (lambda v: isinstance(v, str), "a string"),
    "tools": (lambda v: isinstance(v, list), "a list"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "text": (lambda v: isinstance(v, dict), "an object"),
    "reasoning": (lambda v: isinstance(v, dict), "an object"),
    "tool_choice": (lambda v: isinstance(v, str | dict), "a string or an object"),
    "include": (lambda v: isinstance(v, list), "a list"),
}


def _invalid(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param)


def _check_content(content: object, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _invalid(f"'{where}' must be a string or a list of content parts.", where)
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _invalid(
                f"'{where}[{index}]' must be an object with a string 'type'.",
                f"{where}[{index}]",
            )


def _normalize_item(item: object, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _invalid(f"'{where}' must be an object.", where)
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str) or kind not in _INPUT_TYPES:
        shown = json.dumps(kind)[:40]
        raise _invalid(
            f"Unsupported input item type {shown} in '{where}'; this gateway accepts "
            "'message', 'function_call', 'function_call_output' and 'reasoning' items.",
            f"{where}.type",
        )
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _invalid(
                f"'{where}.role' must be one of 'user', 'assistant', 'system', 'developer'.",
                f"{where}.role",
            )
        _check_content(item.get("content"), f"{where}.content")
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise _invalid(f"'{where}.{name}' must be a string.", f"{where}.{name}")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _invalid(f"'{where}.call_id' must be a string.", f"{where}.call_id")
        if not isinstance(item.get("output"), str | list):
            raise _invalid(f"'{where}.output' must be a string or a list.", f"{where}.output")
    if "type" not in item:
        item = {"type": "message", **item}
    return item


def _check_tools(tools: list[Any]) -> None:
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid(f"'{where}' must be an object.", where)
        kind = tool.get("type")
        if kind != "function":
            raise _invalid(
                f"The built-in tool {json.dumps(kind)[:40]} in '{where}' is not supported "
                "through this gateway; only tools of type 'function' are.",
                f"{where}.type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _invalid(f"'{where}.name' must be a non-empty string.", f"{where}.name")


def parse_responses_request(raw: bytes) -> tuple[ParsedRequest, Turn]:
    """Decode and validate a ``POST /v1/responses`` body; raises InvalidRequest."""
    body = decode_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("'model' is required and must be a non-empty string.", "model")
    for name, (check, expected) in _SCALARS.items():
        value = body.get(name)
        if value is not None and not check(value):
            raise _invalid(
                f"Invalid type or value for '{name}': expected {expected}, "
                f"got {json.dumps(value)[:80]}.",
                name,
            )
    for name in ("background", "conversation"):
        if body.get(name):
            raise _invalid(f"'{name}' is not supported by this gateway.", name)
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items: tuple[dict[str, Any], ...] = (
            {"type": "message", "role": "user", "content": raw_input},
        )
    elif isinstance(raw_input, list) and raw_input:
        items = tuple(_normalize_item(item, f"input[{i}]") for i, item in enumerate(raw_input))
    else:
        raise _invalid("'input' is required and must be a string or a non-empty list.", "input")
    _check_tools(body.get("tools") or [])
    stream = body.get("stream") is True
    store = body.get("store") is not False
    turn = Turn(items, body.get("previous_response_id"), store, body.get("instructions"))
    parsed = ParsedRequest(
        feature=Feature.RESPONSES,
        model=model,
        body=body,
        stream=stream,
        include_usage=False,
        user=body.get("user"),
    )
    return parsed, turn


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response the gateway served with ``store: true``, as kept in the response store."""

    id: str
    owner: str  # a digest of the API key (or bearer token) that created it
    root: str  # the chain's first response: the session of every turn
    previous: str | None
    input: tuple[dict[str, Any], ...]  # this turn's input items (earlier turns: `previous`)
    response: dict[str, Any]  # the response object as the client got it
    created_at: float
    # Every earlier response of the chain, oldest first (the last is `previous`): a chain is
    # read with one concurrent get per turn, not one round trip after another.
    ancestors: tuple[str, ...] = ()

    def encode(self, response_json: bytes | None = None) -> bytes:
        """The record as stored; `response_json`: `response` already encoded (as the client
        got it), so it is not encoded again."""
        fields = compact_json(
            {
                "v": 1,
                "id": self.id,
                "owner": self.owner,
                "root": self.root,
                "previous": self.previous,
                "input": list(self.input),
                "created_at": self.created_at,
                "ancestors": list(self.ancestors),
            }
        ).encode()
        if response_json is None:
            response_json = compact_json(self.response).encode()
        return b'%s,"response":%s}' % (fields[:-1], response_json)

    @classmethod
    def decode(cls, raw: bytes) -> StoredResponse:
        """Raises ValueError for anything but a version-1 record."""
        value = json.loads(raw)
        if not isinstance(value, dict) or value.get("v") != 1:
            raise ValueError("not a stored response of version 1")
        return cls(
            id=value["id"],
            owner=value["owner"],
            root=value["root"],
            previous=value.get("previous"),
            input=tuple(value["input"]),
            response=value["response"],
            created_at=float(value["created_at"]),
            ancestors=tuple(value.get("ancestors") or ()),
        )


def as_input(output: Iterable[Any]) -> list[dict[str, Any]]:
    """A response's output items as input items of the next turn (messages, function calls and
    reasoning; anything else is dropped)."""
    return [item for item in output if isinstance(item, dict) and item.get("type") in _CARRIED]


def expand(chain: Sequence[StoredResponse], new_input: Iterable[dict[str, Any]]) -> list[Any]:
    """The whole conversation for the upstream: each earlier turn's input then output, oldest
    first, then the new input."""
    items: list[Any] = []
    for stored in chain:
        items.extend(stored.input)
        items.extend(as_input(stored.response.get("output") or ()))
    items.extend(new_input)
    return items


def upstream_body(body: dict[str, Any], items: list[Any], model: str) -> dict[str, Any]:
    """The body sent to an engine that serves the Responses API: the expanded input, nothing
    for it to keep (``store: false``), no chain of its own."""
    out = {k: v for k, v in body.items() if k not in ("previous_response_id", "store")}
    out["input"] = items
    out["model"] = model
    out["store"] = False
    return out


def finalize(response: dict[str, Any], response_id: str, turn: Turn) -> dict[str, Any]:
    """The upstream's response object as the client's: the gateway's id and chain."""
    response["id"] = response_id
    response["previous_response_id"] = turn.previous_response_id
    response["store"] = turn.store
    return response


def response_usage(response: dict[str, Any]) -> Usage | None:
    """A response's usage: ``input_tokens`` (cached ones included, as OpenAI counts them), the
    cached part of it (``input_tokens_details.cached_tokens``) and ``output_tokens``."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    tokens_in, tokens_out = usage.get("input_tokens"), usage.get("output_tokens", 0)
    if not _is_int(tokens_in) or not _is_int(tokens_out):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not _is_int(cached) or not 0 <= cached <= tokens_in:
        cached = 0
    return Usage(tokens_in, tokens_out, cached)


_EVENT_END = b"\n\n"


class ResponsesStream:
    """Follows a Responses SSE stream (see the module docstring); `feed`/`finish` return the
    bytes to forward. `response` is the final response object once a terminal lifecycle event
    passed, `completed` whether it ended well (``response.completed`` or
    ``response.incomplete``), `usage` its token usage."""

    def __init__(self, response_id: str, turn: Turn) -> None:
        self.response_id = response_id
        self.turn = turn
        self.response: dict[str, Any] | None = None
        self.completed = False
        self.usage: Usage | None = None
        self.events = 0  # output deltas read (`response.*.delta`)
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        end = self._buffer.rfind(_EVENT_END)
        if end < 0:
            return b""
        ready, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
        out = []
        for event in ready.split(_EVENT_END)[:-1]:
            out.append(self._event(event))
        return b"".join(out)

    def finish(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return self._event(rest) if rest.strip() else b""

    def _event(self, event: bytes) -> bytes:
        name: bytes | None = None
        data: list[bytes] = []
        for line in event.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" "))
        if name is not None and name.decode("ascii", "replace") not in LIFECYCLE_EVENTS:
            if name.endswith(b".delta"):
                self.events += 1
            return event + _EVENT_END  # a delta (or another item event): as it came
        if not data:
            return event + _EVENT_END
        try:
            payload = json.loads(b"\n".join(data))
        except ValueError:
            return event + _EVENT_END
        kind = payload.get("type") if isinstance(payload, dict) else None
        response = payload.get("response") if isinstance(payload, dict) else None
        if kind not in LIFECYCLE_EVENTS or not isinstance(response, dict):
            return event + _EVENT_END
        finalize(response, self.response_id, self.turn)
        if kind in _ENDED_OK or kind == "response.failed":
            self.response = response
            self.completed = kind in _ENDED_OK
            self.usage = response_usage(response)
        encoded = compact_json(payload)
        return f"event: {kind}\ndata: {encoded}\n\n".encode()


# `json.dumps(value, separators=(",", ":"), ensure_ascii=False)`, with one encoder for every
# event (`json.dumps` with arguments makes an encoder per call).
compact_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
