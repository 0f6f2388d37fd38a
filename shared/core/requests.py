"""Parsing and validating OpenAI request bodies, before anything is admitted.

A request that fails here never reaches NATS: no admission, no lease, no
state touched. Errors name the offending parameter the way OpenAI does
(`param`), so clients can point at the field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any, TypeGuard

from llmgw.core.records import record


class Feature(enum.StrEnum):
    """The API surface a request uses; providers declare which they support."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"  # admitted as chat: the model's capability is the same
    MESSAGES = "messages"  # Anthropic's Messages API, admitted as chat


class InvalidRequest(ValueError):
    """A client error in the body; `param` names the field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@record
class ParsedRequest:
    """The fields routing needs, plus the decoded body for forwarding."""

    feature: Feature
    model: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    user: str | None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _string_or_list(value: object) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(item, str | int | list) for item in value)
    )


# name -> (check, what the value must be). None is accepted for every
# optional parameter, as OpenAI does.
_Check = tuple[Callable[[object], bool], str]
_COMMON: dict[str, _Check] = {
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "max_completion_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "n": (lambda v: _is_int(v) and 1 <= v <= 128, "an integer between 1 and 128"),
    "temperature": (lambda v: _is_number(v) and 0 <= v <= 2, "a number between 0 and 2"),
    "top_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number between 0 and 1"),
    "presence_penalty": (lambda v: _is_number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    "frequency_penalty": (lambda v: _is_number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    "seed": (_is_int, "an integer"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "stop": (
        lambda v: (
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        ),
        "a string or a list of strings",
    ),
    "logprobs": (lambda v: isinstance(v, bool | int), "a boolean"),
}
_CHAT: dict[str, _Check] = {
    **_COMMON,
    "logprobs": (lambda v: isinstance(v, bool), "a boolean"),
    "top_logprobs": (lambda v: _is_int(v) and 0 <= v <= 20, "an integer between 0 and 20"),
    "tools": (lambda v: isinstance(v, list), "a list"),
    "response_format": (lambda v: isinstance(v, dict), "an object"),
}
_COMPLETIONS: dict[str, _Check] = {
    **_COMMON,
    "logprobs": (lambda v: _is_int(v) and 0 <= v <= 5, "an integer between 0 and 5"),
    "echo": (lambda v: isinstance(v, bool), "a boolean"),
    "suffix": (lambda v: isinstance(v, str), "a string"),
    "best_of": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
}
_EMBEDDINGS: dict[str, _Check] = {
    "user": _COMMON["user"],
    "encoding_format": (lambda v: v in ("float", "base64"), "'float' or 'base64'"),
    "dimensions": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
}
_CHECKS = {Feature.CHAT: _CHAT, Feature.COMPLETIONS: _COMPLETIONS, Feature.EMBEDDINGS: _EMBEDDINGS}


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not valid UTF-8 JSON.") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"The request body is not valid JSON: {exc.msg} at position {exc.pos}."
        ) from None
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            f"The request body must be a JSON object, not {type(body).__name__ if body is not None else 'null'}."
        )
    return body


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of message objects.", "messages")
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"'{param}' must be an object.", param)
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(f"'{param}.role' must be a string.", f"{param}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRequest(
                f"'{param}.content' must be a string or a list of content parts.",
                f"{param}.content",
            )


def _fails(checks: dict[str, _Check], name: str, value: object) -> bool:
    entry = checks.get(name)
    return entry is not None and not entry[0](value)


def parse_request(feature: Feature, raw: bytes) -> ParsedRequest:
    """Decode and validate `raw` for `feature`; raises InvalidRequest."""
    body = decode_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string.", "model")

    if feature is Feature.CHAT:
        _check_messages(body.get("messages"))
    elif feature is Feature.COMPLETIONS:
        if "prompt" not in body or not _string_or_list(body["prompt"]):
            raise InvalidRequest("'prompt' is required and must be a string or a list.", "prompt")
    elif "input" not in body or not _string_or_list(body["input"]) or body["input"] in ("", []):
        raise InvalidRequest("'input' is required and must be a non-empty string or list.", "input")

    checks = _CHECKS[feature]
    # The body's few fields against the many checks; the first failure in the checks' order.
    failed = [
        name for name, value in body.items() if value is not None and _fails(checks, name, value)
    ]
    if failed:
        order = list(checks)
        name = min(failed, key=order.index)
        raise InvalidRequest(
            f"Invalid type or value for '{name}': expected {checks[name][1]}, got {json.dumps(body[name])[:80]}.",
            name,
        )

    stream = bool(body.get("stream")) and feature is not Feature.EMBEDDINGS
    options = body.get("stream_options") or {}
    include_usage = stream and options.get("include_usage") is True
    return ParsedRequest(
        feature=feature,
        model=model,
        body=body,
        stream=stream,
        include_usage=include_usage,
        user=body.get("user"),
    )
