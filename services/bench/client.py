"""Sends one planned request over aiohttp and records how it went (never raises for the server).

aiohttp rather than httpx: an httpx-based generator saturates before the gateway does
(docs/benchmarks.md). Every outcome becomes a `RequestRecord`: a non-2xx status is an ``http``
error keyed by its status; a refused or broken connection ``connection``; no complete response
within the timeout ``timeout``; a body cut short or a stream without ``[DONE]`` ``incomplete``;
an error object inside a stream ``stream_error``; a 2xx body that is not a completion
``bad_response``. The reply text is returned for successes so a conversation can resend it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from llmgw.services.bench.protocol import SseDecoder, chunk_text, request_body, request_headers
from llmgw.services.bench.stats import RequestRecord
from llmgw.services.bench.workload import RequestPlan

__all__ = ["RequestOptions", "fetch_model", "send"]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How every request of a run is sent."""

    url: str
    model: str
    api: str = "chat"
    stream: bool = True
    band_header: str = "x-llmgw-band"
    session_header: str = "x-session-id"
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    extra_headers: Mapping[str, str] = field(default_factory=dict)


DETAIL_CHARS = 200


class _Failed(Exception):
    def __init__(self, kind: str, detail: str | None = None) -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


@dataclass(slots=True)
class _Outcome:
    status: int | None = None
    first_token: float | None = None
    chunks: int = 0
    text: list[str] = field(default_factory=list)
    usage: Mapping[str, Any] | None = None


async def send(
    session: aiohttp.ClientSession,
    plan: RequestPlan,
    options: RequestOptions,
    clock: Clock,
) -> tuple[RequestRecord, str | None]:
    """Send `plan`; (its record, the reply text or None when it failed)."""
    body = request_body(
        plan, model=options.model, api=options.api, stream=options.stream, extra=options.extra_body
    )
    headers = request_headers(
        plan,
        band_header=options.band_header,
        session_header=options.session_header,
        extra=options.extra_headers,
    )
    payload = json.dumps(body).encode()
    outcome = _Outcome()
    start = clock()
    error: str | None = None
    detail: str | None = None
    try:
        async with session.post(options.url, data=payload, headers=headers) as response:
            outcome.status = response.status
            if response.status >= 300:
                raise _Failed("http", _error_message(await response.read()))
            if options.stream:
                await _read_stream(response, outcome, clock)
            else:
                await _read_whole(response, outcome)
    except _Failed as failed:
        error, detail = failed.kind, failed.detail
    except TimeoutError:
        error = "timeout"
    except aiohttp.ClientPayloadError as exc:
        error, detail = "incomplete", _short(str(exc) or type(exc).__name__)
    except (aiohttp.ClientError, OSError) as exc:
        error = "connection" if outcome.status is None else "incomplete"
        detail = _short(str(exc) or type(exc).__name__)
    except asyncio.CancelledError:
        raise
    end = clock()
    usage = outcome.usage or {}
    completion = usage.get("completion_tokens")
    if isinstance(completion, bool) or not isinstance(completion, int):
        completion = None  # absent, or not a count
    usage_ok = completion is not None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    prompt = usage.get("prompt_tokens")
    record = RequestRecord(
        index=plan.index,
        start=start,
        end=end,
        status=outcome.status,
        error=error,
        stream=options.stream,
        first_token=outcome.first_token if error is None else None,
        output_tokens=completion if completion is not None else outcome.chunks,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        usage_reported=usage_ok,
        band=plan.band,
        session_id=plan.session_id,
        turn=plan.turn,
        detail=detail,
    )
    return record, ("".join(outcome.text) if error is None else None)


async def _read_stream(response: aiohttp.ClientResponse, outcome: _Outcome, clock: Clock) -> None:
    decoder = SseDecoder()
    done = False
    async for raw in response.content.iter_any():
        for data in decoder.feed(raw):
            done = done or _stream_event(data, outcome, clock)
    for data in decoder.close():
        done = done or _stream_event(data, outcome, clock)
    if not done:
        raise _Failed("incomplete")


def _stream_event(data: str, outcome: _Outcome, clock: Clock) -> bool:
    """Handle one SSE data payload; True for ``[DONE]``."""
    if data.strip() == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        raise _Failed("bad_response") from None
    if not isinstance(chunk, dict):
        raise _Failed("bad_response")
    if "error" in chunk:
        raise _Failed("stream_error", _error_message(data.encode()))
    text = chunk_text(chunk)
    if text:
        if outcome.first_token is None:
            outcome.first_token = clock()
        outcome.chunks += 1
        outcome.text.append(text)
    if isinstance(chunk.get("usage"), dict):
        outcome.usage = chunk["usage"]
    return False


async def _read_whole(response: aiohttp.ClientResponse, outcome: _Outcome) -> None:
    raw = await response.read()
    try:
        body = json.loads(raw)
    except ValueError:
        raise _Failed("bad_response", _error_message(raw)) from None
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise _Failed("bad_response", _error_message(raw))
    text = chunk_text(body)
    outcome.text.append(text)
    # Without usage, the token count is estimated at 4 characters per token.
    outcome.chunks = max(1, round(len(text) / 4)) if text else 0
    if isinstance(body.get("usage"), dict):
        outcome.usage = body["usage"]


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _error_message(raw: bytes) -> str | None:
    """The ``error.message`` of an OpenAI error body, else the body's start; None if empty."""
    text = raw.decode("utf-8", errors="replace")
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return _short(message)
    except (ValueError, AttributeError):
        pass
    return _short(text) if text.strip() else None


async def fetch_model(
    session: aiohttp.ClientSession, models_url: str, headers: Mapping[str, str] | None = None
) -> str:
    """The first model id of ``GET /v1/models``; ValueError (with the reason) otherwise."""
    try:
        async with session.get(models_url, headers=dict(headers or {})) as response:
            raw = await response.read()
            if response.status != 200:
                raise ValueError(f"{models_url} answered {response.status}")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ValueError(f"cannot reach {models_url}: {exc or type(exc).__name__}") from None
    try:
        data = json.loads(raw)["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{models_url} lists no model") from None
