"""The simulators' Anthropic Messages API (``POST /v1/messages``), as vLLM serves it.

A Messages request is run as the chat completion it corresponds to (`llmgw.core.anthropic`):
same tokenizer, pacing, faults and metrics; its answer (whole or streamed) and its errors are
written in the Messages API's shape (`llmgw.core.anthropic_chat`). What only Anthropic's own
service does (extended thinking, server tools, documents, MCP...) is accepted and ignored, as
an open engine serving the API does: the simulator generates text. A simulator with
``messages_api: false`` has no such route (404), like a server that speaks chat completions only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.core.anthropic import TRANSLATED_BLOCKS, parse_messages_request, to_chat
from llmgw.core.anthropic_chat import ChatToMessages, message_from_chat, reshape_error
from llmgw.core.requests import InvalidRequest, ParsedRequest
from llmgw.services.sim.asgi import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    Send,
    read_body,
    send_bytes,
)
from llmgw.services.sim.generation import SimError
from llmgw.services.sim.tokenizer import TokenizeError, Tokenizer

__all__ = ["count_tokens", "serve_messages"]

ChatHandler = Callable[[Receive, Send], Awaitable[None]]


async def serve_messages(receive: Receive, send: Send, chat: ChatHandler) -> None:
    """Answer one Messages request by running ``chat`` (the simulator's chat completions) on
    its translation."""
    read = await _read(receive, send, count_only=False)
    if read is None:
        return
    parsed, chat_body = read
    sent = False

    async def chat_receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(chat_body).encode()}
        return await receive()  # the client's disconnect, while the answer is generated

    writer = _Writer(send, parsed.model, parsed.body.get("stop_sequences"), parsed.stream)
    await chat(chat_receive, writer)


async def _read(
    receive: Receive, send: Send, *, count_only: bool
) -> tuple[ParsedRequest, dict[str, Any]] | None:
    """The request and its chat completions form, or None once its error was answered."""
    try:
        raw = await read_body(receive)
    except ClientGone:
        return None
    except BodyTooLarge:
        await _error(send, 413, "request body too large")
        return None
    try:
        parsed = parse_messages_request(raw, count_only=count_only)
        body = {"max_tokens": 1, **parsed.body} if count_only else parsed.body
        return parsed, to_chat(_generated_part(body), parsed.model)
    except InvalidRequest as exc:
        await _error(send, 400, exc.message)
        return None


_IGNORED_FIELDS = ("thinking", "container", "mcp_servers", "context_management", "output_format")


def _generated_part(body: dict[str, Any]) -> dict[str, Any]:
    """The request without what the simulator ignores (see the module docstring)."""
    kept = {k: v for k, v in body.items() if k not in _IGNORED_FIELDS}
    if body.get("tools"):
        kept["tools"] = [t for t in body["tools"] if t.get("type") in (None, "custom")]
    kept["messages"] = [
        {
            **message,
            "content": [
                block if block.get("type") in TRANSLATED_BLOCKS else _as_text(block)
                for block in message["content"]
            ],
        }
        if isinstance(message["content"], list)
        else message
        for message in body["messages"]
    ]
    return kept


def _as_text(block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "text", "text": json.dumps(block)[:200]}


async def count_tokens(
    receive: Receive, send: Send, check_model: Callable[[Any], str], tokenizer: Tokenizer
) -> None:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the engine's `tokenizer` counts
    them."""
    read = await _read(receive, send, count_only=True)
    if read is None:
        return
    parsed, chat = read
    try:
        check_model(parsed.body)
        count = len(tokenizer.chat(chat["messages"], tools=chat.get("tools")))
    except SimError as exc:
        await _error(send, exc.status, exc.message)
        return
    except TokenizeError as exc:
        await _error(send, 400, str(exc))
        return
    body = json.dumps({"input_tokens": count}).encode()
    await send_bytes(send, 200, body, b"application/json")


async def _error(send: Send, status: int, message: str) -> None:
    body = reshape_error(json.dumps({"error": {"message": message}}).encode(), status)
    await send_bytes(send, status, body, b"application/json")


class _Writer:
    """An ASGI send that rewrites a chat completions answer as the Messages API's."""

    def __init__(self, send: Send, model: str, stop_sequences: Any, stream: bool) -> None:
        self._send = send
        self._model = model
        self._stop = stop_sequences
        self._stream = stream
        self._start: Message | None = None
        self._held = b""
        self._events: ChatToMessages | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if self._stream and message["status"] == 200:
                self._events = ChatToMessages(self._model, self._stop)
                headers = [(k, v) for k, v in message["headers"] if k != b"content-length"]
                await self._send({**message, "headers": headers})
            else:
                self._start = message  # sent with the whole body, rewritten
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._events is not None:
            out = self._events.feed(message.get("body", b""))
            if not more:
                out += self._events.finish()
            await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._held += message.get("body", b"")
        if more:
            return
        assert self._start is not None
        status = self._start["status"]
        if status == 200:
            body, _ = message_from_chat(self._held, self._model, self._stop)
        else:
            body = reshape_error(self._held, status)
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
