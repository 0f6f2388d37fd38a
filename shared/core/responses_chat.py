"""Responses API <-> chat completions, for providers that serve only chat completions. Pure.

`chat_request` turns a Responses request (its expanded input) into a chat completions body;
`response_from_chat` turns a chat completion into a response object
(`llmgw.core.responses_chat_stream.ChatToResponsesStream` does the same for a stream, chunk by
chunk).

Translated: text (system, developer, user and assistant messages; ``instructions`` as the first
system message), images by URL, function tools and ``tool_choice``, function calls and their
outputs, ``max_output_tokens``, ``temperature``, ``top_p``, ``user``, ``parallel_tool_calls``,
``text.format`` (JSON schema or object), ``reasoning.effort``, usage (cached tokens included)
and a length stop (``incomplete``, ``max_output_tokens``). Ignored: ``include`` (it asks for
extra output, e.g. encrypted reasoning, that a chat completion has none of), ``text.verbosity``,
``metadata``, ``prompt_cache_key``, ``service_tier``. Not translated: reasoning items (dropped
from the input: a chat model gets no reasoning back), files and audio parts, ``top_logprobs``,
``truncation: auto`` (a 400 names any untranslatable part; built-in tools are refused for every
provider before admission, `llmgw.core.responses`).
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.core.requests import InvalidRequest
from llmgw.core.responses import Turn

__all__ = [
    "Untranslatable",
    "call_item",
    "chat_messages",
    "chat_request",
    "chat_usage",
    "end_status",
    "message_item",
    "response_from_chat",
    "response_skeleton",
]


class Untranslatable(InvalidRequest):
    """A part of the request chat completions cannot express; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content or ()):
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise Untranslatable(
                f"The content part type {json.dumps(kind)} cannot be sent to a provider that "
                "serves only chat completions.",
                f"{where}[{index}].type",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_messages(instructions: str | None, items: list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses input (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{index}]"
        if kind == "message":
            role = item.get("role")
            content = _content(item.get("content"), f"{where}.content")
            if role == "developer":
                role = "system"
            if role == "assistant" and not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content)
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("content"):
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        # reasoning items: not sent (see the module docstring)
    return messages


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        function = {"name": tool["name"]}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise Untranslatable(
            "This tool_choice cannot be sent to a provider that serves only chat completions.",
            "tool_choice",
        )
    return choice


def chat_request(
    body: dict[str, Any], items: list[Any], model: str, *, stream: bool
) -> dict[str, Any]:
    """The chat completions body for a Responses request whose input is `items`."""
    for name in ("truncation", "top_logprobs"):
        if body.get(name) not in (None, 0, "disabled"):
            raise Untranslatable(
                f"'{name}' cannot be sent to a provider that serves only chat completions.", name
            )
    chat: dict[str, Any] = {
        "model": model,
        "messages": chat_messages(body.get("instructions"), items),
    }
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for ours, theirs in (
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("priority", "priority"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    text_format = (body.get("text") or {}).get("format")
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        schema = {k: text_format[k] for k in ("name", "schema", "strict") if k in text_format}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(text_format, dict) and text_format.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A chat completion's usage as a response's (None when it has none)."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


def response_skeleton(
    body: dict[str, Any], response_id: str, turn: Turn, created: int, model: Any
) -> dict[str, Any]:
    """The response object's fields that do not depend on the output."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": turn.previous_response_id,
        "reasoning": body.get("reasoning"),
        "store": turn.store,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def end_status(response: dict[str, Any], finish_reason: Any) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def response_from_chat(
    completion: dict[str, Any], body: dict[str, Any], response_id: str, turn: Turn
) -> dict[str, Any]:
    """The response object for a (non-streamed) chat completion."""
    response = response_skeleton(
        body,
        response_id,
        turn,
        int(completion.get("created") or 0),
        completion.get("model") or body.get("model"),
    )
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    suffix = response_id.removeprefix("resp_")
    if message.get("content"):
        response["output"].append(message_item(f"msg_{suffix}", message["content"]))
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        response["output"].append(
            call_item(
                f"fc_{suffix}_{index}",
                call.get("id") or f"call_{suffix}_{index}",
                function.get("name", ""),
                function.get("arguments") or "",
                "completed",
            )
        )
    end_status(response, choice.get("finish_reason"))
    response["usage"] = chat_usage(completion.get("usage"))
    return response
