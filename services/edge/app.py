"""The edge: OpenAI's HTTP API in front of the routing mesh (the ingress).

Per request: read the body (bounded), validate it, resolve the model, work out the session, its
shard and the tenant, then `Attempts.run` asks the shard's admission owner where to go, relays
and streams the answer back. Bad input is rejected before anything is sent to NATS, so it takes
no admission decision and no lease.

The edge depends on ports (`llmgw.contracts`): an `AdmissionClient`, a `LeaseStore` and a
`RequestReporter` (drained at stop), plus the pool of upstream HTTP connections and its metrics (`EdgeDeps`).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmgw.clock import SYSTEM, Clock
from llmgw.config.credentials import provider_keys, read_keys
from llmgw.core.anthropic import opening, parse_messages_request
from llmgw.core.outcomes import Outcome
from llmgw.core.requests import Feature, InvalidRequest, parse_request
from llmgw.core.responses import parse_responses_request
from llmgw.core.sessions import (
    SESSION_RESPONSE_HEADER,
    ClientKey,
    client_key,
    session_id,
    tenant_id,
)
from llmgw.core.shards import shard_of
from llmgw.core.spend import estimate_input_tokens, estimated_output
from llmgw.logs import REQUEST_ID_HEADER, accept_request_id, request_id
from llmgw.services.edge.attempts import (
    _PATHS,
    Answer,
    ApiExchange,
    AttemptDeps,
    Attempts,
    RoutedRequest,
)
from llmgw.services.edge.auth import Caller, KeyAuth
from llmgw.services.edge.count_tokens import COUNT_TOKENS_PATH, count_tokens
from llmgw.services.edge.drain import EdgeDrain, with_connection_close
from llmgw.services.edge.errors import (
    INTERNAL_ERROR_MESSAGE,
    error_body,
    error_response,
    model_not_found,
)
from llmgw.services.edge.hardening import OpenAIErrorsHttpTools, headers_refused
from llmgw.services.edge.messages import MessagesApi, anthropic_answer, authorization
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.prompts import PromptChains, TokenizerUnavailable
from llmgw.services.edge.request_body import (
    BodyTooLarge,
    ClientDisconnect,
    read_request_body,
    unread_answer,
)
from llmgw.services.edge.responses import ResponsesApi, owner_of
from llmgw.services.edge.telemetry import EdgeTelemetry, RequestRecord
from llmgw.state.memory_kv import MemoryKV
from llmgw.state.responses import ResponseStore

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from starlette.types import Receive, Scope, Send

    from llmgw.config.schema import Config, Timeouts
    from llmgw.contracts import AdmissionClient, LeaseStore, RequestReporter
    from llmgw.services.edge.budgets import BudgetGuard
    from llmgw.services.edge.http_client import UpstreamPool
    from llmgw.services.edge.spend import SpendBook
    from llmgw.tracing import Tracing

log = logging.getLogger("llmgw.edge")

# A part of the edge that follows the config it runs on: the config (the live fleet's
# endpoints in it, draining ones too) and the ids of the draining endpoints.
ConfigFollower = Callable[["Config", frozenset[str]], None]

_ROUTES = {path: Feature(name) for name, path in _PATHS.items()}


@dataclass
class EdgeDeps:
    """What the edge needs from outside; the composition root owns their lifetimes."""

    admission: AdmissionClient
    leases: LeaseStore[Any]  # end and expired take the holds it made
    reporter: RequestReporter
    upstream: UpstreamPool  # keep-alive connections to the engines and APIs
    metrics: EdgeMetrics
    edge_id: str = field(default_factory=lambda: f"edge-{uuid.uuid4().hex[:8]}")
    rng: random.Random = field(default_factory=random.Random)
    drain: EdgeDrain = field(default_factory=EdgeDrain)
    auth: KeyAuth | None = None  # auth.mode keys (services/edge/auth.py)
    tracing: Tracing | None = None  # OpenTelemetry (llmgw.tracing), off by default
    spend: SpendBook | None = None  # prices each attempt (services/edge/spend.py)
    budgets: BudgetGuard | None = None  # reserves and settles budgets (services/edge/budgets.py)
    # Stored Responses API responses (llmgw.state.responses); in memory unless composed on NATS
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(MemoryKV()))
    # Parts that keep tables of their own from the config (prices, budgets, the outage
    # fallback's endpoints, the admission client's queue wait): each takes the config the edge
    # runs on, then each applied config and fleet change (`Edge.follow_config`).
    followers: list[ConfigFollower] = field(default_factory=list)
    clock: Clock = SYSTEM  # what its parts read time from: a tpm window's now, an end's stamp


class Edge:
    """The request handler; one per process, shared by all requests."""

    def __init__(self, config: Config, deps: EdgeDeps) -> None:
        self.config = config
        self.deps = deps
        self.telemetry = EdgeTelemetry(deps.metrics, config.log, tracing=deps.tracing)
        self.edge_id = deps.edge_id
        self.auth = deps.auth
        self.max_body = config.router.max_body_bytes
        self.flow_control = config.admission.enabled
        self.shards = config.admission.shards
        self.band_header = config.admission.band_header
        self.session_rules = config.router.session_rules()
        # Their header names as the ASGI server gives them (lower case): one pass over the
        # request's headers picks them out.
        self._session_names = frozenset(
            name.encode("latin-1")
            for rule in self.session_rules
            for name in (rule.header, rule.agent, rule.parent)
            if name is not None
        )
        self.inject_usage = config.router.inject_usage
        self.upstream_headers = _provider_auth_headers(config, provider_keys(config))
        self.responses = ResponsesApi(config, deps.responses, deps.rng)
        stored = deps.metrics.responses_stored
        deps.responses.on_result = lambda result: stored.labels(result).inc()
        self.follow_config(config)

    def timeouts_for(self, model: str) -> Timeouts:
        return self.attempts.deps.timeouts_for(model)

    async def handle(self, request: Request, feature: Feature) -> tuple[Answer, RequestRecord]:
        """The response, and the record whose `sent` the caller runs once it has sent it (the
        attempt's end and the access line wait for that: off the client's critical path)."""
        record = RequestRecord(
            accept_request_id(request.headers.get(REQUEST_ID_HEADER)),
            feature,
            time.perf_counter(),
        )
        # Every record logged while handling it carries its id (one task per request, so the
        # value needs no reset: the stream body runs in the same task).
        request_id.set(record.request_id)
        self.telemetry.began(record, request.headers)
        response, outcome = await self._handle(request, record)
        if feature is Feature.MESSAGES:  # Anthropic's API: its error shape, streams too
            response = anthropic_answer(response)
        if outcome is not None:  # streams record their outcome when they end
            status = response.status_code
            record.when_sent(lambda: self.telemetry.ended(record, outcome, status))
        return response, record

    async def _handle(
        self, request: Request, record: RequestRecord
    ) -> tuple[Answer, Outcome | None]:
        feature = record.feature
        ids = {REQUEST_ID_HEADER: record.request_id}
        caller = None
        if self.auth is not None:  # before the body is read
            checked = self.auth.caller(authorization(request.headers), ids)
            if isinstance(checked, Response):
                return checked, (
                    Outcome.INVALID_API_KEY if checked.status_code == 401 else Outcome.RATE_LIMITED
                )
            caller, ids = checked, checked.headers
        try:
            raw = await read_request_body(request, self.max_body)
        except (BodyTooLarge, ClientDisconnect) as exc:
            return unread_answer(exc, self.max_body, ids)
        turn = None
        try:
            if feature is Feature.RESPONSES:
                parsed, turn = parse_responses_request(raw)
            elif feature is Feature.MESSAGES:
                parsed = parse_messages_request(raw)
            else:
                parsed = parse_request(feature, raw)
        except InvalidRequest as exc:
            return error_response(
                Outcome.BAD_REQUEST, exc.message, param=exc.param, headers=ids
            ), Outcome.BAD_REQUEST
        record.asked_model = parsed.model
        record.stream = parsed.stream
        model = self._resolve(request, caller, parsed.model, record, ids)
        if isinstance(model, tuple):
            return model
        exchange: ApiExchange | None = None
        session: str | None
        client = self._client_key(request)
        if turn is not None:  # the Responses API: its chain and session (404 before admission)
            prepared = await self.responses.prepare(
                parsed,
                turn,
                owner_of(
                    caller.key.key_id if caller is not None else None,
                    request.headers.get("authorization"),
                ),
                model,
                client,
                ids,
            )
            if isinstance(prepared, tuple):
                return prepared
            exchange, session = prepared, prepared.session
        else:
            if feature is Feature.MESSAGES:
                try:
                    exchange = self.messages.exchange(parsed, raw, model)
                except InvalidRequest as exc:
                    return error_response(
                        Outcome.BAD_REQUEST, exc.message, param=exc.param, headers=ids
                    ), Outcome.BAD_REQUEST
            session = _session(feature, model, parsed.body, client)
        parent = None
        if session is None:
            shard = self.deps.rng.randrange(self.shards)
        else:
            # A sub-agent's session lives in its family's shard, beside its parent's pin.
            parent, home = client.relatives(model, feature) if client else (None, None)
            shard = shard_of(home or session, self.shards)
            ids = {**ids, SESSION_RESPONSE_HEADER: session}
        record.tenant = (
            caller.key.tenant
            if caller is not None
            else tenant_id(authorization(request.headers), parsed.user)
        )
        refused = self._hold_tokens(caller, parsed.body, record, ids)
        if refused is not None:
            return refused, Outcome.RATE_LIMITED
        prompt = await self.prompts.of(feature.value, parsed.body, exchange, model)
        routed = RoutedRequest(
            request_id=record.request_id,
            feature=feature,
            parsed=parsed,
            raw=raw,
            model=model,
            session=session,
            parent=parent,
            shard=shard,
            band=record.band,
            tenant=record.tenant,
            key=caller.key.key_id if caller is not None else None,
            key_parallel=caller.key.max_parallel_requests if caller is not None else None,
            key_budget=caller.key.budget if caller is not None else None,
            headers=ids,
            started=record.started,
            # Once the body is read, the next ASGI receive() returns only when the client
            # disconnects: what a queued request watches.
            client_gone=request.receive if self.flow_control else None,
            record=record,
            exchange=exchange,
            prompt=prompt,
        )
        return await self.attempts.run(routed)

    def _resolve(
        self,
        request: Request,
        caller: Caller | None,
        asked: str,
        record: RequestRecord,
        ids: dict[str, str],
    ) -> str | tuple[Response, Outcome]:
        """The canonical model `asked` names, and the request's priority band (its header's
        when its key may use one, else its key's), both into `record`; or the answer to a model
        the caller may not use or a band that is not configured."""
        model = self.model_for(caller, asked)
        if model is None:
            return model_not_found(asked, ids), Outcome.MODEL_NOT_FOUND
        record.model = model
        band = request.headers.get(self.band_header)
        if caller is not None and self.auth is not None and not caller.key.band_header:
            band = self.auth.band(caller, None)  # the header is not this key's to use
        record.band = band
        if band is not None and band not in self.bands:
            return error_response(
                Outcome.BAD_REQUEST,
                f"Unknown priority band '{band}' in the {self.band_header} header; "
                f"known bands: {', '.join(sorted(self.bands))}.",
                param=self.band_header,
                headers=ids,
            ), Outcome.BAD_REQUEST
        if caller is not None and self.auth is not None:
            record.band = self.auth.band(caller, band)
        return model

    def _client_key(self, request: Request) -> ClientKey | None:
        """What the request's session headers name (`llmgw.core.sessions.client_key`)."""
        sent: dict[str, str] = {}
        for name, value in request.headers.raw:
            if name in self._session_names:
                sent.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        return client_key(sent, self.session_rules) if sent else None

    def _hold_tokens(
        self,
        caller: Caller | None,
        body: dict[str, Any],
        record: RequestRecord,
        ids: dict[str, str],
    ) -> Response | None:
        """A tpm key's request counts its estimated tokens from now until it ends (its usage
        is counted then: `TokenCountingReporter`); checked again here, with the estimates of
        the requests let in while its body was read, so a burst passes tpm by one request at
        most. The 429 to answer, or None (a request of no tpm key too)."""
        if caller is None or caller.key.tpm is None or self.auth is None:
            return None
        tpm = caller.key.tpm
        limiter = self.auth.limiter
        key_id = caller.key.key_id
        now = self.deps.clock.wall()
        if limiter.used(key_id, now)[1] >= tpm:
            reset = limiter.window.reset_in(now)
            return error_response(
                Outcome.RATE_LIMITED,
                f"Rate limit reached for this API key on tokens per minute: limit {tpm}. "
                f"Please try again in {reset:.0f}s.",
                retry_after_s=reset,
                headers=ids,
            )
        estimate = estimate_input_tokens(body) + estimated_output(body, self.default_output)
        window = limiter.hold_tokens(key_id, estimate)
        record.when_sent(lambda: limiter.release_tokens(key_id, estimate, window))
        return None

    def follow_config(self, config: Config, draining: frozenset[str] = frozenset()) -> None:
        """Run on `config` from the next request on (at start, then at each applied config and
        fleet change: services/edge/live.py): its bands, models (names, aliases; added or
        removed), retries, timeouts, the cost header, the upstream key of each provider (read
        again: a rotated key file is taken) and the APIs its providers and endpoints speak; the
        `followers` take it too. `draining`: endpoints that take no new work."""
        if config is not self.config:  # a follow: read every key again, keep what fails
            self.upstream_headers = _live_auth_headers(config, self.upstream_headers)
        self.config = config
        self.bands = frozenset(b.name for b in config.admission.bands)
        self.responses.apis = {p.id: frozenset(p.apis) for p in config.providers}
        self.messages = MessagesApi(config)
        previous: PromptChains | None = getattr(self, "prompts", None)
        try:
            self.prompts = PromptChains(config, previous)
        except TokenizerUnavailable:
            if previous is None:
                raise  # at start: the edge refuses to start, naming the field
            log.error(
                "a model's tokenizer cannot be used; the earlier ones are kept", exc_info=True
            )
        self.default_output = config.spend.default_output_tokens
        if self.auth is not None:  # a key without a default band of its own takes this one
            self.auth.default_band = config.admission.default_band
        self._follow_attempts(config)
        # name or alias -> canonical name, as a plain dict for the hot path
        self._canonical = {
            m: canonical
            for m in config.public_model_ids()
            if (canonical := config.resolve_model(m)) is not None  # each public id resolves
        }
        for follower in self.deps.followers:
            follower(config, draining)

    def _follow_attempts(self, config: Config) -> None:
        """Attempts from the next one on take `config`'s retries, timeouts, cost header and
        provider keys."""
        deps = self.deps
        profiles = {m.name: config.profile_for_model(m.name) for m in config.models}
        attempt_deps = AttemptDeps(
            edge_id=deps.edge_id,
            admission=deps.admission,
            leases=deps.leases,
            reporter=deps.reporter,
            upstream=deps.upstream,
            metrics=deps.metrics,
            telemetry=self.telemetry,
            spend=deps.spend,
            budgets=deps.budgets,
            inject_usage=self.inject_usage,
            spend_header=config.spend.cost_header,
            retries={name: p.retries for name, p in profiles.items()},
            timeouts={name: p.timeouts for name, p in profiles.items()},
            default_timeouts=config.timeouts,
            provider_headers=self.upstream_headers,
            clock=deps.clock,
        )
        attempts: Attempts | None = getattr(self, "attempts", None)
        if attempts is None:
            self.attempts = Attempts(attempt_deps)
        else:
            attempts.deps = attempt_deps

    def model_for(self, caller: Caller | None, asked: str) -> str | None:
        """The canonical model `asked` names, or None when it is unknown or `caller`'s key may
        not use it (both answered alike: `model_not_found`)."""
        model = self._canonical.get(asked)
        if model is None or (
            caller is not None
            and self.auth is not None
            and self.auth.model_denied(caller, asked, model)
        ):
            return None
        return model

    # -- non-routed endpoints -------------------------------------------------------------------

    def _visible_models(self, authorization: str | None) -> list[str] | Response:
        """The model ids the caller may see (all of them with auth.mode none), or a 401."""
        names = self.config.public_model_ids()
        if self.auth is None:
            return names
        key = self.auth.identify(authorization, {})
        if isinstance(key, Response):
            return key
        return [n for n in names if key.allows_model(n, self._canonical[n])]

    def response_owner(self, authorization: str | None) -> str | Response:
        """Whose stored responses a caller may read: its owner digest, or a 401."""
        if self.auth is None:
            return owner_of(None, authorization)
        key = self.auth.identify(authorization, {})
        return key if isinstance(key, Response) else owner_of(key.key_id, authorization)

    def models_response(self, authorization: str | None = None) -> Response:
        names = self._visible_models(authorization)
        if isinstance(names, Response):
            return names
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"} for name in names
        ]
        return JSONResponse({"object": "list", "data": data})

    def model_response(self, model_id: str, authorization: str | None = None) -> Response:
        names = self._visible_models(authorization)
        if isinstance(names, Response):
            return names
        if model_id not in names:
            return error_response(
                Outcome.MODEL_NOT_FOUND, f"The model '{model_id}' does not exist.", param="model"
            )
        return JSONResponse({"id": model_id, "object": "model", "created": 0, "owned_by": "llmgw"})


def _session(
    feature: Feature, model: str, body: dict[str, Any], client: ClientKey | None
) -> str | None:
    """The request's session (`llmgw.core.sessions.session_id`); a Messages request's is the
    chat session of its opening."""
    if feature is Feature.MESSAGES:
        return session_id(Feature.CHAT, model, opening(body), client=client)
    return session_id(feature, model, body, client=client)


def _provider_auth_headers(config: Config, keys: dict[str, str]) -> dict[str, dict[str, str]]:
    """Upstream headers per provider: JSON, plus a bearer key where `keys` has one."""
    headers = {}
    for provider in config.providers:
        h = {"content-type": "application/json"}
        if provider.id in keys:
            h["authorization"] = f"Bearer {keys[provider.id]}"
        headers[provider.id] = h
    return headers


def _live_auth_headers(
    config: Config, running: dict[str, dict[str, str]]
) -> dict[str, dict[str, str]]:
    """The upstream headers of a config the edge follows: every configured key read again (a
    new provider's, a rotated key file's, another variable's); a key that cannot be read now
    keeps what that provider ran with, and a new provider's goes without one (logged: its
    upstream then answers 401, a failed attempt)."""
    keys, problems = read_keys(config)
    fresh = _provider_auth_headers(config, keys)
    for provider, problem in problems.items():
        kept = provider in running
        log.error(
            "a provider key cannot be read here (%s): %s",
            "its calls keep the key they had" if kept else "its calls go without a key",
            problem,
        )
        if kept:
            fresh[provider] = running[provider]
    return fresh


class HotPathApp:
    """Serves the three POST routes straight from ASGI, everything else through FastAPI.

    The middleware stack and router of a FastAPI app cost tens of microseconds per request;
    for the routes every request takes, this dispatcher skips them. An unexpected exception
    still ends in an OpenAI-shaped 500.
    """

    # The HTTP server's own errors (a control character in a header...) as OpenAI JSON.
    http_protocol = OpenAIErrorsHttpTools

    def __init__(self, edge: Edge, app: FastAPI) -> None:
        self.edge = edge
        self.app = app
        self.max_header_count = edge.config.router.max_header_count
        self.max_header_bytes = edge.config.router.max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = headers_refused(scope, self.max_header_count, self.max_header_bytes)
            if refused is not None:
                await refused(scope, receive, send)
                return
        if self.edge.deps.drain.draining:  # stopping: no connection is reused after this answer
            send = with_connection_close(send)
        feature = _ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if feature is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        record = None
        try:
            response, record = await self.edge.handle(Request(scope, receive), feature)
        except Exception:
            log.exception("unexpected error in the edge")
            response = error_response(Outcome.INTERNAL_ERROR, INTERNAL_ERROR_MESSAGE)
            if feature is Feature.MESSAGES:
                response = anthropic_answer(response)
        try:
            await response(scope, receive, send)
        finally:
            if record is not None:
                try:
                    record.sent()
                except Exception:  # the answer is out; what failed after it is only logged
                    log.exception("unexpected error in the edge after a response")


def create_app(config: Config, deps: EdgeDeps) -> HotPathApp:
    """The client-facing ASGI app (OpenAI API). Lifetimes of deps belong to the caller."""
    edge = Edge(config, deps)
    app = FastAPI(title="llmgw edge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.edge = edge

    def route(feature: Feature) -> Callable[[Request], Awaitable[Answer]]:
        async def endpoint(request: Request) -> Answer:
            response, record = await edge.handle(request, feature)
            record.sent()  # not the hot path (HotPathApp answers these routes first)
            return response

        return endpoint

    # HotPathApp answers these first; FastAPI keeps them for 405 on other methods.
    for path, feature in _ROUTES.items():
        # Starlette sends whatever ASGI callable the endpoint returns (a StreamedAnswer too);
        # its annotation says Response.
        app.add_route(path, route(feature), methods=["POST"])  # type: ignore[arg-type]

    async def list_models(request: Request) -> Response:
        return edge.models_response(authorization(request.headers))

    async def get_model(request: Request) -> Response:
        return edge.model_response(request.path_params["model_id"], authorization(request.headers))

    async def stored_response(request: Request) -> Response:
        owner = edge.response_owner(request.headers.get("authorization"))
        if isinstance(owner, Response):
            return owner
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return await edge.responses.delete(response_id, owner)
        return await edge.responses.get(response_id, owner)

    async def input_items(request: Request) -> Response:
        owner = edge.response_owner(request.headers.get("authorization"))
        if isinstance(owner, Response):
            return owner
        return await edge.responses.input_items(
            request.path_params["response_id"], owner, dict(request.query_params)
        )

    app.add_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    app.add_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])

    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(edge, request)

    app.add_route(COUNT_TOKENS_PATH, messages_count_tokens, methods=["POST"])
    app.add_route("/v1/models", list_models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", get_model, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return Response(
            error_body(
                f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error", code
            ),
            status_code=exc.status_code,
            media_type="application/json",
        )

    return HotPathApp(edge, app)
