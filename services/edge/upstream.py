"""Relaying one admitted request to its upstream endpoint.

One pool of keep-alive connections per edge process (`llmgw.services.edge.http_client`: a lean
HTTP/1.1 client; httpx's default transport collapses under concurrency and aiohttp costs ~2.5x
the CPU, see docs/benchmarks.md). Timeouts are phases,
not one number (the config's `Timeouts`): dial, response headers, first
streamed chunk, idle gap between chunks, and total. Each ends the request
with a clear error. A stream's first chunk is read before anything is sent to
the client (`first_chunk`: up to its first complete data event, which must be a
server-sent event and not the engine's error), so a stream that fails before its
first byte (headers then nothing, a reset, garbage, an error event) is retried
like any other request; once the client has its 200, a failure is an SSE error
event before the close.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from llmgw.clock import SYSTEM, Clock
from llmgw.core.outcomes import Outcome
from llmgw.core.sse import StartKind, stream_start
from llmgw.core.usage import Usage
from llmgw.services.edge.errors import sse_error_event
from llmgw.services.edge.http_client import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

if TYPE_CHECKING:
    from llmgw.config.schema import Timeouts

_DONE_MARKER = b"data: [DONE]"
LEASE_LOST_MESSAGE = (
    "The gateway lost this request's capacity lease (it could not be renewed in time); "
    "the request was ended. Retry it."
)
_HOP_HEADERS = {"content-type", "retry-after", "x-request-id"}


class StreamReader(Protocol):
    """What follows a stream on its way to the client: `feed` and `finish` return the bytes to
    forward (`llmgw.core.usage.StreamUsage`, the Responses and Messages APIs' readers). A reader
    that says `completed` ended the stream well without ``[DONE]`` (their streams have none)."""

    usage: Usage | None
    # The upstream's output events read so far (one per token for most engines; a stream cut
    # short before its usage is billed on them, llmgw.core.spend.billed_use).
    events: int

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class UpstreamFailure(Exception):
    """The upstream call failed before anything reached the client."""

    def __init__(
        self, outcome: Outcome, message: str, status: int | None = None, *, refused: bool = False
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.status = status  # an error the engine sent inside a 200 stream: its code
        self.refused = refused  # no connection could be made: nothing serves there


def new_pool(timeouts: Timeouts, clock: Clock = SYSTEM) -> UpstreamPool:
    """The edge's one upstream pool: keep-alive connections, dialled within ``timeouts.dial``."""
    return UpstreamPool(dial=timeouts.dial, keepalive=30.0, clock=clock)


async def open_upstream(
    pool: UpstreamPool,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeouts: Timeouts,
) -> UpstreamResponse:
    """POST and wait for the response headers; raises UpstreamFailure.

    No connection at all (refused, no such host, dial timeout) is UPSTREAM_UNREACHABLE with
    `refused` set: nothing serves there, the endpoint's breaker opens at once. A connection that
    broke before the headers (reset, closed) is UPSTREAM_UNREACHABLE too, an ordinary breaker
    failure (a pooled keep-alive connection the server had just closed looks the same). A
    response that is not HTTP is UPSTREAM_ERROR without a status. All are retryable."""
    try:
        return await pool.post(url, body, headers, within=timeouts.response_header)
    except UpstreamConnectError as exc:
        raise UpstreamFailure(
            Outcome.UPSTREAM_UNREACHABLE,
            f"The upstream endpoint is unreachable: {exc}",
            refused=True,
        ) from None
    except UpstreamTimeout:
        raise UpstreamFailure(
            Outcome.UPSTREAM_TIMEOUT,
            f"The upstream did not send response headers within {timeouts.response_header:g}s.",
        ) from None
    except UpstreamBrokenError as exc:
        if exc.not_http:
            raise UpstreamFailure(
                Outcome.UPSTREAM_ERROR, f"The upstream request failed: {exc}"
            ) from None
        raise UpstreamFailure(
            Outcome.UPSTREAM_UNREACHABLE,
            f"The upstream connection broke before the response: {exc}",
        ) from None


def passthrough_headers(response: UpstreamResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k in _HOP_HEADERS}


async def read_body(response: UpstreamResponse, deadline: float) -> bytes:
    """The whole (non-streamed) body, bounded by the total deadline."""
    try:
        return await response.read(deadline)
    except UpstreamTimeout:
        raise UpstreamFailure(
            Outcome.UPSTREAM_TIMEOUT, "The upstream did not finish the response in time."
        ) from None
    except UpstreamBrokenError as exc:
        raise UpstreamFailure(
            Outcome.UPSTREAM_BROKEN_STREAM, f"The upstream connection broke: {exc}"
        ) from None
    finally:
        response.release()


def loop_deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def first_chunk(response: UpstreamResponse, timeouts: Timeouts, deadline: float) -> bytes:
    """The stream's bytes up to and including its first data event (`llmgw.core.sse`), within
    ``first_token`` (and the total deadline); raises UpstreamFailure when it does not come, is
    not a server-sent event or is the engine's error (nothing has reached the client yet:
    retryable)."""
    now = asyncio.get_running_loop().time()
    budget = min(timeouts.first_token, deadline - now)
    until = now + max(budget, 0)
    received = b""
    try:
        while True:
            chunk = await response.readany(until)
            if not chunk:
                raise UpstreamFailure(
                    Outcome.UPSTREAM_BROKEN_STREAM,
                    "The upstream ended the stream before it began.",
                )
            received += chunk
            verdict = stream_start(received)
            if verdict.kind is StartKind.STARTED:
                return received
            if verdict.kind is StartKind.ERROR:
                raise UpstreamFailure(
                    Outcome.UPSTREAM_ERROR, verdict.message or "", verdict.status or 502
                )
            if verdict.kind is StartKind.GARBAGE:
                raise UpstreamFailure(
                    Outcome.UPSTREAM_BROKEN_STREAM,
                    f"The upstream's stream is malformed ({verdict.message}).",
                )
    except UpstreamTimeout:
        response.close()
        raise UpstreamFailure(
            Outcome.UPSTREAM_TIMEOUT, f"The upstream sent no first token within {budget:g}s."
        ) from None
    except UpstreamBrokenError as exc:
        response.close()
        raise UpstreamFailure(
            Outcome.UPSTREAM_BROKEN_STREAM, f"The upstream stream broke before it began: {exc}"
        ) from None
    except UpstreamFailure:
        response.close()
        raise


class StreamRelay:
    """Relays an SSE body chunk by chunk, without buffering, and records how it ended.

    Starts with `first` (already read by `first_chunk`). `outcome` is SUCCESS only when the
    upstream's stream ended with `data: [DONE]`. Any other ending (timeout, broken connection,
    a cut without [DONE], a lost lease) sends one SSE error event and records the failure; a
    lost lease (`lease_lost()`, checked first) is reported as such, whatever else happened.
    """

    def __init__(
        self,
        response: UpstreamResponse,
        first: bytes,
        timeouts: Timeouts,
        deadline: float,
        lease_lost: Callable[[], bool] = lambda: False,
        usage: StreamReader | None = None,
    ) -> None:
        self._response = response
        self._first = first
        self._usage = usage
        self._lease_lost = lease_lost
        self._timeouts = timeouts
        self._deadline = deadline
        self.outcome = Outcome.CLIENT_DISCONNECTED  # until the stream ends by itself
        self.first_chunk_at: float | None = None

    def drained(self) -> bool:
        """Whether the upstream sent all it will and the relay has read it: what it yields from
        now on comes without waiting (the rest of the last read, and how the stream ended)."""
        return self._response.drained()

    def _lost(self) -> bytes:
        self.outcome = Outcome.LEASE_LOST
        return sse_error_event(LEASE_LOST_MESSAGE, "lease_lost")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        response = self._response
        tail = b""
        chunk: bytes | None = self._first
        self.first_chunk_at = time.perf_counter()
        try:
            while True:
                if chunk is None:
                    now = asyncio.get_running_loop().time()
                    budget = min(self._timeouts.idle, self._deadline - now)
                    try:
                        chunk = await response.readany(now + max(budget, 0))
                    except UpstreamTimeout:
                        if self._lease_lost():
                            yield self._lost()
                            return
                        self.outcome = Outcome.UPSTREAM_TIMEOUT
                        yield sse_error_event(
                            f"The upstream sent no next token within {budget:g}s; "
                            "the request was ended.",
                            "upstream_timeout",
                        )
                        return
                    except UpstreamBrokenError as exc:
                        if self._lease_lost():
                            yield self._lost()
                            return
                        self.outcome = Outcome.UPSTREAM_BROKEN_STREAM
                        yield sse_error_event(
                            f"The upstream stream broke: {exc}", "upstream_broken_stream"
                        )
                        return
                    if not chunk:
                        break
                tail = (tail + chunk)[-32:]
                if self._usage is not None:
                    chunk = self._usage.feed(chunk)
                if chunk:
                    yield chunk
                chunk = None
            if self._usage is not None and (rest := self._usage.finish()):
                yield rest
            if self._lease_lost():
                yield self._lost()
            elif _DONE_MARKER in tail or getattr(self._usage, "completed", False):
                self.outcome = Outcome.SUCCESS
            else:
                self.outcome = Outcome.UPSTREAM_BROKEN_STREAM
                yield sse_error_event(
                    "The upstream ended the stream before it was complete.",
                    "upstream_broken_stream",
                )
        finally:
            if self.outcome is Outcome.SUCCESS:
                self._response.release()  # back to the pool
            else:
                self._response.close()  # the connection's state is unknown


_NOT_FOUND_TYPES = frozenset({"NotFoundError", "not_found_error", "invalid_request_error"})


def names_missing_model(body: bytes) -> bool:
    """Whether a 404's body says the engine does not serve the request's model: OpenAI's code
    ``model_not_found``, vLLM's and SGLang's ``NotFoundError`` (``param`` ``model``, or a message
    naming the model: "The model `x` does not exist."), or Anthropic's ``not_found_error`` of a
    Messages API engine. Not a 404 of a path the engine does not serve."""
    try:
        value = json.loads(body)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    error = value.get("error")
    detail = error if isinstance(error, dict) else value
    if detail.get("code") == "model_not_found" or detail.get("param") == "model":
        return True
    message = detail.get("message")
    return (
        detail.get("type") in _NOT_FOUND_TYPES
        and isinstance(message, str)
        and "model" in message.lower()
    )


def error_message_from_upstream(body: bytes, status: int) -> str:
    """The upstream's own error message when it sent an OpenAI-shaped error."""
    try:
        message = json.loads(body)["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return f"The upstream answered with status {status}."
