"""The admission service: answers AdmitRequests from edges over NATS.

Several instances share the ADMISSION_QUEUE_GROUP, so each request is
decided by exactly one of them, and all of them share the routing state
(pins and leases in JetStream KV), so limits hold across instances. Per
request: flow control (`llmgw.services.admission.flow`) decides when it may
run, the pinning algorithm (`llmgw.core.pinning`) picks the provider and takes
the lease, and the least saturated healthy endpoint of that provider is the
target.

A request waiting in flow control holds no lease: the lease is taken only
after the grant, so a queue never holds capacity.

Lease ownership: a lease taken here belongs to the edge once the reply is
sent. If no endpoint can take the request after all, the lease is released
here before replying. A reply that never reaches the edge leaves a lease
nobody renews: the reaper reclaims it after pinning.lease_timeout.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.core.breaker import BreakerBoard, BreakerSettings
from llmgw.core.flow import GateDecision
from llmgw.core.pinning import PinningRouter, Placement, Rejection, Route
from llmgw.core.requests import Feature
from llmgw.core.routing import EndpointView
from llmgw.services.admission.balancing import UPSTREAM_FAILURES, RateBoard
from llmgw.services.admission.catalog import ProviderCatalog
from llmgw.services.admission.flow import Admission, FlowControl
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import LoadBoard
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.wire import (
    ADMISSION_DONE_SUBJECT,
    ADMISSION_HEALTH_SUBJECT,
    ADMISSION_QUEUE_GROUP,
    ADMISSION_REQUEST_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitReply,
    AdmitRequest,
    HealthReply,
    Lease,
    PinRef,
    RejectReason,
    RequestDone,
    RequestStats,
    Target,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.events import EventPublisher
    from llmgw.state.routing_state import RoutingState

log = logging.getLogger("llmgw.admission")

# Seconds a client is told to wait (Retry-After) after each retryable rejection.
RETRY_AFTER_S = {
    RejectReason.NO_CAPACITY: 1.0,
    RejectReason.QUEUE_FULL: 1.0,
    RejectReason.QUEUE_TIMEOUT: 1.0,
}
ANONYMOUS_TENANT = "anonymous"  # the tenant of requests that name none
FLOW_REJECTIONS = {
    GateDecision.QUEUE_FULL: (
        RejectReason.QUEUE_FULL,
        "Too many requests are waiting in the '{band}' band; retry later.",
    ),
    GateDecision.EXPIRED: (
        RejectReason.QUEUE_TIMEOUT,
        "The request waited the longest allowed time in the '{band}' band without capacity.",
    ),
    GateDecision.CANCELLED: (RejectReason.CANCELLED, "The client went away while queued."),
}


class AdmissionService:
    """Decides AdmitRequests; owns its NATS subscriptions, not the connection or the state.

    Per request: flow control (when admission.enabled) says whether it may run now, waits, or
    overflows to an unlimited provider; then the pinning algorithm places it and takes its lease;
    then an endpoint of the chosen provider is picked (the least saturated one of a managed
    provider, preferring the one flow control reserved).
    """

    def __init__(
        self,
        config: Config,
        nc: NATS,
        routing: RoutingState,
        health: HealthBoard | None = None,
        *,
        load: LoadBoard | None = None,
        rates: RateBoard | None = None,
        metrics: AdmissionMetrics | None = None,
        events: EventPublisher | None = None,
        rng: random.Random | None = None,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._nc = nc
        self.routing = routing
        self.events = events
        self.health = health or HealthBoard()
        self.load = load or LoadBoard(config, self.health)
        self.metrics = metrics or AdmissionMetrics()
        self.instance = instance or f"admission-{uuid.uuid4().hex[:8]}"
        self._rng = rng or random.Random()
        self._clock = clock
        self.rates = rates or RateBoard(config, rng=self._rng, clock=clock)
        self.breakers = BreakerBoard(
            BreakerSettings(
                failure_threshold=config.router.failure_threshold, cooldown=config.router.cooldown
            ),
            self._rng.random,
        )
        self.catalog = ProviderCatalog(
            config, self.health, self.load, self.rates, self.breakers, clock=clock
        )
        self.router = PinningRouter(
            routing, self.catalog, config.pinning.max_routing_attempts, pause=self._pause
        )
        self._fallbacks = {m.name: tuple(m.fallbacks) for m in config.models}
        self.flow = (
            FlowControl(config, self.load, nc, self.instance, self.metrics, clock=clock)
            if config.admission.enabled
            else None
        )
        self._subs: list[Subscription] = []
        self._in_flight: set[asyncio.Task[None]] = set()

    async def _pause(self, attempt: int) -> None:
        """Jittered backoff between routing attempts: a racing pin creation gets to finish."""
        await asyncio.sleep(self._rng.uniform(0, 0.0005 * attempt))

    def _reject(self, request: AdmitRequest, reason: RejectReason, message: str) -> AdmitReply:
        self.metrics.rejections.labels(reason.value).inc()
        return AdmitReply(
            request_id=request.request_id,
            admitted=False,
            reject_reason=reason,
            message=message,
            retry_after_s=RETRY_AFTER_S.get(reason),
        )

    async def _gate(self, request: AdmitRequest, feature: Feature) -> Admission | AdmitReply:
        """Flow control's verdict, or the rejection to send."""
        assert self.flow is not None
        band = self.flow.band(request.band)
        if band is None:
            return self._reject(
                request, RejectReason.UNKNOWN_BAND, f"Unknown priority band '{request.band}'."
            )
        can_overflow = band.overflow and self.router.can_overflow(request.model, feature)
        admission = await self.flow.admit(
            request.request_id,
            request.model,
            band,
            request.tenant or ANONYMOUS_TENANT,
            can_overflow=can_overflow,
        )
        self.metrics.flow_decisions.labels(band.name, admission.decision.value).inc()
        rejection = FLOW_REJECTIONS.get(admission.decision)
        if rejection is None:
            return admission
        reason, message = rejection
        return self._reject(request, reason, message.format(band=band.name))

    async def decide(self, request: AdmitRequest) -> AdmitReply:
        """Gate, place (provider and lease), then pick the endpoint."""
        model = request.model
        if self._config.resolve_model(model) != model:
            return self._reject(
                request, RejectReason.UNKNOWN_MODEL, f"The model '{model}' does not exist."
            )
        feature = Feature(request.feature)
        admission = None
        if self.flow is not None:
            gated = await self._gate(request, feature)
            if isinstance(gated, AdmitReply):
                return gated
            admission = gated
        if admission is not None and admission.decision is GateDecision.OVERFLOW:
            placed = await self.router.place_overflow(model, feature, edge_id=request.edge_id)
        else:
            placed = await self.router.place(
                model, feature, request.session_id, edge_id=request.edge_id
            )
        served = model
        if placed is Rejection.UNAVAILABLE:
            # Every provider of the model is degraded or full: its fallbacks, in order.
            for fallback in self._fallbacks.get(model, ()):
                attempt = await self.router.place(
                    fallback, feature, request.session_id, edge_id=request.edge_id
                )
                if isinstance(attempt, Placement):
                    placed, served = attempt, fallback
                    self.metrics.fallbacks.labels(model, fallback).inc()
                    break
        if not isinstance(placed, Placement):
            self._drop_reservation(admission)
            if placed is Rejection.UNSUPPORTED:
                return self._reject(
                    request,
                    RejectReason.UNSUPPORTED,
                    f"No provider serves '{model}' for {request.feature} requests.",
                )
            return self._reject(
                request,
                RejectReason.NO_CAPACITY,
                f"No provider can take a '{model}' request right now.",
            )
        await self._announce(placed)
        now = self._clock()
        endpoint = self.catalog.endpoint(
            placed.provider,
            served,
            request.exclude_endpoints,
            now=now,
            prefer=admission.endpoint if admission is not None else None,
            session=request.session_id,
        )
        granted_at = self._settle_reservation(admission, endpoint, now)
        if endpoint is None:
            if placed.lease is not None:
                await self.routing.release_request_lease(placed.lease, refresh_pin=False)
            return self._reject(
                request,
                RejectReason.NO_CAPACITY,
                f"No healthy endpoint of '{placed.provider}' can take '{served}' right now.",
            )
        self.metrics.placements.labels(placed.provider, placed.route.value).inc()
        return AdmitReply(
            request_id=request.request_id,
            admitted=True,
            target=Target(
                provider=placed.provider,
                provider_kind=self.catalog.kind(placed.provider).value,
                endpoint=endpoint.id,
                url=endpoint.url,
                upstream_model=endpoint.upstream_model(served),
            ),
            served_model=served,
            lease=None if placed.lease is None else Lease.from_core(placed.lease),
            pin=PinRef.from_core(placed.pin) if placed.pin is not None and placed.lease else None,
            route=placed.route.value,
            refresh_pin_on_success=placed.refresh_pin_on_success,
            granted_at=granted_at,
        )

    def _drop_reservation(self, admission: Admission | None) -> None:
        if admission is not None and admission.endpoint is not None:
            assert admission.reserved_at is not None
            self.load.forget_grant(admission.endpoint, admission.reserved_at)

    def _settle_reservation(
        self, admission: Admission | None, endpoint: EndpointView | None, now: float
    ) -> float | None:
        """Make the load board count the request on the endpoint it actually goes to.

        Returns the time the count is filed under (the reply's ``granted_at``), or None when
        the target is not a managed endpoint (nothing counted).
        """
        reserved = admission.endpoint if admission is not None else None
        chosen = endpoint.id if endpoint is not None else None
        if reserved == chosen and reserved is not None:
            assert admission is not None
            return admission.reserved_at
        self._drop_reservation(admission)
        if chosen is None or not self.load.knows(chosen):
            return None
        if self.flow is not None:
            self.flow.reserve_endpoint(chosen, now)
        else:
            self.load.record_grant(chosen, now)
        return now

    async def _on_stats(self, msg: Msg) -> None:
        """Every edge's request outcomes: rate samples, and the breakers' evidence."""
        try:
            stats = RequestStats.model_validate_json(msg.data)
        except ValidationError:
            return
        self.rates.add(stats)
        if stats.ok or stats.outcome in UPSTREAM_FAILURES:
            self.breakers.record(
                stats.endpoint,
                stats.ok,
                self._clock(),
                retry_after=stats.retry_after_s if not stats.ok else None,
            )

    async def _on_done(self, msg: Msg) -> None:
        try:
            done = RequestDone.model_validate_json(msg.data)
        except ValidationError:
            return
        self.load.request_ended(done.endpoint, done.granted_at, done.ended_at)

    async def _announce(self, placed: Placement) -> None:
        """Publish the pin change this placement made (core NATS: never waits, never raises)."""
        if self.events is None or placed.pin is None:
            return
        if placed.route is Route.NEW_PIN:
            await self.events.publish_pin_created(placed.pin, placed.lease)
        elif placed.route is Route.REPINNED and placed.moved_from is not None:
            await self.events.publish_pin_moved(placed.moved_from, placed.pin, placed.lease)

    async def _answer(self, msg: Msg) -> None:
        try:
            request = AdmitRequest.model_validate_json(msg.data)
        except ValidationError as exc:
            # An edge of another version gets a clear rejection instead of a timeout.
            log.warning("malformed admission request: %s", exc.errors()[:1])
            reply = AdmitReply(
                request_id="?",
                admitted=False,
                reject_reason=RejectReason.MALFORMED,
                message="malformed admission request",
            )
        else:
            started = time.perf_counter()
            try:
                reply = await self.decide(request)
            except Exception:
                log.exception("admission failed for request %s", request.request_id)
                reply = self._reject(
                    request, RejectReason.NO_CAPACITY, "The admission service failed to decide."
                )
            self.metrics.decision_duration.observe(time.perf_counter() - started)
        if msg.reply:
            await msg.respond(reply.model_dump_json(exclude_none=True).encode())

    async def _on_request(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another; a decision
        # waits on KV round trips, so each runs in its own task.
        task = asyncio.create_task(self._answer(msg))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _on_health(self, msg: Msg) -> None:
        if msg.reply:
            await msg.respond(
                HealthReply(service="admission", instance=self.instance).model_dump_json().encode()
            )

    async def start(self) -> None:
        self._subs.append(
            await self._nc.subscribe(
                ADMISSION_REQUEST_SUBJECT, queue=ADMISSION_QUEUE_GROUP, cb=self._on_request
            )
        )
        self._subs.append(await self._nc.subscribe(ADMISSION_HEALTH_SUBJECT, cb=self._on_health))
        self._subs.append(await self._nc.subscribe(ADMISSION_DONE_SUBJECT, cb=self._on_done))
        self._subs.append(await self._nc.subscribe(REQUEST_STATS_SUBJECT, cb=self._on_stats))
        if self.flow is not None:
            await self.flow.start()
        await self._nc.flush()

    async def stop(self) -> None:
        """Stop taking requests; decisions already under way finish and are answered."""
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        if self.flow is not None:
            await self.flow.stop()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=5)
