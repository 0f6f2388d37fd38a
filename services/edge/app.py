"""The edge: OpenAI's HTTP API in front of the routing mesh.

Per request: read the body (bounded), validate it, resolve the model, ask
admission over NATS where to go, relay to that upstream and stream the answer
back. Bad input is rejected before anything is sent to NATS, so it takes no
admission decision and no lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from fastapi import FastAPI
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmgw.core.outcomes import Outcome
from llmgw.core.requests import Feature, InvalidRequest, ParsedRequest, parse_request
from llmgw.core.sessions import session_id, tenant_id
from llmgw.core.usage import StreamUsage, Usage, usage_in
from llmgw.services.edge.errors import error_body, error_response
from llmgw.services.edge.leases import LeaseHolder
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.upstream import (
    LEASE_LOST_MESSAGE,
    StreamRelay,
    Timeouts,
    UpstreamFailure,
    error_message_from_upstream,
    loop_deadline,
    open_upstream,
    passthrough_headers,
    read_body,
)
from llmgw.wire import (
    ADMISSION_CANCEL_SUBJECT,
    ADMISSION_DONE_SUBJECT,
    ADMISSION_REQUEST_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitCancel,
    AdmitReply,
    AdmitRequest,
    RejectReason,
    RequestDone,
    RequestStats,
    Target,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from llmgw.config.schema import Config
    from llmgw.state.routing_state import RoutingState

log = logging.getLogger("llmgw.edge")

_PATHS = {
    Feature.CHAT: "/v1/chat/completions",
    Feature.COMPLETIONS: "/v1/completions",
    Feature.EMBEDDINGS: "/v1/embeddings",
}
_REJECTIONS = {
    RejectReason.UNKNOWN_MODEL: Outcome.MODEL_NOT_FOUND,
    RejectReason.UNSUPPORTED: Outcome.UNSUPPORTED,
    RejectReason.NO_CAPACITY: Outcome.NO_CAPACITY,
    RejectReason.MALFORMED: Outcome.ADMISSION_UNAVAILABLE,
    RejectReason.UNKNOWN_BAND: Outcome.BAD_REQUEST,
    RejectReason.QUEUE_FULL: Outcome.QUEUE_FULL,
    RejectReason.QUEUE_TIMEOUT: Outcome.QUEUE_TIMEOUT,
}


class BodyTooLarge(Exception):
    pass


@dataclass
class EdgeDeps:
    """What the edge needs from outside; the composition root owns their lifetimes."""

    nc: NATS
    session: aiohttp.ClientSession
    metrics: EdgeMetrics
    routing: RoutingState  # renews and releases the leases admission grants


class Edge:
    """The request handler; one per process, shared by all requests."""

    def __init__(self, config: Config, deps: EdgeDeps) -> None:
        self.config = config
        self.deps = deps
        self.edge_id = f"edge-{uuid.uuid4().hex[:8]}"
        self.max_body = config.router.max_body_bytes
        # With flow control a request may wait up to queue_ttl in admission before its answer.
        self.flow_control = config.admission.enabled
        self.admission_timeout = config.nats.request_timeout + (
            config.admission.queue_ttl if self.flow_control else 0.0
        )
        self.timeouts = Timeouts.from_section(config.timeouts)
        self.band_header = config.admission.band_header
        self.bands = frozenset(b.name for b in config.admission.bands)
        self.session_header = config.router.session_header
        self.renew_every = config.pinning.lease_timeout / 3
        self.inject_usage = config.router.inject_usage
        # Per canonical model, from its routing profile: retries after an endpoint failure and
        # the phase timeouts.
        profiles = {m.name: config.profile_for_model(m.name) for m in config.models}
        self._retries = {name: p.retries for name, p in profiles.items()}
        self._timeouts = {name: Timeouts.from_section(p.timeouts) for name, p in profiles.items()}
        # Lease releases run here, outside the requests that end them.
        self.background: set[asyncio.Task[None]] = set()
        # name or alias -> canonical name, as a plain dict for the hot path
        self._canonical = {m: config.resolve_model(m) for m in config.public_model_ids()}
        self._auth = self._provider_auth_headers(config)

    @staticmethod
    def _provider_auth_headers(config: Config) -> dict[str, dict[str, str]]:
        """Upstream headers per provider: JSON, plus a bearer key where one is configured."""
        headers = {}
        for provider in config.providers:
            h = {"content-type": "application/json"}
            key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
            if key:
                h["authorization"] = f"Bearer {key}"
            headers[provider.id] = h
        return headers

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise BodyTooLarge
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                raise BodyTooLarge
        return bytes(body)

    async def handle(self, request: Request, feature: Feature) -> Response:
        started = time.perf_counter()
        response, outcome = await self._handle(request, feature, started)
        if outcome is not None:  # streams record their outcome when they end
            self.deps.metrics.observe(feature, outcome, time.perf_counter() - started)
        return response

    async def _handle(
        self, request: Request, feature: Feature, started: float
    ) -> tuple[Response, Outcome | None]:
        request_id = uuid.uuid4().hex
        ids = {"x-request-id": request_id}
        try:
            raw = await self._read_body(request)
        except BodyTooLarge:
            return error_response(
                Outcome.BODY_TOO_LARGE,
                f"The request body exceeds the limit of {self.max_body} bytes.",
                headers=ids,
            ), Outcome.BODY_TOO_LARGE
        except ClientDisconnect:
            return Response(status_code=499), Outcome.CLIENT_DISCONNECTED
        try:
            parsed = parse_request(feature, raw)
        except InvalidRequest as exc:
            return error_response(
                Outcome.BAD_REQUEST, exc.message, param=exc.param, headers=ids
            ), Outcome.BAD_REQUEST

        model = self._canonical.get(parsed.model)
        if model is None:
            return error_response(
                Outcome.MODEL_NOT_FOUND,
                f"The model '{parsed.model}' does not exist or you do not have access to it.",
                param="model",
                headers=ids,
            ), Outcome.MODEL_NOT_FOUND

        band = request.headers.get(self.band_header)
        if band is not None and band not in self.bands:
            return error_response(
                Outcome.BAD_REQUEST,
                f"Unknown priority band '{band}' in the {self.band_header} header; "
                f"known bands: {', '.join(sorted(self.bands))}.",
                param=self.band_header,
                headers=ids,
            ), Outcome.BAD_REQUEST
        session = session_id(
            feature, model, parsed.body, header_key=request.headers.get(self.session_header)
        )
        tenant = tenant_id(request.headers.get("authorization"), parsed.user)
        retries = self._retries.get(model, 0)
        excluded: list[str] = []
        failed: tuple[Response, Outcome] | None = None
        for attempt in range(retries + 1):
            admit = AdmitRequest(
                request_id=request_id if attempt == 0 else f"{request_id}-{attempt}",
                edge_id=self.edge_id,
                model=model,
                feature=feature.value,
                stream=parsed.stream,
                session_id=session,
                band=band,
                tenant=tenant,
                exclude_endpoints=tuple(excluded),
            )
            answer = await self._attempt(request, feature, parsed, raw, admit, ids, started)
            if not isinstance(answer, _Failed):
                if failed is not None and answer[1] in _ADMISSION_OUTCOMES:
                    return failed  # nowhere else to go: the client gets the upstream's failure
                return answer
            failed = answer.response, answer.outcome
            excluded.append(answer.endpoint)
            self.deps.metrics.retries.labels(answer.outcome.value).inc()
        assert failed is not None
        return failed

    async def _attempt(
        self,
        request: Request,
        feature: Feature,
        parsed: ParsedRequest,
        raw: bytes,
        admit: AdmitRequest,
        ids: dict[str, str],
        started: float,
    ) -> tuple[Response, Outcome | None] | _Failed:
        """One admission and relay; `_Failed` when it failed before anything reached the client
        in a way another endpoint may not (the caller retries elsewhere if it has retries left).
        """
        request_id = admit.request_id
        admitted = time.perf_counter()
        client_left = False
        try:
            msg, client_left = await self._ask_admission(
                request, admit.model_dump_json(exclude_defaults=True).encode(), request_id
            )
            reply = AdmitReply.model_validate_json(msg.data)
        except (NoRespondersError, NatsTimeoutError, ConnectionClosedError, TimeoutError) as exc:
            kind = (
                "no admission service is running"
                if isinstance(exc, NoRespondersError)
                else ("the admission service did not answer in time")
            )
            return error_response(
                Outcome.ADMISSION_UNAVAILABLE,
                f"The gateway cannot admit requests right now: {kind}.",
                retry_after_s=1,
                headers=ids,
            ), Outcome.ADMISSION_UNAVAILABLE
        finally:
            self.deps.metrics.admission_duration.observe(time.perf_counter() - admitted)

        if client_left or reply.reject_reason is RejectReason.CANCELLED:
            if reply.lease is not None:  # granted before the cancel landed: give it back now
                await self.deps.routing.release_request_lease(
                    reply.lease.to_core(), refresh_pin=False
                )
            if reply.target is not None:
                _RequestEnd(self, reply.target, reply.granted_at, report_stats=False).end(
                    Outcome.CLIENT_DISCONNECTED
                )
            return Response(status_code=499), Outcome.CLIENT_DISCONNECTED

        if not reply.admitted or reply.target is None:
            outcome = _REJECTIONS.get(reply.reject_reason, Outcome.NO_CAPACITY)  # type: ignore[arg-type]
            return error_response(
                outcome,
                reply.message or "The request was not admitted.",
                param="model" if outcome is Outcome.MODEL_NOT_FOUND else None,
                retry_after_s=reply.retry_after_s,
                headers=ids,
            ), outcome

        if reply.route is not None:
            ids["x-llmgw-route"] = reply.route
        if reply.served_model is not None and reply.served_model != admit.model:
            ids["x-llmgw-fallback-from"] = admit.model
        holder = None
        if reply.lease is not None:
            holder = LeaseHolder(
                self.deps.routing,
                reply.lease.to_core(),
                renew_every=self.renew_every,
                refresh_pin_on_success=reply.refresh_pin_on_success,
                background=self.background,
                pin=reply.pin.to_core() if reply.pin is not None else None,
            )
        ending = self._request_end(reply)
        try:
            response, outcome = await self._relay(
                feature, parsed, raw, reply.target, ids, holder, started, ending
            )
        except BaseException:
            if holder is not None:
                holder.finish(success=False)
            ending.end(Outcome.CLIENT_DISCONNECTED)
            raise
        if outcome is not None:  # a stream ends itself (lease, count, stats) when it ends
            if holder is not None:
                holder.finish(success=outcome is Outcome.SUCCESS)
            ending.end(outcome)
            if outcome in _RETRYABLE and (
                outcome is not Outcome.UPSTREAM_ERROR
                or ending.upstream_status in _RETRYABLE_STATUSES
            ):
                return _Failed(response, outcome, reply.target.endpoint)
        return response, outcome

    def _request_end(self, reply: AdmitReply) -> _RequestEnd:
        assert reply.target is not None
        return _RequestEnd(self, reply.target, reply.granted_at)

    def publish_later(self, *messages: tuple[str, bytes]) -> None:
        """Publish (subject, payload) pairs without waiting (best effort), in one background
        task tracked so shutdown can wait for it."""
        task = asyncio.ensure_future(self._publish_quietly(messages))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _publish_quietly(self, messages: tuple[tuple[str, bytes], ...]) -> None:
        for subject, payload in messages:
            try:
                await self.deps.nc.publish(subject, payload)
            except Exception as exc:  # best effort: admission catches up at the next scrape
                log.debug("not published on %s: %s", subject, exc)

    async def _ask_admission(
        self, request: Request, payload: bytes, request_id: str
    ) -> tuple[Msg, bool]:
        """Admission's answer, and whether the client left while waiting for it.

        With flow control the answer may take up to queue_ttl, so the client connection is
        watched: once the body has been read, the next ASGI receive() returns only when the
        client disconnects. Then every admission instance is told to drop the request, and the
        answer is still awaited: CANCELLED, or a grant that raced with the cancel (whose lease
        the caller releases at once).
        """
        asking = self.deps.nc.request(
            ADMISSION_REQUEST_SUBJECT, payload, timeout=self.admission_timeout
        )
        if not self.flow_control:
            return await asking, False
        answer = asyncio.ensure_future(asking)
        watcher = asyncio.ensure_future(request.receive())
        try:
            await asyncio.wait((answer, watcher), return_when=asyncio.FIRST_COMPLETED)
            if answer.done() or watcher.result().get("type") != "http.disconnect":
                return await answer, False
            cancel = AdmitCancel(request_id=request_id).model_dump_json().encode()
            await self.deps.nc.publish(ADMISSION_CANCEL_SUBJECT, cancel)
            return await answer, True
        finally:
            if not watcher.done():
                watcher.cancel()
            if not answer.done():
                answer.cancel()

    async def _relay(
        self,
        feature: Feature,
        parsed: ParsedRequest,
        raw: bytes,
        target: Target,
        ids: dict[str, str],
        holder: LeaseHolder | None,
        started: float,
        ending: _RequestEnd,
    ) -> tuple[Response, Outcome | None]:
        """Send the request upstream and answer the client; outcome None: a stream that runs on.

        A stream ends `ending` (and finishes its lease) when it ends; otherwise the caller does.
        """
        inject_usage = self.inject_usage and parsed.stream and not parsed.include_usage
        if inject_usage:  # ask for usage anyway; the usage event is removed on the way back
            options = parsed.body.get("stream_options") or {}
            parsed.body["stream_options"] = {**options, "include_usage": True}
        if parsed.model != target.upstream_model:
            parsed.body["model"] = target.upstream_model
        if inject_usage or parsed.model != target.upstream_model:
            raw = json.dumps(parsed.body).encode()
        ids["x-llmgw-provider"] = target.provider
        ids["x-llmgw-endpoint"] = target.endpoint
        url = target.url.rstrip("/") + _PATHS[feature]
        timeouts = self._timeouts.get(self._canonical.get(parsed.model) or "", self.timeouts)
        deadline = loop_deadline(timeouts.total)
        ending.upstream_started = time.perf_counter()
        try:
            upstream = await open_upstream(
                self.deps.session, url, raw, self._auth[target.provider], timeouts
            )
        except UpstreamFailure as failure:
            return error_response(failure.outcome, failure.message, headers=ids), failure.outcome
        if holder is not None:
            holder.on_lost = upstream.close  # a lost lease cancels the upstream request

        headers = {**passthrough_headers(upstream), **ids}
        if upstream.status != 200:
            ending.upstream_status = upstream.status
            ending.retry_after = _retry_after(upstream.headers.get("retry-after"))
            try:
                body = await read_body(upstream, deadline)
            except UpstreamFailure as failure:
                return self._failure(failure, holder, ids)
            if upstream.status < 500 and upstream.status != 429:
                # The engine judged the request itself (e.g. prompt too long):
                # its answer is the client's answer.
                return Response(
                    body, status_code=upstream.status, headers=headers
                ), Outcome.BAD_REQUEST
            return Response(
                error_body(
                    error_message_from_upstream(body, upstream.status),
                    "upstream_error",
                    "upstream_error",
                ),
                status_code=upstream.status if upstream.status in (429, 503) else 502,
                headers=headers,
                media_type="application/json",
            ), Outcome.UPSTREAM_ERROR

        if not parsed.stream:
            try:
                body = await read_body(upstream, deadline)
            except UpstreamFailure as failure:
                return self._failure(failure, holder, ids)
            ending.usage = usage_in(body)
            return Response(body, status_code=200, headers=headers), Outcome.SUCCESS

        usage = StreamUsage(remove=inject_usage)
        relay = StreamRelay(
            upstream,
            timeouts,
            deadline,
            lease_lost=lambda: holder is not None and holder.lost,
            usage=usage,
        )
        metrics = self.deps.metrics
        ended = False

        def end_once() -> None:
            """The stream's end: release the lease and record the outcome, exactly once."""
            nonlocal ended
            if ended:
                return
            ended = True
            if holder is not None:
                holder.finish(success=relay.outcome is Outcome.SUCCESS)
            ending.usage = usage.usage
            ending.end(relay.outcome)
            metrics.observe(feature, relay.outcome, time.perf_counter() - started)

        async def body_then_finish():
            try:
                async for chunk in relay:
                    yield chunk
            finally:
                end_once()

        headers.setdefault("content-type", "text/event-stream")
        headers["cache-control"] = "no-cache"
        return _EndingStream(body_then_finish(), end_once, upstream, headers=headers), None

    @staticmethod
    def _failure(
        failure: UpstreamFailure, holder: LeaseHolder | None, ids: dict[str, str]
    ) -> tuple[Response, Outcome]:
        if holder is not None and holder.lost:
            return error_response(
                Outcome.LEASE_LOST, LEASE_LOST_MESSAGE, headers=ids
            ), Outcome.LEASE_LOST
        return error_response(failure.outcome, failure.message, headers=ids), failure.outcome

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for lease releases still running in the background (at shutdown)."""
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout)

    # -- non-routed endpoints -------------------------------------------------

    def models_response(self) -> Response:
        created = 0
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}
            for name in self.config.public_model_ids()
        ]
        return JSONResponse({"object": "list", "data": data})

    def model_response(self, model_id: str) -> Response:
        if model_id not in self.config.public_model_ids():
            return error_response(
                Outcome.MODEL_NOT_FOUND, f"The model '{model_id}' does not exist.", param="model"
            )
        return JSONResponse({"id": model_id, "object": "model", "created": 0, "owned_by": "llmgw"})


class _EndingStream(StreamingResponse):
    """A streamed response that ends its request even if its body never starts.

    When the client is gone before the first byte, Starlette fails on sending the
    headers and never starts the body generator, whose `finally` would release
    the lease; this runs the same ending (and closes the upstream) regardless.
    """

    def __init__(self, body, on_end, upstream, *, headers: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
        super().__init__(body, status_code=200, headers=headers)
        self._on_end = on_end
        self._upstream = upstream

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()
            self._upstream.close()


@dataclass(frozen=True, slots=True)
class _Failed:
    """An attempt that failed before anything reached the client (another endpoint may do)."""

    response: Response
    outcome: Outcome
    endpoint: str


# Failures of the endpoint, not of the request: worth another endpoint while nothing was sent.
_RETRYABLE = frozenset(
    {
        Outcome.UPSTREAM_UNREACHABLE,
        Outcome.UPSTREAM_TIMEOUT,
        Outcome.UPSTREAM_ERROR,
        Outcome.UPSTREAM_BROKEN_STREAM,
    }
)
_RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
# Outcomes of an attempt that never reached an upstream (a retry found nowhere else to go).
_ADMISSION_OUTCOMES = frozenset(
    {Outcome.NO_CAPACITY, Outcome.ADMISSION_UNAVAILABLE, Outcome.QUEUE_FULL, Outcome.QUEUE_TIMEOUT}
)


class _RequestEnd:
    """What happens once when a routed request ends, however it ends.

    - a request admission counted on an endpoint (``granted_at``): tell every admission
      instance (RequestDone), so the count ends now rather than at the next scrape;
    - every request that was sent upstream: publish its stats (latency from sending it, tokens
      from its usage; a failure has zero tokens) for the rate balancers, and count its tokens.
    """

    __slots__ = (
        "_edge",
        "_ended",
        "_granted_at",
        "_report_stats",
        "_target",
        "retry_after",
        "upstream_started",
        "upstream_status",
        "usage",
    )

    def __init__(
        self, edge: Edge, target: Target, granted_at: float | None, *, report_stats: bool = True
    ) -> None:
        self._edge = edge
        self._target = target
        self._granted_at = granted_at
        self._report_stats = report_stats
        self._ended = False
        self.upstream_started: float | None = None
        self.upstream_status: int | None = None
        self.retry_after: float | None = None
        self.usage: Usage | None = None

    def end(self, outcome: Outcome) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.time()
        edge, target = self._edge, self._target
        messages = []
        if self._granted_at is not None:
            messages.append(
                (
                    ADMISSION_DONE_SUBJECT,
                    RequestDone(
                        endpoint=target.endpoint,
                        granted_at=self._granted_at,
                        ended_at=now,
                    )
                    .model_dump_json()
                    .encode(),
                )
            )
        if not self._report_stats or self.upstream_started is None:
            if messages:
                edge.publish_later(*messages)
            return
        ok = outcome is Outcome.SUCCESS
        usage = self.usage if ok else None
        stats = RequestStats(
            endpoint=target.endpoint,
            provider=target.provider,
            ended_at=now,
            latency=time.perf_counter() - self.upstream_started,
            ok=ok,
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            outcome=outcome.value,
            status=self.upstream_status,
            retry_after_s=self.retry_after,
        )
        messages.append((REQUEST_STATS_SUBJECT, stats.model_dump_json().encode()))
        edge.publish_later(*messages)
        if usage is not None:
            edge.deps.metrics.tokens.labels("input").inc(usage.input_tokens)
            edge.deps.metrics.tokens.labels("output").inc(usage.output_tokens)


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the delta-seconds form; an HTTP date is ignored)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds <= 3600 else None


class HotPathApp:
    """Serves the three POST routes straight from ASGI, everything else through FastAPI.

    The middleware stack and router of a FastAPI app cost tens of microseconds
    per request; for the routes every request takes, this dispatcher skips
    them. An unexpected exception still ends in an OpenAI-shaped 500.
    """

    def __init__(self, edge: Edge, app: FastAPI) -> None:
        self.edge = edge
        self.app = app
        self._routes = {path: feature for feature, path in _PATHS.items()}

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        feature = self._routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if feature is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await self.edge.handle(Request(scope, receive), feature)
        except Exception:
            log.exception("unexpected error in the edge")
            response = Response(
                error_body("The gateway failed unexpectedly.", "server_error", "internal_error"),
                status_code=500,
                media_type="application/json",
            )
        await response(scope, receive, send)


def create_app(config: Config, deps: EdgeDeps) -> HotPathApp:
    """The client-facing ASGI app (OpenAI API). Lifetimes of deps belong to the caller."""
    edge = Edge(config, deps)
    app = FastAPI(title="llmgw edge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.edge = edge

    def route(feature: Feature):
        async def endpoint(request: Request) -> Response:
            return await edge.handle(request, feature)

        return endpoint

    # HotPathApp answers these first; FastAPI keeps them for 405 on other methods.
    for feature, path in _PATHS.items():
        app.add_route(path, route(feature), methods=["POST"])

    async def list_models(request: Request) -> Response:
        return edge.models_response()

    async def get_model(request: Request) -> Response:
        return edge.model_response(request.path_params["model_id"])

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
