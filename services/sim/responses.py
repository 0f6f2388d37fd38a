"""Writing generation responses: whole JSON bodies and SSE streams, with injected faults.

Both writers wait on the `Generation` while watching for the client going away (which closes the
generation and so frees engine resources); neither keeps anything after it returns.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from llmgw.services.sim.asgi import DisconnectWatch, Receive, Send, SimulatedCrash, send_bytes
from llmgw.services.sim.generation import Generation, OutputLimits
from llmgw.services.sim.tokenizer import filler_piece, filler_text

__all__ = ["FaultPlan", "GenerationRequest", "stream_response", "whole_response"]

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class GenerationRequest:
    """The parts of a chat/completions request the simulator uses."""

    model: str
    prompt: list[int]
    limits: OutputLimits
    stream: bool
    include_usage: bool
    priority: int = 0  # vLLM's request priority (lower first under the priority policy)


@dataclass(slots=True)
class FaultPlan:
    """Fault decisions for one request."""

    slow_headers: float = 0.0
    stall: float = 0.0
    die_at: int | None = None


async def whole_response(
    receive: Receive,
    send: Send,
    request: GenerationRequest,
    request_id: str,
    generation: Generation,
    faults: FaultPlan,
    chat: bool,
) -> int:
    """A non-streamed response once the generation is done (or a simulated stall/crash); the
    output tokens it delivered (0 when it sent no answer)."""
    watch: DisconnectWatch | None = None
    headers_sent = False
    try:
        if faults.stall > 0:
            watch = DisconnectWatch(receive, generation.close)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            headers_sent = True
            await watch.sleep(faults.stall)
        die_at = faults.die_at if faults.die_at is not None else generation.output_len
        while not generation.done and generation.emitted < die_at:
            if watch is None:
                watch = DisconnectWatch(receive, generation.close)
            await generation.wait(generation.emitted)
            if watch.gone:
                return 0
        if watch is not None and watch.gone:
            return 0
        if die_at < generation.output_len:
            if not headers_sent:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
            raise SimulatedCrash
        body = json.dumps(
            _full_response(request, request_id, generation, chat), separators=(",", ":")
        ).encode()
        if headers_sent:
            await send({"type": "http.response.body", "body": body})
        else:
            await send_bytes(send, 200, body, b"application/json")
        return generation.emitted
    finally:
        if watch is not None:
            watch.stop()


def _full_response(
    request: GenerationRequest, request_id: str, generation: Generation, chat: bool
) -> dict[str, Any]:
    count = generation.emitted
    text = filler_text(generation.text_seed, 0, count)
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = generation.finish_reason
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": _usage(generation, count),
    }


async def stream_response(
    receive: Receive,
    send: Send,
    request: GenerationRequest,
    request_id: str,
    generation: Generation,
    faults: FaultPlan,
    chat: bool,
    delivered: list[int] | None = None,
) -> None:
    """SSE chunks as tokens are generated; one body write when everything is ready at once.
    `delivered[0]` follows the output tokens written to the client so far (a stream cut short
    delivered those)."""
    delivered = delivered if delivered is not None else [0]
    obj = "chat.completion.chunk" if chat else "text_completion"
    envelope = (
        f'data: {{"id":"{request_id}","object":"{obj}","created":{int(time.time())},'
        f'"model":{json.dumps(request.model)},"choices":'
    )
    # Filler pieces never need JSON escaping, so chunks are built by concatenation.
    if chat:
        head = envelope + '[{"index":0,"delta":{"content":"'
        tail = '"},"logprobs":null,"finish_reason":'
    else:
        head = envelope + '[{"index":0,"text":"'
        tail = '","logprobs":null,"finish_reason":'
    middle = tail + "null}]}\n\n"
    last = f'{tail}"{generation.finish_reason}"}}]}}\n\n'
    output_len = generation.output_len
    die_at = faults.die_at if faults.die_at is not None else output_len
    limit = min(die_at, output_len)
    seed = generation.text_seed
    parts: list[str] = []
    if chat:
        parts.append(
            envelope + '[{"index":0,"delta":{"role":"assistant","content":""},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        )
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    watch: DisconnectWatch | None = None
    try:
        if faults.stall > 0:
            await _flush(send, parts)
            watch = DisconnectWatch(receive, generation.close)
            await watch.sleep(faults.stall)
        sent = 0
        while True:
            emitted = min(generation.emitted, limit)
            for index in range(sent, emitted):
                end = last if index == output_len - 1 else middle
                parts.append(head + filler_piece(seed, index) + end)
            sent = emitted
            if sent >= limit or generation.done:
                break
            await _flush(send, parts)
            delivered[0] = sent
            if watch is None:
                watch = DisconnectWatch(receive, generation.close)
            await generation.wait(sent)
            if watch.gone:
                return
        if watch is not None and watch.gone:
            return
        if die_at < output_len:
            await _flush(send, parts)
            delivered[0] = sent
            raise SimulatedCrash
        if request.include_usage:
            usage = json.dumps(_usage(generation, sent), separators=(",", ":"))
            parts.append(f'{envelope}[],"usage":{usage}}}\n\n')
        parts.append(_DONE)
        await send({"type": "http.response.body", "body": "".join(parts).encode()})
        delivered[0] = sent
    finally:
        if watch is not None:
            watch.stop()


def _usage(generation: Generation, completion_tokens: int) -> dict[str, Any]:
    prompt = generation.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": generation.cached_tokens},
    }


async def _flush(send: Send, parts: list[str]) -> None:
    if parts:
        body = "".join(parts).encode()
        parts.clear()
        await send({"type": "http.response.body", "body": body, "more_body": True})
