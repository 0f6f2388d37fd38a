"""One routed request at the edge: admission, the relay, and retries while nothing reached the
client.

`Attempts.run` asks admission (one request/reply), relays to the target and answers the client.
An attempt that fails before anything reached the client in a way another endpoint may not
(connection refused or reset, an answer that is not HTTP, a response-header or first-token
timeout, a 429 or 5xx, a stream that broke before its first byte, a managed engine's 404 for a
model the fleet lists there: `model_unloaded`, which no breaker counts) is retried up to the model's
profile's ``retries``: the retry names the failed attempt's lease (`retry_of`: admission
releases it and decides the retry in one step, so the retry never finds its own session at the
per-session limit) and how it failed (`failed`: the breakers learn it before the retry is
placed; a refused connection opens the endpoint's breaker at once), and excludes every endpoint
already tried, so it may run on the next provider in priority order (the pin stays, or moves if
the failures left its provider degraded). When admission has nowhere else to send it, the
client gets the last upstream failure.

A managed engine's 400 that refuses the request for its context length
(`llmgw.core.context.refused_window`: vLLM's "maximum context length is N tokens", and its
SGLang and llama.cpp kin) means the gateway's count fell short (without a tokenizer it is a lower
bound): the request is retried once more, beside ``retries``, with what the engine said
(`exceeded`: it needs more than that window, so admission places it only where it fits, on a
fallback of a larger window if need be, or refuses it 400 ``context_length_exceeded``); no breaker
counts it, and the engine's own 400 is the client's answer when admission finds nowhere else.

A stream's 200 and headers go to the client only with its first data event (`first_chunk`,
bounded by the ``first_token`` timeout), so a stream that fails before it (headers then nothing,
a reset, garbage, the engine's error event) is retried exactly like a non-streamed request.

Every attempt ends exactly once (`_AttemptEnd`): its lease leaves the edge's table and its
`RequestEnded` (release, sample, usage) is reported, however it ended. A lost lease
(`LeaseStore.expired`) decides the outcome before anything else: `lease_lost`, never retried,
never a breaker's input, never released.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response

from llmgw.contracts import AdmissionUnavailable
from llmgw.core.context import refused_window, requested_output
from llmgw.core.outcomes import REFUSAL_OUTCOMES, Outcome
from llmgw.core.requests import InvalidRequest
from llmgw.core.spend import TokenUse
from llmgw.core.usage import StreamUsage, Usage, usage_in
from llmgw.services.edge.budgets import BudgetHold, BudgetRefused, BudgetUnavailable
from llmgw.services.edge.drain import SHUTDOWN_MESSAGE
from llmgw.services.edge.errors import (
    INTERNAL_ERROR_MESSAGE,
    error_body,
    error_response,
    sse_error_event,
)
from llmgw.services.edge.prompts import NO_PROMPT, PromptChain
from llmgw.services.edge.streamed import StreamedAnswer
from llmgw.services.edge.upstream import (
    LEASE_LOST_MESSAGE,
    StreamReader,
    StreamRelay,
    UpstreamFailure,
    error_message_from_upstream,
    first_chunk,
    loop_deadline,
    names_missing_model,
    open_upstream,
    passthrough_headers,
    read_body,
)
from llmgw.wire import (
    AdmitReply,
    AdmitRequest,
    ContextExceeded,
    FailedAttempt,
    ReplyStatus,
    RequestEnded,
    Target,
    trusted,
)

if TYPE_CHECKING:
    from llmgw.contracts import LeaseHold
    from llmgw.core.budget import Budget
    from llmgw.core.requests import Feature, ParsedRequest
    from llmgw.services.edge.app import Edge
    from llmgw.services.edge.telemetry import RequestRecord

Answer = Response | StreamedAnswer  # what the client gets: a whole response or a stream


class ApiExchange(Protocol):
    """A request of another wire API than the target's path (the Responses API's `Exchange`,
    the Messages API's `MessagesExchange`): what it sends a provider (its own API, or chat
    completions translated), and how the answer is read back, whole or streamed."""

    def upstream(self, target: Target) -> tuple[str, bytes]: ...

    def whole(self, payload: bytes, target: Target) -> tuple[bytes, Usage | None]: ...

    def reader(self, target: Target) -> StreamReader: ...

    def stream_ended(self, reader: StreamReader) -> None: ...

    def chat_form(self) -> tuple[list[Any], list[Any] | None] | None:
        """Its conversation in chat completions form: the messages and tools a translated
        attempt sends (None when it cannot be translated)."""
        ...


log = logging.getLogger("llmgw.edge")

# Failures of the endpoint, not of the request: worth another endpoint while nothing was sent.
_RETRYABLE = frozenset(
    {
        Outcome.UPSTREAM_UNREACHABLE,
        Outcome.UPSTREAM_TIMEOUT,
        Outcome.UPSTREAM_ERROR,
        Outcome.UPSTREAM_BROKEN_STREAM,
        Outcome.MODEL_UNLOADED,  # the engine's 404 for a model the fleet lists there
    }
)
# The provider refused the gateway's own key for it (a key revoked, rotated, or missing): the
# endpoint's failure, never the client's answer (its key is the gateway's business).
_CREDENTIALS_REFUSED = frozenset({401, 403})
_RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504}) | _CREDENTIALS_REFUSED
# Outcomes of an attempt that never reached an upstream (a retry found nowhere else to go).
_ADMISSION_OUTCOMES = frozenset(
    {
        Outcome.NO_CAPACITY,
        Outcome.ADMISSION_UNAVAILABLE,
        Outcome.QUEUE_FULL,
        Outcome.QUEUE_TIMEOUT,
    }
)
# The parameter a refusal names, by the API asked (OpenAI's `param`: where a prompt over the
# context window lies).
_PROMPT_PARAMS = {
    "chat": "messages",
    "messages": "messages",
    "completions": "prompt",
    "responses": "input",
    "embeddings": "input",
}
_REFUSAL_PARAMS = {
    Outcome.MODEL_NOT_FOUND: dict.fromkeys(_PROMPT_PARAMS, "model"),
    Outcome.CONTEXT_LENGTH_EXCEEDED: _PROMPT_PARAMS,
}
_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """What the ingress learned about a request before asking admission."""

    request_id: str
    feature: Feature
    parsed: ParsedRequest
    raw: bytes
    model: str
    session: str | None
    shard: int
    band: str | None
    tenant: str | None
    headers: dict[str, str]  # response headers every answer carries (x-request-id, ...)
    started: float
    client_gone: Callable[[], Awaitable[object]] | None
    record: RequestRecord  # metrics and the access line (llmgw.services.edge.telemetry)
    key: str | None = None  # the API key's id (auth.mode keys)
    key_parallel: int | None = None  # its max_parallel_requests
    key_budget: Budget | None = None  # its budget (llmgw.core.budget)
    # The Responses or Messages API's exchange (services/edge/responses.py, messages.py)
    exchange: ApiExchange | None = None
    # The prompt's chains (services/edge/prompts.py): text, and tokens with a tokenizer
    prompt: PromptChain = NO_PROMPT
    parent: str | None = None  # a sub-agent's parent session (llmgw.core.sessions)


@dataclass(frozen=True, slots=True)
class _Failed:
    """An attempt that failed before anything reached the client (another endpoint may do)."""

    response: Response
    outcome: Outcome
    endpoint: str
    lease: str | None
    failed: FailedAttempt
    exceeded: ContextExceeded | None = None  # a managed engine refused it for its length


class Attempts:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self._ids = itertools.count()

    async def run(self, routed: RoutedRequest) -> tuple[Answer, Outcome | None]:
        """The client's response and outcome; outcome None: a stream that records its own."""
        edge = self.edge
        retries = edge.retries.get(routed.model, 0)
        excluded: list[str] = []
        previous: _Failed | None = None
        # What an engine's refusal for the request's length taught (one such retry at most,
        # beside the profile's `retries`: it is no endpoint's failure).
        exceeded: ContextExceeded | None = None
        # Attempt ids are this edge's own (unique across edges: the edge id is): a client's
        # x-request-id, which two clients may well share, travels beside them for the logs.
        base = f"{edge.edge_id}.{next(self._ids)}"
        attempt = failures = 0
        while True:
            hold: BudgetHold | None = None
            exclude = tuple(excluded)
            if edge.budgets is not None and (edge.budgets.active or routed.key_budget):
                try:
                    hold = await edge.budgets.reserve(
                        routed.tenant,
                        routed.model,
                        routed.parsed.body,
                        key=routed.key,
                        key_budget=routed.key_budget,
                    )
                except (BudgetRefused, BudgetUnavailable) as exc:
                    if previous is not None:
                        return previous.response, previous.outcome
                    refused = isinstance(exc, BudgetRefused)
                    outcome = (
                        Outcome.INSUFFICIENT_QUOTA if refused else Outcome.ADMISSION_UNAVAILABLE
                    )
                    return error_response(
                        outcome,
                        str(exc) if refused else f"The gateway cannot admit requests now: {exc}.",
                        retry_after_s=None if refused else 1,
                        headers=routed.headers,
                    ), outcome
                if hold is not None and hold.no_overflow:
                    exclude += edge.budgets.third_party_endpoints.get(routed.model, ())
            # Built from values checked already (`trusted`: no re-validation per request).
            admit = trusted(
                AdmitRequest,
                id=base if attempt == 0 else f"{base}-{attempt}",
                request_id=routed.request_id,
                edge=edge.edge_id,
                model=routed.model,
                # a Responses or Messages request needs what a chat request needs of the model
                feature="chat" if routed.exchange is not None else routed.feature.value,
                shard=routed.shard,
                stream=routed.parsed.stream,
                session=routed.session,
                parent=routed.parent,
                band=routed.band,
                tenant=routed.tenant,
                key=routed.key,
                key_parallel=routed.key_parallel,
                exclude=exclude,
                retry_of=previous.lease if previous is not None else None,
                failed=previous.failed if previous is not None else None,
                no_overflow=hold is not None and hold.no_overflow,
                prefix=routed.prompt.text,
                prompt_bytes=routed.prompt.length,
                tokens=routed.prompt.tokens,
                prompt_tokens=routed.prompt.token_count,
                token_block=routed.prompt.token_block,
                max_output=requested_output(routed.parsed.body),
                exceeded=exceeded,
            )
            asked = time.perf_counter()
            try:
                reply, client_left = await edge.admission.admit(admit, routed.client_gone)
            except AdmissionUnavailable as exc:
                if hold is not None:
                    hold.release()
                if previous is not None:
                    return previous.response, previous.outcome
                return error_response(
                    Outcome.ADMISSION_UNAVAILABLE,
                    f"The gateway cannot admit requests right now: {exc.message}.",
                    retry_after_s=1,
                    headers=routed.headers,
                ), Outcome.ADMISSION_UNAVAILABLE
            finally:
                edge.metrics.admission_duration.observe(time.perf_counter() - asked)
            if reply.status is not ReplyStatus.ADMITTED or reply.target is None:
                if hold is not None:
                    hold.release()
                outcome = (
                    Outcome.NO_CAPACITY
                    if reply.refusal is None
                    else REFUSAL_OUTCOMES.get(reply.refusal, Outcome.NO_CAPACITY)
                )
                if outcome is Outcome.CLIENT_DISCONNECTED:
                    return Response(status_code=499), outcome
                if previous is not None and outcome in _ADMISSION_OUTCOMES:
                    return previous.response, previous.outcome
                return error_response(
                    outcome,
                    reply.message or "The request was not admitted.",
                    param=_REFUSAL_PARAMS.get(outcome, {}).get(routed.feature.value),
                    retry_after_s=reply.retry_after,
                    headers=routed.headers,
                ), outcome
            ending = _AttemptEnd(edge, routed, admit, reply)
            if hold is not None:
                hold.admitted(third_party=reply.target.provider_kind == "unlimited")
                ending.budget = hold
            if client_left:  # a grant that crossed the cancel: give it back now
                ending.finish(Outcome.CLIENT_DISCONNECTED, sent=False)
                return Response(status_code=499), Outcome.CLIENT_DISCONNECTED
            try:
                result = await self._attempt(routed, reply, ending)
            except Exception:
                # The gateway itself failed (a bug): the attempt still ends, so its lease is
                # released and nothing stays held for a request that is over.
                log.exception("unexpected error in attempt %s", admit.id)
                ending.finish(Outcome.INTERNAL_ERROR)
                return error_response(
                    Outcome.INTERNAL_ERROR,
                    INTERNAL_ERROR_MESSAGE,
                    headers=routed.headers,
                ), Outcome.INTERNAL_ERROR
            if not isinstance(result, _Failed):
                return result
            if result.exceeded is not None:
                if exceeded is not None:  # its one retry for its length was spent
                    return result.response, result.outcome
                exceeded = result.exceeded
            else:
                failures += 1
                if failures > retries:
                    return result.response, result.outcome
            previous = result
            excluded.append(result.endpoint)
            edge.metrics.retries.labels(result.outcome.value).inc()
            routed.record.retries += 1
            attempt += 1

    async def _attempt(
        self, routed: RoutedRequest, reply: AdmitReply, ending: _AttemptEnd
    ) -> tuple[Answer, Outcome | None] | _Failed:
        edge = self.edge
        target = reply.target
        assert target is not None
        headers = dict(routed.headers)
        if reply.route is not None:
            headers["x-llmgw-route"] = reply.route
        if reply.served_model is not None and reply.served_model != routed.model:
            headers["x-llmgw-fallback-from"] = routed.model
        headers["x-llmgw-provider"] = target.provider
        headers["x-llmgw-endpoint"] = target.endpoint
        parsed = routed.parsed
        exchange = routed.exchange
        inject_usage = (
            edge.inject_usage and parsed.stream and not parsed.include_usage and exchange is None
        )
        body, raw = parsed.body, routed.raw
        path = _PATHS[routed.feature.value]
        rewrite = exchange is None and (
            inject_usage or parsed.model != target.upstream_model or target.priority is not None
        )
        if exchange is not None:
            try:
                path, raw = exchange.upstream(target)
            except InvalidRequest as exc:  # what this provider's wire API cannot express
                ending.finish(Outcome.BAD_REQUEST, sent=False)
                return error_response(
                    Outcome.BAD_REQUEST, exc.message, param=exc.param, headers=headers
                ), Outcome.BAD_REQUEST
        elif rewrite:
            body = dict(body)
            if inject_usage:  # ask for usage anyway; the usage event is removed on the way back
                body["stream_options"] = {
                    **(body.get("stream_options") or {}),
                    "include_usage": True,
                }
            body["model"] = target.upstream_model
            if target.priority is not None:
                body["priority"] = target.priority
            raw = json.dumps(body).encode()
        url = target.url.rstrip("/") + path
        timeouts = edge.timeouts_for(routed.model)
        deadline = loop_deadline(timeouts.total)
        ending.upstream_started = time.perf_counter()
        hold = ending.hold
        task = asyncio.current_task()
        if hold is not None and task is not None:
            hold.on_lost = task.cancel  # until the answer's headers: a cut or loss stops the wait
        try:
            upstream = await open_upstream(
                edge.deps.upstream,
                url,
                raw,
                edge.upstream_headers_for(routed, target.provider),
                timeouts,
            )
        except UpstreamFailure as failure:
            ending.refused = failure.refused
            return self._failure(ending, failure.outcome, failure.message, headers)
        except asyncio.CancelledError:
            if hold is None or not (hold.cut_short or hold.lost) or task is None:
                raise
            task.uncancel()
            return self._failure(ending, Outcome.UPSTREAM_UNREACHABLE, "", headers)
        if ending.hold is not None:
            ending.hold.on_lost = upstream.close  # a lost lease cancels the upstream request
        upstream_headers = {**passthrough_headers(upstream), **headers}
        if upstream.status != 200:
            ending.status = upstream.status
            ending.retry_after = _retry_after(upstream.headers.get("retry-after"))
            try:
                payload = await read_body(upstream, deadline)
            except UpstreamFailure as failure:
                return self._failure(ending, failure.outcome, failure.message, headers)
            refused = upstream.status in _CREDENTIALS_REFUSED
            if (
                upstream.status == 404
                and target.provider_kind == "managed"
                and names_missing_model(payload)
            ):
                # The fleet lists the model there and the engine no longer serves it (an
                # adapter unloaded since its list was read): another endpoint may; the engine's
                # own 404 is the client's answer when none does.
                response = Response(payload, status_code=404, headers=upstream_headers)
                return self._failure(ending, Outcome.MODEL_UNLOADED, "", headers, response)
            if (
                upstream.status == 400
                and target.provider_kind == "managed"
                and (window := refused_window(payload)) is not None
            ):
                # Too long for this engine after all (the gateway's count is a lower bound
                # without a tokenizer): retried once, placed only where it needs less than a
                # window holds; the engine's own 400 is the client's answer when none is found.
                ending.exceeded = ContextExceeded(
                    endpoint=target.endpoint,
                    model=reply.served_model or routed.model,
                    window=window or None,
                )
                response = Response(payload, status_code=400, headers=upstream_headers)
                return self._failure(ending, Outcome.CONTEXT_LENGTH_EXCEEDED, "", headers, response)
            if upstream.status < 500 and upstream.status != 429 and not refused:
                # The engine judged the request itself (e.g. prompt too long): its answer is the
                # client's answer.
                ending.finish(Outcome.BAD_REQUEST)
                return Response(
                    payload, status_code=upstream.status, headers=upstream_headers
                ), Outcome.BAD_REQUEST
            message = error_message_from_upstream(payload, upstream.status)
            if refused:
                message = (
                    f"The provider {target.provider!r} refused the gateway's credentials "
                    f"({upstream.status}): {message}"
                )
            response = Response(
                error_body(
                    message,
                    "upstream_error",
                    "upstream_error",
                ),
                status_code=upstream.status if upstream.status in (429, 503) else 502,
                headers=upstream_headers,
                media_type="application/json",
            )
            return self._failure(ending, Outcome.UPSTREAM_ERROR, "", headers, response)
        if not parsed.stream:
            try:
                payload = await read_body(upstream, deadline)
            except UpstreamFailure as failure:
                return self._failure(ending, failure.outcome, failure.message, headers)
            if exchange is not None:
                try:
                    payload, ending.usage = exchange.whole(payload, target)
                except ValueError:
                    return self._failure(
                        ending,
                        Outcome.UPSTREAM_ERROR,
                        "The upstream's response is not a JSON object.",
                        headers,
                    )
            else:
                ending.usage = usage_in(payload)
            if edge.spend is not None and edge.spend_header and ending.usage is not None:
                served = reply.served_model or routed.model
                use = ending.usage
                picos = edge.spend.prices.cost(
                    target.provider,
                    served,
                    TokenUse(use.input_tokens, use.cached_tokens, use.output_tokens),
                )
                upstream_headers["x-llmgw-cost"] = edge.spend.cost_header(picos)
            # The lease ends (and RequestEnded is reported) once the answer is on its way.
            routed.record.when_sent(lambda: ending.finish(Outcome.SUCCESS))
            return Response(payload, status_code=200, headers=upstream_headers), Outcome.SUCCESS
        try:
            first = await first_chunk(upstream, timeouts, deadline)
        except UpstreamFailure as failure:
            ending.status = failure.status  # an error event in place of the first token
            return self._failure(ending, failure.outcome, failure.message, headers)
        routed.record.first_token = time.perf_counter()
        annotate = None
        if exchange is None and edge.spend is not None and edge.spend_header and not inject_usage:
            # The client asked for usage: its usage chunk also says what the attempt cost.
            annotate = edge.spend.usage_fields(target.provider, reply.served_model or routed.model)
        usage: StreamReader = (
            exchange.reader(target)
            if exchange is not None
            else StreamUsage(remove=inject_usage, annotate=annotate)
        )
        relay = StreamRelay(
            upstream,
            first,
            timeouts,
            deadline,
            lease_lost=lambda: hold is not None and edge.leases.expired(hold),
            usage=usage,
        )
        telemetry = edge.telemetry

        def end_once() -> None:
            if ending.ended:
                return
            ending.usage = usage.usage
            ending.relayed = usage.events  # what a stream cut short is billed on
            if exchange is not None:
                exchange.stream_ended(usage)
            outcome = relay.outcome
            if hold is not None and hold.cut_short and outcome is not Outcome.SUCCESS:
                outcome = Outcome.SHUTTING_DOWN
            ending.finish(outcome)
            telemetry.ended(routed.record, outcome, 200)

        async def body_then_finish() -> Any:
            try:
                async for chunk in relay:
                    if hold is not None and hold.cut_short:  # the drain deadline closed it
                        yield sse_error_event(SHUTDOWN_MESSAGE, Outcome.SHUTTING_DOWN.value)
                        break
                    yield chunk
            finally:
                end_once()

        upstream_headers.setdefault("content-type", "text/event-stream")
        upstream_headers["cache-control"] = "no-cache"
        return StreamedAnswer(
            body_then_finish(), end_once, upstream, headers=upstream_headers
        ), None

    def _failure(
        self,
        ending: _AttemptEnd,
        outcome: Outcome,
        message: str,
        headers: dict[str, str],
        response: Response | None = None,
    ) -> tuple[Response, Outcome] | _Failed:
        """An attempt that failed before the client got anything: lease_lost if the lease is
        gone (first: nothing else counts then), a retry if the failure is the endpoint's."""
        if ending.hold is not None and self.edge.leases.expired(ending.hold):
            ending.finish(Outcome.LEASE_LOST)
            return error_response(
                Outcome.LEASE_LOST, LEASE_LOST_MESSAGE, headers=headers
            ), Outcome.LEASE_LOST
        if (
            ending.hold is not None and ending.hold.cut_short
        ):  # the drain deadline, not the endpoint
            ending.finish(Outcome.SHUTTING_DOWN)
            return error_response(
                Outcome.SHUTTING_DOWN, SHUTDOWN_MESSAGE, headers=headers
            ), Outcome.SHUTTING_DOWN
        ending.finish(outcome)
        if response is None:
            response = error_response(outcome, message, headers=headers)
        # An upstream error is retried for a 429 or 5xx, or when the answer was not HTTP at all
        # (no status); another 4xx judged the request itself.
        retryable = ending.exceeded is not None or (
            outcome in _RETRYABLE
            and (
                outcome is not Outcome.UPSTREAM_ERROR
                or ending.status is None
                or ending.status in _RETRYABLE_STATUSES
            )
        )
        if not retryable:
            return response, outcome
        assert ending.reply.target is not None
        return _Failed(
            response,
            outcome,
            ending.reply.target.endpoint,
            ending.reply.lease.lease_id if ending.reply.lease is not None else None,
            FailedAttempt(
                attempt=ending.admit.id,
                endpoint=ending.reply.target.endpoint,
                outcome=outcome.value,
                status=ending.status,
                retry_after=ending.retry_after,
                refused=ending.refused,
            ),
            ending.exceeded,
        )


class _AttemptEnd:
    """What happens once when an admitted attempt ends, however it ends: its lease leaves the
    edge's table (released by the owner on the RequestEnded, unless lost) and one RequestEnded
    is reported (release, sample, usage, breaker evidence)."""

    __slots__ = (
        "admit",
        "budget",
        "edge",
        "ended",
        "exceeded",
        "hold",
        "refused",
        "relayed",
        "reply",
        "retry_after",
        "routed",
        "status",
        "upstream_started",
        "usage",
    )

    def __init__(
        self, edge: Edge, routed: RoutedRequest, admit: AdmitRequest, reply: AdmitReply
    ) -> None:
        self.edge = edge
        self.routed = routed
        self.admit = admit
        self.reply = reply
        self.hold: LeaseHold | None = (
            edge.leases.hold(reply.lease) if reply.lease is not None else None
        )
        self.ended = False
        self.upstream_started: float | None = None
        self.status: int | None = None
        self.retry_after: float | None = None
        self.refused = False  # the endpoint refused the connection (its breaker opens at once)
        self.exceeded: ContextExceeded | None = None  # the engine refused it for its length
        self.usage: Usage | None = None
        self.relayed = 0  # a stream's data events relayed (its output, if it has no usage)
        self.budget: BudgetHold | None = None  # its budget reservations, settled at its end

    def finish(self, outcome: Outcome, *, sent: bool | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        edge = self.edge
        lease_id: str | None = None
        if self.hold is not None:
            lost = self.hold.lost
            edge.leases.end(self.hold)
            if not lost:
                lease_id = self.hold.record.lease_id
        target: Target | None = self.reply.target
        assert target is not None
        ok = outcome is Outcome.SUCCESS
        usage = self.usage if ok else None
        reached = self.upstream_started is not None if sent is None else sent
        edge.reporter.report(
            trusted(  # this edge's own values: no re-validation
                RequestEnded,
                id=self.admit.id,
                request_id=self.routed.request_id,
                edge=edge.edge_id,
                lease=lease_id,
                shard=self.reply.lease.shard if self.reply.lease is not None else None,
                refresh=self.reply.refresh and ok,
                ok=ok,
                outcome=outcome.value,
                model=self.routed.model,
                served_model=self.reply.served_model,
                provider=target.provider,
                endpoint=target.endpoint,
                route=self.reply.route,
                tenant=self.routed.tenant,
                key=self.routed.key,
                ended_at=time.time(),
                latency=time.perf_counter() - self.upstream_started
                if self.upstream_started is not None
                else 0.0,
                sent=reached and outcome is not Outcome.LEASE_LOST,
                input_tokens=usage.input_tokens if usage else 0,
                output_tokens=usage.output_tokens if usage else 0,
                status=self.status,
                retry_after=self.retry_after,
                refused=self.refused,
            )
        )
        self.routed.record.attempt_ended(
            target.provider, target.endpoint, self.reply.route, self.reply.served_model, usage
        )
        picos = 0
        if edge.spend is not None:
            routed = self.routed
            picos = edge.spend.attempt_ended(
                key=routed.key,
                tenant=routed.tenant,
                provider=target.provider,
                model=self.reply.served_model or routed.model,
                usage=self.usage,
                relayed=self.relayed,
                body=routed.parsed.body,
                chat=routed.feature.value == "chat",
                route=self.reply.route,
            )
        if self.budget is not None:
            self.budget.settle(picos, third_party=target.provider_kind == "unlimited")


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the delta-seconds form; an HTTP date is ignored)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds <= 3600 else None
