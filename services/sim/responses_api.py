"""The simulators' Responses API (``POST /v1/responses``), as vLLM serves it without a store.

The input (a string or items, with ``instructions``) is rendered as the chat prompt of the same
conversation (`llmgw.core.responses_chat.chat_messages`, then the chat template), so a turn
sent as Responses items and the same turn sent as chat messages cost the same prompt tokens and
hit the same prefix cache. ``store`` is ignored and ``previous_response_id`` refused: like an
engine behind the gateway, the simulator keeps nothing (the gateway sends whole conversations).

Non-streamed: the response object once the generation is done. Streamed: the typed events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token, the ``.done``
events, ``response.completed`` with usage). Fault knobs that fail a request before it starts
(errors, rate limits, slow headers) apply; stalls and mid-stream deaths are chat-only.
"""

from __future__ import annotations

import json
import time
from typing import Any

from llmgw.core.responses import Turn
from llmgw.core.responses_chat import (
    Untranslatable,
    chat_messages,
    end_status,
    message_item,
    response_skeleton,
)
from llmgw.services.sim.asgi import DisconnectWatch, Receive, Send, send_bytes
from llmgw.services.sim.generation import Generation, SimError
from llmgw.services.sim.tokenizer import TokenizeError, Tokenizer, filler_piece, filler_text

__all__ = ["responses_prompt", "stream_events", "whole_object"]

_UNSTORED = Turn((), None, False, None)  # what an engine behind the gateway is asked to keep
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


def responses_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The tokens of a Responses request's chat prompt, by `tokenizer`; raises SimError (400)."""
    if body.get("previous_response_id") is not None:
        raise SimError(
            400,
            "previous_response_id: this server stores no responses",
            param="previous_response_id",
        )
    raw = body.get("input")
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise SimError(
            400, "input: a string or a non-empty list of items is required", param="input"
        )
    instructions = body.get("instructions")
    try:
        messages = chat_messages(instructions if isinstance(instructions, str) else None, items)
        return tokenizer.chat(
            [{**m, "content": m.get("content") or ""} for m in messages if m.get("role")]
        )
    except (Untranslatable, TokenizeError, KeyError, TypeError, AttributeError) as exc:
        raise SimError(400, f"input: {exc}", param="input") from None


def _usage(generation: Generation, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": generation.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": generation.cached_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": generation.prompt_tokens + output_tokens,
    }


def _object(
    body: dict[str, Any], response_id: str, model: str, output: list[Any]
) -> dict[str, Any]:
    response = response_skeleton(body, response_id, _UNSTORED, int(time.time()), model)
    response["output"] = output
    return response


async def whole_object(
    receive: Receive,
    send: Send,
    body: dict[str, Any],
    response_id: str,
    model: str,
    generation: Generation,
) -> int:
    """The response object once the generation is done; the output tokens it delivered."""
    watch: DisconnectWatch | None = None
    try:
        while not generation.done:
            if watch is None:
                watch = DisconnectWatch(receive, generation.close)
            await generation.wait(generation.emitted)
            if watch.gone:
                return 0
        text = filler_text(generation.text_seed, 0, generation.emitted)
        message = message_item(f"msg_{response_id[5:]}", text)
        response = _object(body, response_id, model, [message])
        end_status(response, generation.finish_reason)
        response["usage"] = _usage(generation, generation.emitted)
        encoded = json.dumps(response, separators=(",", ":")).encode()
        await send_bytes(send, 200, encoded, b"application/json")
        return generation.emitted
    finally:
        if watch is not None:
            watch.stop()


async def stream_events(
    receive: Receive,
    send: Send,
    body: dict[str, Any],
    response_id: str,
    model: str,
    generation: Generation,
) -> int:
    """The typed events as tokens are generated; the output tokens they delivered."""
    sequence = 0
    parts: list[str] = []

    def event(kind: str, **fields: Any) -> None:
        nonlocal sequence
        data = json.dumps({"type": kind, "sequence_number": sequence, **fields})
        sequence += 1
        parts.append(f"event: {kind}\ndata: {data}\n\n")

    item_id = f"msg_{response_id[5:]}"
    response = _object(body, response_id, model, [])
    event("response.created", response=response)
    event("response.in_progress", response=response)
    item = {**message_item(item_id, "", "in_progress"), "content": []}
    event("response.output_item.added", output_index=0, item=item)
    part = {"type": "output_text", "text": "", "annotations": []}
    event(
        "response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part
    )
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    watch: DisconnectWatch | None = None
    seed = generation.text_seed
    try:
        sent = 0
        while True:
            for index in range(sent, generation.emitted):
                event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    delta=filler_piece(seed, index),
                    logprobs=[],
                )
            sent = generation.emitted
            if generation.done:
                break
            if parts:
                await send(
                    {
                        "type": "http.response.body",
                        "body": "".join(parts).encode(),
                        "more_body": True,
                    }
                )
                parts.clear()
            if watch is None:
                watch = DisconnectWatch(receive, generation.close)
            await generation.wait(sent)
            if watch.gone:
                return sent
        text = filler_text(seed, 0, sent)
        done_part = {"type": "output_text", "text": text, "annotations": []}
        event(
            "response.output_text.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            text=text,
            logprobs=[],
        )
        event(
            "response.content_part.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part=done_part,
        )
        message = message_item(item_id, text)
        event("response.output_item.done", output_index=0, item=message)
        final = _object(body, response_id, model, [message])
        end_status(final, generation.finish_reason)
        final["usage"] = _usage(generation, sent)
        event(
            "response.completed" if final["status"] == "completed" else "response.incomplete",
            response=final,
        )
        await send({"type": "http.response.body", "body": "".join(parts).encode()})
        return sent
    finally:
        if watch is not None:
            watch.stop()
