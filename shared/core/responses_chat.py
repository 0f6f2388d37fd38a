"""Responses API <-> chat completions, for providers that serve only chat completions. Pure.

`chat_request` turns a Responses request (its expanded input) into a chat completions body;
`response_from_chat` turns a chat completion into a response object; `ChatToResponsesStream`
turns a chat completions SSE stream into the Responses API's typed events, chunk by chunk.

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
from collections.abc import Callable
from typing import Any

from llmgw.core.requests import InvalidRequest
from llmgw.core.responses import Turn, response_usage
from llmgw.core.usage import Usage

__all__ = [
    "ChatToResponsesStream",
    "Untranslatable",
    "chat_messages",
    "chat_request",
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


def _usage(chat_usage: Any) -> dict[str, Any] | None:
    if not isinstance(chat_usage, dict):
        return None
    prompt = chat_usage.get("prompt_tokens") or 0
    completion = chat_usage.get("completion_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat_usage.get("total_tokens") or prompt + completion,
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


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
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
            _call_item(
                f"fc_{suffix}_{index}",
                call.get("id") or f"call_{suffix}_{index}",
                function.get("name", ""),
                function.get("arguments") or "",
                "completed",
            )
        )
    end_status(response, choice.get("finish_reason"))
    response["usage"] = _usage(completion.get("usage"))
    return response


class ChatToResponsesStream:
    """A chat completions SSE stream in, the Responses API's events out (see the module
    docstring). Same reader interface as `llmgw.core.responses.ResponsesStream`: `feed` and
    `finish` return the bytes to forward; `response`, `completed` and `usage` once it ended."""

    def __init__(
        self,
        body: dict[str, Any],
        response_id: str,
        turn: Turn,
        clock: Callable[[], float],
    ) -> None:
        self._body = body
        self._turn = turn
        self._id = response_id
        self._suffix = response_id.removeprefix("resp_")
        self._clock = clock
        self._buffer = b""
        self._sequence = 0
        self._started = False
        self._live: dict[str, Any] | None = None  # the response object being built
        self._text: dict[str, Any] | None = None  # the open message item: index, text
        self._calls: dict[int, dict[str, Any]] = {}  # open function calls by chat index
        self._finish_reason: Any = None
        self._chat_usage: Any = None
        self.response: dict[str, Any] | None = None
        self.completed = False
        self.usage: Usage | None = None

    # -- SSE plumbing -------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {encoded}\n\n".encode()

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        out: list[bytes] = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            data = b"\n".join(
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            )
            if data:
                out.append(self._data(data))
        return b"".join(out)

    def finish(self) -> bytes:
        return b""

    # -- translation --------------------------------------------------------------------------
    def _data(self, data: bytes) -> bytes:
        if data.strip() == b"[DONE]":
            return self._close()
        try:
            chunk = json.loads(data)
        except ValueError:
            return b""
        if not isinstance(chunk, dict) or self.completed:
            return b""
        if "error" in chunk:  # the provider's error mid-stream: the relay reports the break
            return b""
        out: list[bytes] = []
        if not self._started:
            self._started = True
            self._live = response_skeleton(
                self._body,
                self._id,
                self._turn,
                int(chunk.get("created") or self._clock()),
                chunk.get("model") or self._body.get("model"),
            )
            out.append(self._emit("response.created", response=dict(self._live)))
            out.append(self._emit("response.in_progress", response=dict(self._live)))
        if chunk.get("usage"):
            self._chat_usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out.append(self._text_delta(delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.append(self._call_delta(call))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _output(self) -> list[Any]:
        assert self._live is not None
        output: list[Any] = self._live["output"]
        return output

    def _text_delta(self, text: str) -> bytes:
        out: list[bytes] = []
        if self._text is None:
            index = len(self._output())
            item_id = f"msg_{self._suffix}"
            self._text = {"index": index, "id": item_id, "text": ""}
            self._output().append(message_item(item_id, "", "in_progress"))
            item = message_item(item_id, "", "in_progress")
            item["content"] = []
            out.append(self._emit("response.output_item.added", output_index=index, item=item))
            out.append(
                self._emit(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        self._text["text"] += text
        out.append(
            self._emit(
                "response.output_text.delta",
                item_id=self._text["id"],
                output_index=self._text["index"],
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return b"".join(out)

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        position = call.get("index", 0)
        function = call.get("function") or {}
        open_call = self._calls.get(position)
        if open_call is None:
            index = len(self._output())
            item_id = f"fc_{self._suffix}_{position}"
            open_call = {
                "index": index,
                "id": item_id,
                "call_id": call.get("id") or f"call_{self._suffix}_{position}",
                "name": function.get("name") or "",
                "arguments": "",
            }
            self._calls[position] = open_call
            item = _call_item(item_id, open_call["call_id"], open_call["name"], "", "in_progress")
            self._output().append(item)
            out.append(
                self._emit("response.output_item.added", output_index=index, item=dict(item))
            )
        arguments = function.get("arguments") or ""
        if arguments:
            open_call["arguments"] += arguments
            out.append(
                self._emit(
                    "response.function_call_arguments.delta",
                    item_id=open_call["id"],
                    output_index=open_call["index"],
                    delta=arguments,
                )
            )
        return b"".join(out)

    def _close(self) -> bytes:
        if self._live is None or self.completed:
            return b""
        out: list[bytes] = []
        output = self._output()
        if self._text is not None:
            text, index, item_id = self._text["text"], self._text["index"], self._text["id"]
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(
                self._emit(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._emit(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
            output[index] = message_item(item_id, text)
            out.append(
                self._emit("response.output_item.done", output_index=index, item=output[index])
            )
        for open_call in self._calls.values():
            index = open_call["index"]
            out.append(
                self._emit(
                    "response.function_call_arguments.done",
                    item_id=open_call["id"],
                    output_index=index,
                    arguments=open_call["arguments"],
                )
            )
            output[index] = _call_item(
                open_call["id"],
                open_call["call_id"],
                open_call["name"],
                open_call["arguments"],
                "completed",
            )
            out.append(
                self._emit("response.output_item.done", output_index=index, item=output[index])
            )
        end_status(self._live, self._finish_reason)
        self._live["usage"] = _usage(self._chat_usage)
        kind = (
            "response.completed" if self._live["status"] == "completed" else "response.incomplete"
        )
        out.append(self._emit(kind, response=self._live))
        self.response = self._live
        self.completed = True
        self.usage = response_usage(self._live)
        return b"".join(out)
