"""The OpenAI Responses API at the edge: chains, the upstream exchange, stored responses.

``POST /v1/responses`` runs the request path chat completions run (keys, bands, admission,
pins and placement, retries before the first event, leases, usage, metrics, logs, traces);
this module adds what is the Responses API's own:

- before admission, `ResponsesApi.prepare` resolves ``previous_response_id`` in the response
  store (unknown, expired, deleted or another key's: 404, nothing admitted) and expands the
  chain into the whole conversation; the request's session is the chain's first response's id,
  or, for a conversation its client keeps and resends whole, that of its opening, the same for
  every turn, so every turn goes to the conversation's replica (`llmgw.core.sessions.
  chain_session`);
- per attempt, `Exchange.upstream` sends the provider the expanded input with ``store: false``
  on ``/v1/responses`` when the provider serves it (`providers[].apis`), else a chat
  completions request (`llmgw.core.responses_chat`); the answer comes back as a response object
  with the gateway's id (`Exchange.whole`, `Exchange.reader`), and once it has ended well it is
  stored (`ResponseStore.save`, off the critical path; a stream's as its terminal event is read,
  before the client has it: `KeepingReader`);
- ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}`` and
  ``GET /v1/responses/{id}/input_items`` read the store; a response belongs to the key (or,
  without keys, the bearer token) that created it: any other caller gets 404.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.outcomes import Outcome
from llmgw.core.requests import InvalidRequest
from llmgw.core.responses import (
    ResponsesStream,
    StoredResponse,
    Turn,
    expand,
    finalize,
    new_response_id,
    response_usage,
    upstream_body,
)
from llmgw.core.responses_chat import chat_request, response_from_chat
from llmgw.core.responses_chat_stream import ChatToResponsesStream
from llmgw.core.sessions import (
    ClientKey,
    chain_session,
    keeps_its_own_history,
    responses_opening,
)
from llmgw.services.edge.errors import error_body, error_response

if TYPE_CHECKING:
    import random

    from llmgw.config.schema import Config
    from llmgw.core.requests import ParsedRequest
    from llmgw.core.usage import Usage
    from llmgw.services.edge.upstream import StreamReader
    from llmgw.state.responses import ResponseStore
    from llmgw.wire import Target

__all__ = ["Exchange", "ResponsesApi", "owner_of"]

log = logging.getLogger("llmgw.edge")

RESPONSES_PATH = "/v1/responses"
# `json.dumps(value, ensure_ascii=False)`, one encoder for every answer (`json.dumps` with
# arguments makes one per call).
_response_json = json.JSONEncoder(ensure_ascii=False).encode
CHAT_PATH = "/v1/chat/completions"


def owner_of(key_id: str | None, authorization: str | None) -> str:
    """Who owns the responses a caller creates: a digest of its API key's id (auth.mode keys),
    else of its bearer token, else the anonymous owner."""
    raw = f"key:{key_id}" if key_id else f"token:{authorization or ''}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def not_found(message: str, param: str | None, code: str, headers: dict[str, str]) -> Response:
    return Response(
        error_body(message, "invalid_request_error", code, param),
        status_code=404,
        media_type="application/json",
        headers=headers,
    )


@dataclass(slots=True)
class Exchange:
    """One Responses request between the edge and its upstream (see the module docstring)."""

    api: ResponsesApi
    response_id: str
    turn: Turn
    owner: str
    root: str
    items: list[Any]  # the expanded input: earlier turns, then the new input
    body: dict[str, Any]
    stream: bool
    ancestors: tuple[str, ...]  # the chain's responses before this one, oldest first
    session: str  # the chain's, the resent conversation's opening's, or the session header's
    # The request as chat completions (no model, not streamed), once translated: the prompt's
    # chains and every attempt on a chat-only provider start from it.
    _chat: dict[str, Any] | None = None

    def translated(self, target: Target) -> bool:
        return "responses" not in self.api.apis.get(target.provider, ())

    def _as_chat(self) -> dict[str, Any]:
        """The request as chat completions; raises `Untranslatable` (an InvalidRequest)."""
        if self._chat is None:
            self._chat = chat_request(self.body, self.items, "", stream=False)
        return self._chat

    def chat_form(self) -> tuple[list[Any], list[Any] | None] | None:
        """The conversation (every turn of the chain, then this input) in chat form."""
        try:
            chat = self._as_chat()
        except InvalidRequest:
            return None
        return chat["messages"], chat.get("tools")

    def upstream(self, target: Target) -> tuple[str, bytes]:
        """The path and body of an attempt on `target`; raises `Untranslatable`."""
        if self.translated(target):
            chat = {**self._as_chat(), "model": target.upstream_model}
            if self.stream:
                chat["stream"] = True
                chat["stream_options"] = {"include_usage": True}
            if target.priority is not None:
                chat["priority"] = target.priority
            return CHAT_PATH, json.dumps(chat).encode()
        body = upstream_body(self.body, self.items, target.upstream_model)
        if target.priority is not None:
            body["priority"] = target.priority
        return RESPONSES_PATH, json.dumps(body).encode()

    def whole(self, payload: bytes, target: Target) -> tuple[bytes, Usage | None]:
        """The client's body for a non-streamed answer, stored; raises ValueError when the
        upstream's is not a JSON object."""
        value = json.loads(payload)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        if self.translated(target):
            response = response_from_chat(value, self.body, self.response_id, self.turn)
        else:
            response = finalize(value, self.response_id, self.turn)
        body = _response_json(response).encode()
        self.keep(response, body)
        return body, response_usage(response)

    def reader(self, target: Target) -> KeepingReader:
        """What follows a streamed answer on its way to the client."""
        if self.translated(target):
            inner: ResponsesStream | ChatToResponsesStream = ChatToResponsesStream(
                self.body, self.response_id, self.turn, self.api.clock
            )
        else:
            inner = ResponsesStream(self.response_id, self.turn)
        return KeepingReader(inner, self)

    def stream_ended(self, reader: StreamReader) -> None:
        """Keep the response of a stream that ended well (`reader` is this exchange's), if its
        reader has not yet."""
        if isinstance(reader, KeepingReader):
            reader.kept()

    def keep(self, response: dict[str, Any], response_json: bytes | None = None) -> None:
        if not self.turn.store or response.get("status") not in ("completed", "incomplete"):
            return
        self.api.store.save(
            StoredResponse(
                id=self.response_id,
                owner=self.owner,
                root=self.root,
                previous=self.turn.previous_response_id,
                input=self.turn.input,
                response=response,
                created_at=self.api.clock(),
                ancestors=self.ancestors,
            ),
            response_json,
        )


class KeepingReader:
    """A Responses stream's reader that keeps the response as soon as its last event has been
    read, before that event is on its way to the client: a client that has read it and names
    the response at once finds it being written (`llmgw.state.responses`)."""

    def __init__(self, inner: ResponsesStream | ChatToResponsesStream, exchange: Exchange):
        self.inner = inner
        self.exchange = exchange
        self._kept = False

    @property
    def usage(self) -> Usage | None:
        return self.inner.usage

    @usage.setter
    def usage(self, usage: Usage | None) -> None:
        self.inner.usage = usage

    @property
    def events(self) -> int:
        return self.inner.events

    @events.setter
    def events(self, events: int) -> None:
        self.inner.events = events

    @property
    def response(self) -> dict[str, Any] | None:
        return self.inner.response

    @property
    def completed(self) -> bool:
        return self.inner.completed

    def feed(self, chunk: bytes) -> bytes:
        out = self.inner.feed(chunk)
        self.kept()
        return out

    def finish(self) -> bytes:
        out = self.inner.finish()
        self.kept()
        return out

    def kept(self) -> None:
        """Keep the response once the stream has ended well (once)."""
        if not self._kept and self.inner.completed and self.inner.response is not None:
            self._kept = True
            self.exchange.keep(self.inner.response)


class ResponsesApi:
    """The edge's Responses API state: the store, each provider's APIs, ids and the clock."""

    def __init__(
        self,
        config: Config,
        store: ResponseStore,
        rng: random.Random,
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.store = store
        self.rng = rng
        self.clock = wall_of(clock)
        self.apis = {p.id: frozenset(p.apis) for p in config.providers}

    async def _read(self, read: Any) -> Any:
        """A store read within its bound (`ResponseStore.read_bound`: each of its steps waits
        ``nats.request_timeout`` at most); raises StoreUnavailable."""
        try:
            async with asyncio.timeout(self.store.read_bound):
                return await read
        except Exception as exc:
            log.warning("the response store did not answer: %r", exc)
            raise StoreUnavailable from None

    async def prepare(
        self,
        parsed: ParsedRequest,
        turn: Turn,
        owner: str,
        model: str,
        client: ClientKey | None,
        headers: dict[str, str],
    ) -> Exchange | tuple[Response, Outcome]:
        """The exchange of a request (with its session), or its error and outcome: 404 for an
        unknown previous response, 503 when the store cannot be read."""
        response_id = new_response_id(self.rng.getrandbits(80), self.store.writer)
        chain: list[StoredResponse] = []
        root = response_id
        previous = turn.previous_response_id
        held = self.store.held_chain(previous) if previous is not None else None
        if previous is not None and held is not None:  # all of it in this edge's memory
            if held[-1].owner != owner:
                return self._previous_not_found(previous, headers), Outcome.NOT_FOUND
            chain, root = held, held[-1].root
        elif previous is not None:
            try:
                head = await self._read(self.store.get(previous))
                found = (
                    None
                    if head is None or head.owner != owner
                    else await self._read(self.store.chain(head))
                )
            except StoreUnavailable:
                return _unavailable(headers), Outcome.ADMISSION_UNAVAILABLE
            if head is None or found is None:
                return self._previous_not_found(previous, headers), Outcome.NOT_FOUND
            chain, root = found, head.root
        items = expand(chain, turn.input)
        resent = previous is None and keeps_its_own_history(turn.input, turn.store)
        opening = responses_opening(items) if resent else None
        session = chain_session(root, model, opening=opening, client=client)
        return Exchange(
            self,
            response_id,
            turn,
            owner,
            root,
            items,
            parsed.body,
            parsed.stream,
            tuple(stored.id for stored in chain),
            session,
        )

    @staticmethod
    def _previous_not_found(previous: str, headers: dict[str, str]) -> Response:
        return not_found(
            f"Previous response with id '{previous}' not found.",
            "previous_response_id",
            "previous_response_not_found",
            headers,
        )

    # -- stored responses ---------------------------------------------------------------------

    async def _owned(self, response_id: str, owner: str) -> StoredResponse | None:
        stored = await self._read(self.store.get(response_id, remembered=False))
        return stored if stored is not None and stored.owner == owner else None

    async def get(self, response_id: str, owner: str) -> Response:
        try:
            stored = await self._owned(response_id, owner)
        except StoreUnavailable:
            return _unavailable({})
        if stored is None:
            return _missing(response_id)
        return JSONResponse(stored.response)

    async def delete(self, response_id: str, owner: str) -> Response:
        try:
            stored = await self._owned(response_id, owner)
            deleted = stored is not None and await self._read(self.store.delete(response_id))
        except StoreUnavailable:
            return _unavailable({})
        if not deleted:
            return _missing(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(self, response_id: str, owner: str, query: dict[str, str]) -> Response:
        """The items the response was generated from (earlier turns included), as a list page:
        ``order`` (asc or desc, default desc), ``limit`` (1-100, default 20), ``after``."""
        try:
            stored = await self._owned(response_id, owner)
            chain = await self._read(self.store.chain(stored)) if stored is not None else None
        except StoreUnavailable:
            return _unavailable({})
        if stored is None or chain is None:
            return _missing(response_id)
        order = query.get("order", "desc")
        limit_text = query.get("limit", "20")
        if order not in ("asc", "desc") or not limit_text.isdigit():
            return Response(
                error_body(
                    "'order' must be 'asc' or 'desc' and 'limit' an integer between 1 and 100.",
                    "invalid_request_error",
                    "invalid_request",
                    "order" if order not in ("asc", "desc") else "limit",
                ),
                status_code=400,
                media_type="application/json",
            )
        limit = min(max(int(limit_text), 1), 100)
        suffix = response_id.removeprefix("resp_")
        items = [
            _listed(item, f"msg_{suffix}_{index}")
            for index, item in enumerate(expand(chain[:-1], stored.input))
        ]
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )


class StoreUnavailable(Exception):
    """The response store did not answer within the NATS request timeout."""


def _unavailable(headers: dict[str, str]) -> Response:
    return error_response(
        Outcome.ADMISSION_UNAVAILABLE,
        "The gateway cannot read its stored responses right now.",
        retry_after_s=1,
        headers=headers,
    )


def _listed(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    """An input item as the API lists it: with an id, a message's text as content parts."""
    listed = {"id": item_id, **item}
    content = item.get("content")
    if item.get("type") == "message" and isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        listed["content"] = [{"type": kind, "text": content}]
    return listed


def _missing(response_id: str) -> Response:
    return not_found(f"No response found with id '{response_id}'.", None, "not_found", {})
