"""Anthropic's Messages API at the edge (``POST /v1/messages``): the adapter around one request.

A Messages request takes the chat path: admitted as chat (same limits, bands, flow control,
pins, leases, retries, usage), its session the chat session of its opening
(`llmgw.core.anthropic.opening`). Where it runs decides its wire form, per attempt:

- an endpoint whose ``apis`` (its own, else its provider's) list ``messages`` gets the client's
  body unchanged (the model name
  rewritten when the provider's differs) on ``/v1/messages``; its answer is relayed as it is,
  read for usage and, streamed, for ``message_stop`` (`MessagesStreamReader`);
- any other gets the request as chat completions (`llmgw.core.anthropic.to_chat`) and
  its answer is translated back (`llmgw.core.anthropic_chat`).

A request chat completions cannot express (a server tool, a document block, extended
thinking...) is refused with a 400 before admission when no endpoint of its model serves the
Messages API; otherwise it is admitted, and an attempt placed on an endpoint without the API
ends with that 400 (its lease released at once).

Every error the client sees is Anthropic-shaped (`anthropic_answer`): the gateway's own errors,
a chat engine's, and the error events of a stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from llmgw.core.anthropic import to_chat
from llmgw.core.anthropic_chat import (
    ChatToMessages,
    MessagesStreamReader,
    anthropic_error,
    message_from_chat,
    messages_usage_in,
    reshape_error,
)
from llmgw.core.requests import InvalidRequest
from llmgw.services.edge.streamed import StreamedAnswer

if TYPE_CHECKING:
    from llmgw.config.schema import Config
    from llmgw.core.requests import ParsedRequest
    from llmgw.core.usage import Usage
    from llmgw.services.edge.upstream import StreamReader
    from llmgw.wire import Target

__all__ = ["MESSAGES_PATH", "MessagesApi", "MessagesExchange", "anthropic_answer", "authorization"]

MESSAGES_PATH = "/v1/messages"
CHAT_PATH = "/v1/chat/completions"
_ERROR_EVENT = b'data: {"error"'


def authorization(headers: Mapping[str, str]) -> str | None:
    """The caller's credentials: ``Authorization``, else Anthropic's ``x-api-key`` as a bearer
    token (every route accepts either)."""
    value = headers.get("authorization")
    if value:
        return value
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else None


class MessagesApi:
    """What the edge knows of the Messages API from the config: which endpoints serve it."""

    def __init__(self, config: Config) -> None:
        # per endpoint: its own `apis`, else its provider's
        self.native = {
            e.id: "messages" in (e.apis or config.provider(e.provider).apis)
            for e in config.endpoints
        }
        # per canonical model: does every endpoint serving it speak only chat completions?
        self.translated_only = {
            m.name: not any(self.native[e.id] for e in config.endpoints if m.name in e.models)
            for m in config.models
        }

    def exchange(self, parsed: ParsedRequest, raw: bytes, model: str) -> MessagesExchange:
        """The request's adapter; raises Untranslatable when no endpoint of the model could
        run it (before admission: no lease is taken)."""
        chat = None
        if self.translated_only.get(model, True):
            chat = to_chat(parsed.body, parsed.model)
        return MessagesExchange(self, parsed, raw, chat)


class MessagesExchange:
    """One Messages request's wire form per attempt, and its answer for the client."""

    __slots__ = ("_api", "_chat", "_parsed", "_raw")

    def __init__(
        self, api: MessagesApi, parsed: ParsedRequest, raw: bytes, chat: dict[str, Any] | None
    ) -> None:
        self._api = api
        self._parsed = parsed
        self._raw = raw
        self._chat = chat

    def chat_form(self) -> tuple[list[Any], list[Any] | None] | None:
        """The conversation in the chat form a translated attempt sends (its system prompt
        first), whether or not an attempt is translated."""
        if self._chat is None:
            try:
                self._chat = to_chat(self._parsed.body, self._parsed.model)
            except InvalidRequest:
                return None
        return self._chat["messages"], self._chat.get("tools")

    def _native(self, target: Target) -> bool:
        return self._api.native.get(target.endpoint, False)

    def upstream(self, target: Target) -> tuple[str, bytes]:
        """The path and body of an attempt on ``target``; raises Untranslatable."""
        parsed = self._parsed
        if self._native(target):
            if parsed.model == target.upstream_model:
                return MESSAGES_PATH, self._raw
            return MESSAGES_PATH, json.dumps(
                {**parsed.body, "model": target.upstream_model}
            ).encode()
        if self._chat is None:
            self._chat = to_chat(parsed.body, target.upstream_model)
        chat = self._chat
        if chat["model"] != target.upstream_model or target.priority is not None:
            chat = {**chat, "model": target.upstream_model}
            if target.priority is not None:
                chat["priority"] = target.priority
        return CHAT_PATH, json.dumps(chat).encode()

    def whole(self, payload: bytes, target: Target) -> tuple[bytes, Usage | None]:
        """A whole answer for the client and its usage; ValueError when it is not one."""
        if self._native(target):  # relayed as it is, read for its usage only
            return payload, messages_usage_in(payload)
        return message_from_chat(
            payload, self._parsed.model, self._parsed.body.get("stop_sequences")
        )

    def reader(self, target: Target) -> StreamReader:
        if self._native(target):
            return MessagesStreamReader()
        return ChatToMessages(self._parsed.model, self._parsed.body.get("stop_sequences"))

    def stream_ended(self, reader: StreamReader) -> None:
        """Nothing is kept of a Messages stream once it ended."""


def anthropic_answer(answer: Response | StreamedAnswer) -> Response | StreamedAnswer:
    """The answer to a Messages request with every error in Anthropic's shape."""
    if isinstance(answer, StreamedAnswer):
        answer.map_body(_anthropic_events)
        return answer
    status = answer.status_code
    if status < 400 or status == 499:
        return answer
    body = reshape_error(bytes(answer.body), status)
    headers = {k: v for k, v in answer.headers.items() if k != "content-length"}
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def _anthropic_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The gateway's own error events (OpenAI-shaped, sent when a stream that had begun fails)
    as Anthropic ``error`` events; everything else as it is."""
    try:
        async for chunk in chunks:
            if chunk.startswith(_ERROR_EVENT):
                chunk = _error_event(chunk)
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()  # the relay's own end runs now, not at garbage collection


def _error_event(chunk: bytes) -> bytes:
    try:
        detail = json.loads(chunk[len(b"data: ") :])["error"]
        message, code = detail["message"], detail.get("code")
    except (ValueError, KeyError, TypeError):
        return chunk
    status = 503 if code in ("lease_lost", "shutting_down") else 500
    return b"event: error\ndata: " + anthropic_error(status, message) + b"\n\n"
