"""The admission service: answers AdmitRequests from edges over NATS.

Several instances share the ADMISSION_QUEUE_GROUP, so each request is
decided by exactly one of them. The decision itself is the pure
`llmgw.core.routing.first_available` over a snapshot built from the config
and the health board; this module only decodes, decides and replies.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.core.requests import Feature
from llmgw.core.routing import (
    EndpointView,
    NoRoute,
    ProviderKind,
    ProviderView,
    RoutingSnapshot,
    first_available,
)
from llmgw.services.admission.health import HealthBoard
from llmgw.wire import (
    ADMISSION_HEALTH_SUBJECT,
    ADMISSION_QUEUE_GROUP,
    ADMISSION_REQUEST_SUBJECT,
    AdmitReply,
    AdmitRequest,
    HealthReply,
    RejectReason,
    Target,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config

log = logging.getLogger("llmgw.admission")

# How long a client is told to wait after "no capacity" (until flow control
# computes a real estimate).
NO_CAPACITY_RETRY_AFTER_S = 1.0


def build_snapshot(config: Config, health: HealthBoard) -> RoutingSnapshot:
    """The routing view of `config` with the current health of each endpoint."""
    providers = []
    for provider in config.providers_in_priority_order():
        kind = ProviderKind(provider.kind)
        endpoints = tuple(
            EndpointView(
                id=e.id,
                url=e.url,
                provider=provider.id,
                models=frozenset(e.models),
                healthy=kind is ProviderKind.UNLIMITED or health.is_healthy(e.id),
                priority=e.priority,
                pool=e.pool,
                weight=e.weight,
                upstream_models=dict(e.upstream_model),
            )
            for e in config.endpoints
            if e.provider == provider.id
        )
        endpoints = tuple(sorted(endpoints, key=lambda e: -e.priority))
        features = {m.name: frozenset(Feature(f) for f in m.features) for m in provider.models}
        providers.append(ProviderView(provider.id, kind, features, endpoints))
    return RoutingSnapshot(tuple(providers))


class AdmissionService:
    """Decides AdmitRequests; owns its NATS subscriptions, not the connection."""

    def __init__(self, config: Config, nc: NATS, health: HealthBoard | None = None) -> None:
        self._config = config
        self._nc = nc
        self.health = health or HealthBoard()
        self.instance = f"admission-{uuid.uuid4().hex[:8]}"
        self._snapshot = build_snapshot(config, self.health)
        self.health.on_change(self._rebuild)
        self._subs: list[Subscription] = []

    def _rebuild(self) -> None:
        self._snapshot = build_snapshot(self._config, self.health)

    def decide(self, request: AdmitRequest) -> AdmitReply:
        """The reply to one request (pure given the current snapshot)."""
        if self._config.resolve_model(request.model) != request.model:
            return AdmitReply(
                request_id=request.request_id,
                admitted=False,
                reject_reason=RejectReason.UNKNOWN_MODEL,
                message=f"The model '{request.model}' does not exist.",
            )
        routed = first_available(
            self._snapshot, request.model, Feature(request.feature), request.exclude_endpoints
        )
        if routed is NoRoute.UNSUPPORTED:
            return AdmitReply(
                request_id=request.request_id,
                admitted=False,
                reject_reason=RejectReason.UNSUPPORTED,
                message=f"No provider serves '{request.model}' for {request.feature} requests.",
            )
        if routed is NoRoute.NO_CAPACITY:
            return AdmitReply(
                request_id=request.request_id,
                admitted=False,
                reject_reason=RejectReason.NO_CAPACITY,
                message=f"No healthy endpoint can take '{request.model}' right now.",
                retry_after_s=NO_CAPACITY_RETRY_AFTER_S,
            )
        return AdmitReply(
            request_id=request.request_id,
            admitted=True,
            target=Target(
                provider=routed.provider.id,
                provider_kind=routed.provider.kind.value,
                endpoint=routed.endpoint.id,
                url=routed.endpoint.url,
                upstream_model=routed.endpoint.upstream_model(request.model),
            ),
        )

    async def _on_request(self, msg: Msg) -> None:
        try:
            request = AdmitRequest.model_validate_json(msg.data)
        except ValidationError as exc:
            # Not ours to answer with a decision; an edge of another version
            # gets a clear rejection instead of a timeout.
            log.warning("malformed admission request: %s", exc.errors()[:1])
            reply = AdmitReply(
                request_id="?",
                admitted=False,
                reject_reason=RejectReason.MALFORMED,
                message="malformed admission request",
            )
        else:
            reply = self.decide(request)
        if msg.reply:
            await msg.respond(reply.model_dump_json(exclude_none=True).encode())

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
        await self._nc.flush()

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
