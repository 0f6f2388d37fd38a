"""Anthropic's Messages API requests: validation, the session's opening, and chat completions.

Pure. `parse_messages_request` checks a ``POST /v1/messages`` body the way Anthropic's API does
(required ``model``, ``max_tokens`` and ``messages``; roles; content block types; parameter
types) before anything is admitted: a request that fails here takes no lease. `to_chat` turns a
valid request into a chat completions body for a provider that does not serve the Messages API;
what chat completions cannot express raises `Untranslatable` (a 400 in Anthropic's error shape,
docs/messages.md lists them). Block types Anthropic defines but chat completions cannot carry are
valid input (a provider that serves the API natively gets them unchanged); a block type nobody
defines is bad input everywhere.

The session of a Messages request is the chat path's (`llmgw.core.sessions`): ``metadata.user_id``
is the explicit key (as ``user`` is for chat), else the conversation's opening (the system prompt
and every message up to the first user message), expressed as chat messages, without the
``cache_control`` marks a client moves from turn to turn.

Prompt caching (``cache_control`` on the request, its tools, system blocks and content blocks,
with its ``ttl``) is checked for its shape here, passed through unchanged to a provider serving
the API, and left out by `to_chat`, which writes every block afresh (chat completions has no
such field): the chat engine caches prefixes by itself.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.core.requests import Feature, InvalidRequest, ParsedRequest, decode_json_object

__all__ = [
    "TRANSLATED_BLOCKS",
    "Untranslatable",
    "opening",
    "parse_messages_request",
    "to_chat",
]

# Content blocks a chat completions request can carry (thinking blocks of earlier turns are
# dropped: chat completions has no field for them, and engines regenerate their own).
TRANSLATED_BLOCKS = frozenset(
    {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}
)
# Blocks of Anthropic's API that only a provider serving it natively understands.
_NATIVE_ONLY_BLOCKS = frozenset(
    {
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
        "tool_reference",
    }
)
_KNOWN_BLOCKS = TRANSLATED_BLOCKS | _NATIVE_ONLY_BLOCKS
# Request fields with no chat completions counterpart: translated requests are refused.
_NATIVE_ONLY_FIELDS = ("container", "mcp_servers", "context_management", "output_format")
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


class Untranslatable(InvalidRequest):
    """A valid Messages request using what chat completions cannot express; `param` names it."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_CHECKS: dict[str, tuple[Any, str]] = {
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "temperature": (lambda v: _is_number(v) and 0 <= v <= 1, "a number between 0 and 1"),
    "top_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number between 0 and 1"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "stop_sequences": (
        lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
        "a list of strings",
    ),
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "tools": (lambda v: isinstance(v, list), "a list"),
    "tool_choice": (lambda v: isinstance(v, dict) and isinstance(v.get("type"), str), "an object"),
    "thinking": (lambda v: isinstance(v, dict) and isinstance(v.get("type"), str), "an object"),
    "system": (lambda v: isinstance(v, str | list), "a string or a list of text blocks"),
}


def _check_cache_control(holder: dict[str, Any], where: str) -> None:
    """A prompt-caching breakpoint (``cache_control``), where given: an object with a string
    ``type`` (``"ephemeral"``) and, optionally, a string ``ttl`` (``"5m"``, ``"1h"``)."""
    value = holder.get("cache_control")
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("type"), str)
        or not isinstance(value.get("ttl", ""), str)
    ):
        param = f"{where}.cache_control" if where else "cache_control"
        raise InvalidRequest(
            f"{param}: Input should be an object with a string 'type' and, optionally, a "
            f'string \'ttl\' (e.g. {{"type": "ephemeral", "ttl": "1h"}}), got '
            f"{json.dumps(value)[:80]}.",
            param,
        )


def _check_blocks(blocks: list[Any], where: str) -> None:
    for index, block in enumerate(blocks):
        param = f"{where}.{index}"
        if not isinstance(block, dict):
            raise InvalidRequest(f"{param}: Input should be an object.", param)
        _check_cache_control(block, param)
        kind = block.get("type")
        if not isinstance(kind, str) or kind not in _KNOWN_BLOCKS:
            raise InvalidRequest(
                f"{param}.type: Input tag {json.dumps(kind)[:40]} found using 'type' does not "
                "match any of the expected content block types.",
                f"{param}.type",
            )
        if kind == "text" and not isinstance(block.get("text"), str):
            raise InvalidRequest(f"{param}.text: Field required (a string).", f"{param}.text")
        if kind == "tool_use" and (
            not isinstance(block.get("id"), str)
            or not isinstance(block.get("name"), str)
            or not isinstance(block.get("input"), dict)
        ):
            raise InvalidRequest(
                f"{param}: a tool_use block needs a string 'id' and 'name' and an object 'input'.",
                param,
            )
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest(
                    f"{param}.tool_use_id: Field required (a string).", f"{param}.tool_use_id"
                )
            content = block.get("content")
            if isinstance(content, list):
                _check_blocks(content, f"{param}.content")
            elif content is not None and not isinstance(content, str):
                raise InvalidRequest(
                    f"{param}.content: Input should be a string or a list of blocks.",
                    f"{param}.content",
                )


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: Field required (a non-empty list of messages).", "messages")
    for index, message in enumerate(messages):
        param = f"messages.{index}"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{param}: Input should be an object.", param)
        if message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(
                f"{param}.role: Input should be 'user' or 'assistant'.", f"{param}.role"
            )
        content = message.get("content")
        if isinstance(content, list):
            _check_blocks(content, f"{param}.content")
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"{param}.content: Input should be a string or a list of content blocks.",
                f"{param}.content",
            )


def parse_messages_request(raw: bytes, *, count_only: bool = False) -> ParsedRequest:
    """Decode and validate a Messages API body; raises InvalidRequest (an Anthropic 400).
    `count_only`: a ``count_tokens`` body, which has no ``max_tokens``."""
    body = decode_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: Field required (a non-empty string).", "model")
    max_tokens = body.get("max_tokens")
    if not count_only and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise InvalidRequest("max_tokens: Field required (an integer >= 1).", "max_tokens")
    _check_messages(body.get("messages"))
    for name, (check, expected) in _CHECKS.items():
        value = body.get(name)
        if value is not None and not check(value):
            raise InvalidRequest(
                f"{name}: Input should be {expected}, got {json.dumps(value)[:80]}.", name
            )
    system = body.get("system")
    if isinstance(system, list):
        _check_blocks(system, "system")
    for index, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise InvalidRequest(
                f"tools.{index}: a tool needs a string 'name'.", f"tools.{index}.name"
            )
        _check_cache_control(tool, f"tools.{index}")
    _check_cache_control(body, "")
    metadata = body.get("metadata") or {}
    user_id = metadata.get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise InvalidRequest("metadata.user_id: Input should be a string.", "metadata.user_id")
    return ParsedRequest(
        feature=Feature.MESSAGES,
        model=model,
        body=body,
        stream=body.get("stream") is True,
        include_usage=True,  # a Messages stream always carries its usage
        user=user_id,
    )


# -- the session's opening ----------------------------------------------------------------------


def _system_text(system: object) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(b.get("text", "") for b in system if isinstance(b, dict))
    return ""


def _uncached(message: Any) -> Any:
    """A message without the ``cache_control`` marks of its blocks (and of their nested
    blocks): an agent moves its breakpoint from turn to turn (onto its latest message), and
    the conversation's opening is the same session whether it carries one or not."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    return {**message, "content": [_uncached_block(block) for block in content]}


def _uncached_block(block: Any) -> Any:
    if not isinstance(block, dict):
        return block
    out = {k: v for k, v in block.items() if k != "cache_control"}
    if isinstance(out.get("content"), list):
        out["content"] = [_uncached_block(inner) for inner in out["content"]]
    return out


def opening(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body whose session (`llmgw.core.sessions.session_id`, chat) is the Messages
    request's: ``user`` from ``metadata.user_id``, and the system prompt and every message up to
    the first user message (what each later turn of the conversation resends unchanged)."""
    messages: list[Any] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or ():
        messages.append(_uncached(message))
        if isinstance(message, dict) and message.get("role") == "user":
            break
    chat: dict[str, Any] = {"messages": messages}
    user_id = (body.get("metadata") or {}).get("user_id")
    if isinstance(user_id, str) and user_id:
        chat["user"] = user_id
    return chat


# -- translation to chat completions ------------------------------------------------------------


def _image_part(block: dict[str, Any], param: str) -> dict[str, Any]:
    source = block.get("source")
    url: object = None
    if isinstance(source, dict) and source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif isinstance(source, dict) and source.get("type") == "url":
        url = source.get("url")
    if not isinstance(url, str):
        raise Untranslatable(
            f"{param}.source: only base64 and url image sources can be sent to this model's "
            "provider (it speaks chat completions).",
            f"{param}.source",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    parts = []
    for index, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, f"{param}.{index}"))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise Untranslatable(
                f"{param}.{index}: '{kind}' content blocks cannot be sent to this model's "
                "provider (it speaks chat completions).",
                f"{param}.{index}.type",
            )
    return parts


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content as one string (what every chat completions server accepts)."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text: str | list[dict[str, Any]] = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _content(_parts(content, f"{param}.content"))
    if block.get("is_error") is True and isinstance(text, str):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = _content(_parts(system, "system"))
    if system:
        out.append({"role": "system", "content": system})
    for index, message in enumerate(body["messages"]):
        role, content, param = message["role"], message["content"], f"messages.{index}.content"
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if role == "assistant":
            calls = [
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b["input"])},
                }
                for b in content
                if b.get("type") == "tool_use"
            ]
            rest = [b for b in content if b.get("type") != "tool_use"]
            assistant: dict[str, Any] = {"role": "assistant"}
            text = _content(_parts(rest, param))
            assistant["content"] = text if text else None
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
            continue
        # A user turn: its tool results first (chat completions wants them right after the
        # assistant's calls), then what the user wrote.
        rest = []
        for b_index, block in enumerate(content):
            if block.get("type") == "tool_result":
                out.append(_tool_result(block, f"{param}.{b_index}"))
            else:
                rest.append(block)
        if rest or not any(b.get("type") == "tool_result" for b in content):
            out.append({"role": "user", "content": _content(_parts(rest, param))})
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise Untranslatable(
                f"tools.{index}.type: Anthropic's server tool '{kind}' cannot run on this "
                "model's provider (it speaks chat completions); only custom tools can.",
                f"tools.{index}.type",
            )
        function: dict[str, Any] = {
            "name": tool["name"],
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
        }
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    kind = choice["type"]
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest(
        "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'.", "tool_choice.type"
    )


def to_chat(body: dict[str, Any], upstream_model: str) -> dict[str, Any]:
    """The chat completions body for a valid Messages request; raises Untranslatable."""
    for name in _NATIVE_ONLY_FIELDS:
        if body.get(name) is not None:
            raise Untranslatable(
                f"{name}: not supported by this model's provider (it speaks chat completions).",
                name,
            )
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") != "disabled":
        raise Untranslatable(
            "thinking: extended thinking is not supported by this model's provider (it speaks "
            'chat completions); leave it out or set it to {"type": "disabled"}.',
            "thinking",
        )
    chat: dict[str, Any] = {
        "model": upstream_model,
        "messages": _chat_messages(body),
        "max_tokens": body["max_tokens"],
    }
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _tool_choice(choice)
        if not parallel and body.get("tools"):
            chat["parallel_tool_calls"] = False
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def stop_reason(finish_reason: object, matched: object, stop_sequences: object) -> tuple[str, Any]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish_reason; vLLM names
    the stop string it matched (``stop_reason``), which makes it a ``stop_sequence``."""
    if (
        finish_reason == "stop"
        and isinstance(matched, str)
        and isinstance(stop_sequences, list)
        and matched in stop_sequences
    ):
        return "stop_sequence", matched
    reason = (
        _STOP_REASONS.get(finish_reason, "end_turn") if isinstance(finish_reason, str) else None
    )
    return reason or "end_turn", None
