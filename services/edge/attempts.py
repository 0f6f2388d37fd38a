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

Every attempt ends exactly once (`AttemptEnd`): its lease leaves the edge's table and its
`RequestEnded` (release, sample, usage) is reported, however it ended. A lost lease
(`LeaseStore.expired`) decides the outcome before anything else: `lease_lost`, never retried,
never a breaker's input, never released.

An attempt goes in steps, each a function of its own: admit (`admit_request` is what admission
is asked, `not_admitted` the answer to its refusal), send (`upstream_request`: the path and body
sent), classify (`classify`: what an answer other than 200 means; `retryable`: whether a failure
is the endpoint's), finish (`whole_answer`, `streamed_answer`, and `AttemptEnd`); `Tries` decides
whether another attempt follows a failed one. `Attempts.run` and `Attempts._attempt` only await
the ports between them (the budget guard, admission, the upstream). What an attempt uses of the
edge is a frozen `AttemptDeps`, made anew for each config the edge follows.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response

from llmgw.clock import SYSTEM, Clock
from llmgw.contracts import AdmissionUnavailable
from llmgw.core.context import refused_window, requested_output
from llmgw.core.outcomes import REFUSAL_OUTCOMES, Outcome
from llmgw.core.records import record
from llmgw.core.requests import InvalidRequest
from llmgw.core.spend import TokenUse
from llmgw.core.usage import StreamUsage, Usage, usage_in
from llmgw.logs import REQUEST_ID_HEADER
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
    from llmgw.config.schema import Timeouts
    from llmgw.contracts import AdmissionClient, LeaseHold, LeaseStore, RequestReporter
    from llmgw.core.budget import Budget
    from llmgw.core.requests import Feature, ParsedRequest
    from llmgw.services.edge.budgets import BudgetGuard
    from llmgw.services.edge.http_client import UpstreamPool, UpstreamResponse
    from llmgw.services.edge.metrics import EdgeMetrics
    from llmgw.services.edge.spend import SpendBook
    from llmgw.services.edge.telemetry import EdgeTelemetry, RequestRecord

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


@record
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
class AttemptDeps:
    """What an attempt uses of the edge: its ports and parts, and what it reads of the config
    the edge runs on. Frozen: the edge makes a new one for each config it follows
    (`Edge.follow_config`); an attempt is sent on the one current once it is admitted."""

    edge_id: str
    admission: AdmissionClient
    leases: LeaseStore[Any]  # end and expired take the holds it made
    reporter: RequestReporter
    upstream: UpstreamPool
    metrics: EdgeMetrics
    telemetry: EdgeTelemetry
    spend: SpendBook | None
    budgets: BudgetGuard | None
    inject_usage: bool  # router.inject_usage (read at start)
    spend_header: bool  # spend.cost_header
    retries: Mapping[str, int]  # by model: its profile's retries
    timeouts: Mapping[str, Timeouts]  # by model: its profile's timeouts
    default_timeouts: Timeouts
    provider_headers: Mapping[str, dict[str, str]]  # by provider: its upstream headers (its key)
    clock: Clock = SYSTEM  # the edge's one clock (an end's stamp)

    def timeouts_for(self, model: str) -> Timeouts:
        return self.timeouts.get(model, self.default_timeouts)

    def upstream_headers_for(self, routed: RoutedRequest, provider: str) -> dict[str, str]:
        """The headers of an upstream call: the provider's, the client's request id, and with
        tracing the attempt's ``traceparent`` (its upstream span starts here)."""
        # A provider an applied config added reaches admission first: until this edge runs
        # on that config too, its calls carry no key of its own.
        own = self.provider_headers.get(provider, _JSON)
        headers = {**own, REQUEST_ID_HEADER: routed.request_id}
        return self.telemetry.upstream_headers(routed.record, headers)


_JSON = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class Failed:
    """An attempt that failed before anything reached the client (another endpoint may do)."""

    response: Response
    outcome: Outcome
    endpoint: str
    lease: str | None
    failed: FailedAttempt
    exceeded: ContextExceeded | None = None  # a managed engine refused it for its length


class Attempts:
    """A routed request's attempts, in steps: admit (`admit_request`, the reply read by
    `not_admitted`), send (`upstream_request`), classify (`classify`, `retryable`), finish
    (`whole_answer`, `streamed_answer`, `AttemptEnd`); `Tries` decides whether another
    follows one that failed."""

    def __init__(self, deps: AttemptDeps) -> None:
        self.deps = deps  # replaced (never changed) at each config the edge follows
        self._ids = itertools.count()

    async def run(self, routed: RoutedRequest) -> tuple[Answer, Outcome | None]:
        """The client's response and outcome; outcome None: a stream that records its own."""
        # Attempt ids are this edge's own (unique across edges: the edge id is): a client's
        # x-request-id, which two clients may well share, travels beside them for the logs.
        tries = Tries(
            f"{self.deps.edge_id}.{next(self._ids)}", self.deps.retries.get(routed.model, 0)
        )
        while True:
            deps = self.deps
            hold: BudgetHold | None = None
            exclude = tries.excluded
            budgets = deps.budgets
            if budgets is not None and (budgets.active or routed.key_budget):
                try:
                    hold = await budgets.reserve(
                        routed.tenant,
                        routed.model,
                        routed.parsed.body,
                        key=routed.key,
                        key_budget=routed.key_budget,
                    )
                except (BudgetRefused, BudgetUnavailable) as exc:
                    return tries.earlier() or budget_refused(exc, routed.headers)
                if hold is not None and hold.no_overflow:
                    exclude += budgets.third_party_endpoints.get(routed.model, ())
            admit = admit_request(
                deps.edge_id, routed, tries, exclude, hold is not None and hold.no_overflow
            )
            asked = time.perf_counter()
            try:
                reply, client_left = await deps.admission.admit(admit, routed.client_gone)
            except AdmissionUnavailable as exc:
                if hold is not None:
                    hold.release()
                return tries.earlier() or admission_unavailable(exc, routed.headers)
            finally:
                deps.metrics.admission_duration.observe(time.perf_counter() - asked)
            if reply.status is not ReplyStatus.ADMITTED or reply.target is None:
                if hold is not None:
                    hold.release()
                return not_admitted(reply, routed, tries.previous)
            ending = AttemptEnd(deps, routed, admit, reply, hold)
            if client_left:  # a grant that crossed the cancel: give it back now
                ending.finish(Outcome.CLIENT_DISCONNECTED, sent=False)
                return Response(status_code=499), Outcome.CLIENT_DISCONNECTED
            try:
                result = await self._attempt(routed, ending)
            except Exception:
                # The gateway itself failed (a bug): the attempt still ends, so its lease is
                # released and nothing stays held for a request that is over.
                log.exception("unexpected error in attempt %s", admit.id)
                ending.finish(Outcome.INTERNAL_ERROR)
                return error_response(
                    Outcome.INTERNAL_ERROR, INTERNAL_ERROR_MESSAGE, headers=routed.headers
                ), Outcome.INTERNAL_ERROR
            if not isinstance(result, Failed):
                return result
            if not tries.failed(result):
                return result.response, result.outcome
            deps.metrics.retries.labels(result.outcome.value).inc()
            routed.record.retries += 1

    async def _attempt(
        self, routed: RoutedRequest, ending: AttemptEnd
    ) -> tuple[Answer, Outcome | None] | Failed:
        """Send the admitted attempt, then classify what came back or finish with it."""
        deps = self.deps  # the config the edge runs on once admitted (a queue may be long)
        target = ending.reply.target
        assert target is not None
        headers = answer_headers(routed, ending.reply)
        parsed = routed.parsed
        inject_usage = (
            deps.inject_usage
            and parsed.stream
            and not parsed.include_usage
            and routed.exchange is None
        )
        try:
            path, raw = upstream_request(routed, target, inject_usage)
        except InvalidRequest as exc:  # what this provider's wire API cannot express
            ending.finish(Outcome.BAD_REQUEST, sent=False)
            return error_response(
                Outcome.BAD_REQUEST, exc.message, param=exc.param, headers=headers
            ), Outcome.BAD_REQUEST
        timeouts = deps.timeouts_for(routed.model)
        deadline = loop_deadline(timeouts.total)
        ending.upstream_started = time.perf_counter()
        task = ending.stop_on_loss()  # until the answer's headers: a cut or loss stops the wait
        deps.telemetry.upstream_wait(len(deps.leases.held))
        try:
            upstream = await open_upstream(
                deps.upstream,
                target.url.rstrip("/") + path,
                raw,
                deps.upstream_headers_for(routed, target.provider),
                timeouts,
            )
        except UpstreamFailure as failure:
            return ending.upstream_failed(failure, headers)
        except asyncio.CancelledError:
            if task is None or not ending.stopped():
                raise
            task.uncancel()
            return ending.failed(Outcome.UPSTREAM_UNREACHABLE, "", headers)
        ending.answered(upstream)
        upstream_headers = passthrough_headers(upstream)
        upstream_headers.update(headers)
        try:
            if upstream.status != 200 or not parsed.stream:
                payload = await read_body(upstream, deadline)
            else:  # up to its first data event: nothing reaches the client before it
                payload = await first_chunk(upstream, timeouts, deadline)
        except UpstreamFailure as failure:
            return ending.upstream_failed(failure, headers)
        if upstream.status != 200:
            return answered_otherwise(routed, ending, payload, upstream_headers, headers)
        if not parsed.stream:
            return whole_answer(deps, routed, ending, payload, upstream_headers, headers)
        return streamed_answer(
            deps,
            routed,
            ending,
            upstream,
            payload,
            timeouts,
            deadline,
            upstream_headers,
            inject_usage,
        )


class Tries:
    """A request's attempts so far: the id of the next, the endpoints it excludes, the failure
    it follows, and whether one may follow another that failed (the model profile's
    ``retries``, and one more for a refusal of the request's length)."""

    __slots__ = ("_base", "count", "exceeded", "excluded", "failures", "previous", "retries")

    def __init__(self, base: str, retries: int) -> None:
        self._base = base
        self.retries = retries
        self.count = 0  # attempts that failed and were followed by another
        self.failures = 0  # the endpoints' failures so far (counted against `retries`)
        self.excluded: tuple[str, ...] = ()
        self.previous: Failed | None = None
        # What an engine's refusal for the request's length taught (one such retry at most,
        # beside the profile's `retries`: it is no endpoint's failure).
        self.exceeded: ContextExceeded | None = None

    @property
    def attempt_id(self) -> str:
        return self._base if self.count == 0 else f"{self._base}-{self.count}"

    def failed(self, result: Failed) -> bool:
        """Count the attempt that failed with `result`: True when another follows it."""
        if result.exceeded is not None:
            if self.exceeded is not None:  # its one retry for its length was spent
                return False
            self.exceeded = result.exceeded
        else:
            self.failures += 1
            if self.failures > self.retries:
                return False
        self.previous = result
        self.excluded += (result.endpoint,)
        self.count += 1
        return True

    def earlier(self) -> tuple[Response, Outcome] | None:
        """The last failure's answer: the client's when a retry finds no way on."""
        previous = self.previous
        return None if previous is None else (previous.response, previous.outcome)


# -- admit --------------------------------------------------------------------------------------


def admit_request(
    edge_id: str, routed: RoutedRequest, tries: Tries, exclude: tuple[str, ...], no_overflow: bool
) -> AdmitRequest:
    """What the edge asks admission for the next of `tries`."""
    previous = tries.previous
    # Built from values checked already (`trusted`: no re-validation per request).
    return trusted(
        AdmitRequest,
        id=tries.attempt_id,
        request_id=routed.request_id,
        edge=edge_id,
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
        no_overflow=no_overflow,
        prefix=routed.prompt.text,
        prompt_bytes=routed.prompt.length,
        tokens=routed.prompt.tokens,
        prompt_tokens=routed.prompt.token_count,
        token_block=routed.prompt.token_block,
        max_output=requested_output(routed.parsed.body),
        exceeded=tries.exceeded,
    )


def not_admitted(
    reply: AdmitReply, routed: RoutedRequest, previous: Failed | None
) -> tuple[Response, Outcome]:
    """The client's answer when admission did not admit the attempt: its refusal, 499 for a
    client that left while queued, or a retry's earlier failure when the retry found nowhere
    else to go."""
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


def budget_refused(
    exc: BudgetRefused | BudgetUnavailable, headers: dict[str, str]
) -> tuple[Response, Outcome]:
    """A first attempt's answer when its budgets could not be reserved."""
    if isinstance(exc, BudgetRefused):
        return error_response(
            Outcome.INSUFFICIENT_QUOTA, str(exc), headers=headers
        ), Outcome.INSUFFICIENT_QUOTA
    return error_response(
        Outcome.ADMISSION_UNAVAILABLE,
        f"The gateway cannot admit requests now: {exc}.",
        retry_after_s=1,
        headers=headers,
    ), Outcome.ADMISSION_UNAVAILABLE


def admission_unavailable(
    exc: AdmissionUnavailable, headers: dict[str, str]
) -> tuple[Response, Outcome]:
    """A first attempt's answer when admission cannot be asked."""
    return error_response(
        Outcome.ADMISSION_UNAVAILABLE,
        f"The gateway cannot admit requests right now: {exc.message}.",
        retry_after_s=1,
        headers=headers,
    ), Outcome.ADMISSION_UNAVAILABLE


# -- send ---------------------------------------------------------------------------------------


def answer_headers(routed: RoutedRequest, reply: AdmitReply) -> dict[str, str]:
    """The headers of the client's answer to an admitted attempt: the request's, and where it
    ran (route, fallback, provider, endpoint)."""
    target = reply.target
    assert target is not None
    headers = dict(routed.headers)
    if reply.route is not None:
        headers["x-llmgw-route"] = reply.route
    if reply.served_model is not None and reply.served_model != routed.model:
        headers["x-llmgw-fallback-from"] = routed.model
    headers["x-llmgw-provider"] = target.provider
    headers["x-llmgw-endpoint"] = target.endpoint
    return headers


def upstream_request(
    routed: RoutedRequest, target: Target, inject_usage: bool
) -> tuple[str, bytes]:
    """The path and body an attempt sends `target`: a Responses or Messages exchange's (its own
    API, or chat completions translated; InvalidRequest for what the target's API cannot
    express), else the OpenAI request's (`upstream_body`)."""
    if routed.exchange is not None:
        return routed.exchange.upstream(target)
    path = _PATHS[routed.feature.value]
    return path, upstream_body(routed.parsed, routed.raw, target, inject_usage)


def upstream_body(parsed: ParsedRequest, raw: bytes, target: Target, inject_usage: bool) -> bytes:
    """What an attempt of an OpenAI API sends `target`: the client's own bytes, or (only when
    something must change) its body with the target's model name, its priority, and with
    `inject_usage` a stream's request for its usage. Fields the body lacks are added to the
    client's bytes as they are (a prompt is not encoded again); a field it has is changed in
    a body encoded anew."""
    body = parsed.body
    renamed = parsed.model != target.upstream_model
    if not (inject_usage or renamed or target.priority is not None):
        return raw
    added: dict[str, Any] = {}
    if inject_usage:  # ask for usage anyway; the usage event is removed on the way back
        added["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if target.priority is not None:
        added["priority"] = target.priority
    if not renamed and not any(name in body for name in added):
        spliced = _with_added_fields(raw, added)
        if spliced is not None:
            return spliced
    body = {**body, **added, "model": target.upstream_model}
    return json.dumps(body).encode()


def _with_added_fields(raw: bytes, fields: dict[str, Any]) -> bytes | None:
    """The JSON object `raw` with `fields` (names it does not have) written before its closing
    brace; None when `raw` does not end as an object does."""
    body = raw.rstrip()
    if not body.endswith(b"}"):
        return None
    inside = body[:-1].rstrip()
    comma = b"" if inside.endswith(b"{") else b","
    return inside + comma + json.dumps(fields)[1:-1].encode() + b"}"


# -- classify -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """What an upstream's answer other than 200 means (`classify`)."""

    # BAD_REQUEST: the engine judged the request itself, its answer is the client's; any other
    # outcome is the attempt's failure (retried when `retryable`)
    outcome: Outcome
    status: int  # the status of the client's answer, should this be it
    body: bytes  # its body: the upstream's own, or the gateway's error (`rewritten`)
    rewritten: bool = False
    window: int | None = None  # the context window a length refusal named (0: none named)


def classify(status: int, payload: bytes, provider: str, provider_kind: str) -> Verdict:
    """What the upstream's answer `status` with body `payload` means."""
    if status == 404 and provider_kind == "managed" and names_missing_model(payload):
        # The fleet lists the model there and the engine no longer serves it (an adapter
        # unloaded since its list was read): another endpoint may; the engine's own 404 is
        # the client's answer when none does.
        return Verdict(Outcome.MODEL_UNLOADED, 404, payload)
    if (
        status == 400
        and provider_kind == "managed"
        and (window := refused_window(payload)) is not None
    ):
        # Too long for this engine after all (the gateway's count is a lower bound without a
        # tokenizer): retried once, placed only where it needs less than a window holds; the
        # engine's own 400 is the client's answer when none is found.
        return Verdict(Outcome.CONTEXT_LENGTH_EXCEEDED, 400, payload, window=window)
    refused = status in _CREDENTIALS_REFUSED
    if status < 500 and status != 429 and not refused:
        # The engine judged the request itself (e.g. prompt too long): its answer is the
        # client's answer.
        return Verdict(Outcome.BAD_REQUEST, status, payload)
    message = error_message_from_upstream(payload, status)
    if refused:
        message = (
            f"The provider {provider!r} refused the gateway's credentials ({status}): {message}"
        )
    return Verdict(
        Outcome.UPSTREAM_ERROR,
        status if status in (429, 503) else 502,
        error_body(message, "upstream_error", "upstream_error"),
        rewritten=True,
    )


def retryable(outcome: Outcome, status: int | None, exceeded: bool) -> bool:
    """Whether an attempt that failed with `outcome` (the upstream's `status`, if any) is worth
    another endpoint: a refusal for its length (`exceeded`), or the endpoint's failure. An
    upstream error is the endpoint's for a 429, 5xx or refused credentials, or when the answer
    was not HTTP at all (no status); another 4xx judged the request itself."""
    return exceeded or (
        outcome in _RETRYABLE
        and (
            outcome is not Outcome.UPSTREAM_ERROR or status is None or status in _RETRYABLE_STATUSES
        )
    )


def answered_otherwise(
    routed: RoutedRequest,
    ending: AttemptEnd,
    payload: bytes,
    upstream_headers: dict[str, str],
    headers: dict[str, str],
) -> tuple[Answer, Outcome | None] | Failed:
    """The attempt whose upstream answered other than 200 (`classify`)."""
    target = ending.reply.target
    assert target is not None and ending.status is not None
    verdict = classify(ending.status, payload, target.provider, target.provider_kind)
    response = Response(
        verdict.body,
        status_code=verdict.status,
        headers=upstream_headers,
        media_type="application/json" if verdict.rewritten else None,
    )
    if verdict.outcome is Outcome.BAD_REQUEST:
        ending.finish(Outcome.BAD_REQUEST)
        return response, Outcome.BAD_REQUEST
    if verdict.window is not None:
        ending.exceeded = ContextExceeded(
            endpoint=target.endpoint,
            model=ending.reply.served_model or routed.model,
            window=verdict.window or None,
        )
    return ending.failed(verdict.outcome, "", headers, response)


# -- finish -------------------------------------------------------------------------------------


def whole_answer(
    deps: AttemptDeps,
    routed: RoutedRequest,
    ending: AttemptEnd,
    payload: bytes,
    upstream_headers: dict[str, str],
    headers: dict[str, str],
) -> tuple[Answer, Outcome | None] | Failed:
    """The client's answer from a whole 200 body; the attempt ends once it is on its way."""
    target = ending.reply.target
    assert target is not None
    exchange = routed.exchange
    if exchange is not None:
        try:
            payload, ending.usage = exchange.whole(payload, target)
        except ValueError:
            return ending.failed(
                Outcome.UPSTREAM_ERROR,
                "The upstream's response is not a JSON object.",
                headers,
            )
    else:
        ending.usage = usage_in(payload)
    if deps.spend is not None and deps.spend_header and ending.usage is not None:
        use = ending.usage
        picos = deps.spend.prices.cost(
            target.provider,
            ending.reply.served_model or routed.model,
            TokenUse(use.input_tokens, use.cached_tokens, use.output_tokens),
        )
        upstream_headers["x-llmgw-cost"] = deps.spend.cost_header(picos)
    # The lease ends (and RequestEnded is reported) once the answer is on its way.
    routed.record.when_sent(lambda: ending.finish(Outcome.SUCCESS))
    return Response(payload, status_code=200, headers=upstream_headers), Outcome.SUCCESS


def streamed_answer(
    deps: AttemptDeps,
    routed: RoutedRequest,
    ending: AttemptEnd,
    upstream: UpstreamResponse,
    first: bytes,
    timeouts: Timeouts,
    deadline: float,
    upstream_headers: dict[str, str],
    inject_usage: bool,
) -> tuple[Answer, Outcome | None]:
    """The client's stream, from its first data event on (`first`); the attempt ends with the
    stream. `inject_usage`: the edge asked for the usage event the client did not (it is
    removed on the way)."""
    routed.record.first_token = time.perf_counter()
    target = ending.reply.target
    assert target is not None
    exchange = routed.exchange
    annotate = None
    if exchange is None and deps.spend is not None and deps.spend_header and not inject_usage:
        # The client asked for usage: its usage chunk also says what the attempt cost.
        served = ending.reply.served_model or routed.model
        annotate = deps.spend.usage_fields(target.provider, served)
    usage: StreamReader = (
        exchange.reader(target)
        if exchange is not None
        else StreamUsage(remove=inject_usage, annotate=annotate)
    )
    hold = ending.hold
    leases = deps.leases
    relay = StreamRelay(
        upstream,
        first,
        timeouts,
        deadline,
        lease_lost=lambda: hold is not None and leases.expired(hold),
        usage=usage,
    )
    telemetry = deps.telemetry

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

    async def body() -> Any:
        async for chunk in relay:
            if hold is not None and hold.cut_short:  # the drain deadline closed it
                yield sse_error_event(SHUTDOWN_MESSAGE, Outcome.SHUTTING_DOWN.value)
                break
            yield chunk

    upstream_headers.setdefault("content-type", "text/event-stream")
    upstream_headers["cache-control"] = "no-cache"
    # The attempt ends once the stream's end is sent (`StreamedAnswer` calls `end_once` in the
    # same turn, however the stream ended): off a sequential client's critical path, before
    # its next request is read.
    return StreamedAnswer(
        body(), end_once, upstream, headers=upstream_headers, drained=relay.drained
    ), None


class AttemptEnd:
    """What happens once when an admitted attempt ends, however it ends: its lease leaves the
    edge's table (released by the owner on the RequestEnded, unless lost) and one RequestEnded
    is reported (release, sample, usage, breaker evidence); its budget reservations settle."""

    __slots__ = (
        "admit",
        "budget",
        "deps",
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
        self,
        deps: AttemptDeps,
        routed: RoutedRequest,
        admit: AdmitRequest,
        reply: AdmitReply,
        budget: BudgetHold | None = None,
    ) -> None:
        self.deps = deps
        self.routed = routed
        self.admit = admit
        self.reply = reply
        self.hold: LeaseHold | None = (
            deps.leases.hold(reply.lease) if reply.lease is not None else None
        )
        self.ended = False
        self.upstream_started: float | None = None
        self.status: int | None = None
        self.retry_after: float | None = None
        self.refused = False  # the endpoint refused the connection (its breaker opens at once)
        self.exceeded: ContextExceeded | None = None  # the engine refused it for its length
        self.usage: Usage | None = None
        self.relayed = 0  # a stream's data events relayed (its output, if it has no usage)
        self.budget = budget  # its budget reservations, settled at its end
        if budget is not None:
            assert reply.target is not None
            budget.admitted(third_party=reply.target.provider_kind == "unlimited")

    def stop_on_loss(self) -> asyncio.Task[Any] | None:
        """Have a cut or a loss of the lease cancel the running task (while it waits for the
        upstream's headers); the task, or None when nothing can cancel it."""
        task = asyncio.current_task()
        if self.hold is not None and task is not None:
            self.hold.on_lost = task.cancel
        return task

    def answered(self, upstream: UpstreamResponse) -> None:
        """The upstream sent its response headers: a lost lease now closes its connection (no
        longer the task), and a status other than 200 is the attempt's evidence, with its
        Retry-After."""
        if self.hold is not None:
            self.hold.on_lost = upstream.close
        if upstream.status != 200:
            self.status = upstream.status
            self.retry_after = _retry_after(upstream.headers.get("retry-after"))

    def upstream_failed(
        self, failure: UpstreamFailure, headers: dict[str, str]
    ) -> tuple[Response, Outcome] | Failed:
        """`failed` as the upstream call failed: whether nothing accepted the connection (the
        breaker opens at once), and the status of an error event sent in place of a stream's
        first token."""
        self.refused = failure.refused
        if failure.status is not None:
            self.status = failure.status
        return self.failed(failure.outcome, failure.message, headers)

    def stopped(self) -> bool:
        """Whether the lease's cut or loss is what cancelled the task (`stop_on_loss`)."""
        return self.hold is not None and (self.hold.cut_short or self.hold.lost)

    def failed(
        self,
        outcome: Outcome,
        message: str,
        headers: dict[str, str],
        response: Response | None = None,
    ) -> tuple[Response, Outcome] | Failed:
        """The attempt failed before the client got anything: lease_lost if the lease is gone
        (first: nothing else counts then), shutting_down if the drain cut it, else it ends with
        `outcome`, and is retried if the failure is the endpoint's (`retryable`)."""
        hold = self.hold
        if hold is not None and self.deps.leases.expired(hold):
            self.finish(Outcome.LEASE_LOST)
            return error_response(
                Outcome.LEASE_LOST, LEASE_LOST_MESSAGE, headers=headers
            ), Outcome.LEASE_LOST
        if hold is not None and hold.cut_short:  # the drain deadline, not the endpoint
            self.finish(Outcome.SHUTTING_DOWN)
            return error_response(
                Outcome.SHUTTING_DOWN, SHUTDOWN_MESSAGE, headers=headers
            ), Outcome.SHUTTING_DOWN
        self.finish(outcome)
        if response is None:
            response = error_response(outcome, message, headers=headers)
        if not retryable(outcome, self.status, self.exceeded is not None):
            return response, outcome
        target = self.reply.target
        assert target is not None
        return Failed(
            response,
            outcome,
            target.endpoint,
            self.reply.lease.lease_id if self.reply.lease is not None else None,
            FailedAttempt(
                attempt=self.admit.id,
                endpoint=target.endpoint,
                outcome=outcome.value,
                status=self.status,
                retry_after=self.retry_after,
                refused=self.refused,
            ),
            self.exceeded,
        )

    def finish(self, outcome: Outcome, *, sent: bool | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        deps = self.deps
        lease_id: str | None = None
        if self.hold is not None:
            lost = self.hold.lost
            deps.leases.end(self.hold)
            if not lost:
                lease_id = self.hold.record.lease_id
        target: Target | None = self.reply.target
        assert target is not None
        ok = outcome is Outcome.SUCCESS
        usage = self.usage if ok else None
        reached = self.upstream_started is not None if sent is None else sent
        deps.reporter.report(
            trusted(  # this edge's own values: no re-validation
                RequestEnded,
                id=self.admit.id,
                request_id=self.routed.request_id,
                edge=deps.edge_id,
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
                ended_at=deps.clock.wall(),
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
        if deps.spend is not None:
            routed = self.routed
            picos = deps.spend.attempt_ended(
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
