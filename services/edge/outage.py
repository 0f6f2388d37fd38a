"""The edge's admission client for `admission.on_nats_outage: local`: admission over NATS while it
is reachable, the edge's own conservative decision while it is not (`llmgw.core.outage`).

Ownership of a local grant: this edge creates the lease (an id under `LOCAL_LEASE_PREFIX`) and
holds it in its lease table *unclaimed*; its place in the `LocalBudget` is taken here and given
back when the request ends (`EdgeLeases.end`). When NATS returns, the next renewal round offers it
to its shard's owner, which takes it into its books as far as its quota covers (see
`llmgw.services.edge.leases`). While NATS is reachable every decision is admission's.

`reject` (the default) needs none of this: `NatsAdmission` fails at once while NATS is
unreachable and the edge answers 503 with Retry-After.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.contracts import AdmissionUnavailable
from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.core.outage import LocalBudget, LocalEndpoint, LocalProvider
from llmgw.core.outcomes import Refusal
from llmgw.core.placement import Route
from llmgw.services.edge.leases import LOCAL_LEASE_PREFIX
from llmgw.wire import AdmitReply, AdmitRequest, ReplyStatus, Target

if TYPE_CHECKING:
    from llmgw.config.schema import Config
    from llmgw.services.edge.admission_client import NatsAdmission

log = logging.getLogger("llmgw.edge.outage")


def local_providers(config: Config, model: str, feature: str) -> tuple[LocalProvider, ...]:
    """The providers serving (model, feature), in the config's priority order, with the pair's
    limits and endpoints (highest endpoint priority first)."""
    providers = []
    for provider in config.providers_in_priority_order():
        served = provider.model(model)
        if served is None or feature not in served.features:
            continue
        endpoints = tuple(
            LocalEndpoint(e.id, e.url, e.upstream_name(model), e.weight)
            for e in config.endpoints_for(provider.id, model)
        )
        limits = served.limits
        providers.append(
            LocalProvider(
                id=provider.id,
                unlimited=not provider.is_managed,
                endpoints=endpoints,
                global_slots=limits.max_global_in_flight_request_slots if limits else None,
                per_session=limits.max_per_session_in_flight_request_slots if limits else None,
            )
        )
    return tuple(providers)


class OutageAdmission:
    """`llmgw.contracts.AdmissionClient`: `NatsAdmission` while NATS is reachable, else a local
    decision within this edge's share (see the module docstring)."""

    def __init__(
        self,
        inner: NatsAdmission,
        config: Config,
        edge_id: str,
        budget: LocalBudget,
        *,
        is_connected: Callable[[], bool],
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.inner = inner
        self.edge_id = edge_id
        self.budget = budget
        self._config = config
        self._is_connected = is_connected
        self._clock = wall_of(clock)
        self._providers: dict[tuple[str, str], tuple[LocalProvider, ...]] = {}
        self._ids = itertools.count()
        self._prefix = f"{LOCAL_LEASE_PREFIX}{edge_id}-{os.urandom(3).hex()}-"
        self.edges = 1  # edges the admission instances last reported (this one at least)
        self.local_grants = 0
        self._outage_logged = False

    def follow(self, config: Config, draining: frozenset[str] = frozenset()) -> None:
        """Decide alone by `config`'s providers, limits and endpoints from the next local
        decision on (each applied config and fleet change, while NATS was reachable): the
        fleet's endpoints as last seen, draining ones left out."""
        if draining:
            kept = [e for e in config.endpoints if e.id not in draining]
            config = config.model_copy(update={"endpoints": kept})
        self._config = config
        self._providers = {}

    # The NatsAdmission lifecycle passes through (start, stop, probe).
    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    async def probe(self) -> bool:
        return await self.inner.probe()

    def ready(self) -> bool:
        """Ready while admission answers, and while NATS is down (this edge decides alone)."""
        return self.inner.ready() or not self._is_connected()

    async def admit(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool]:
        if self._is_connected() or await self.inner.reachable():
            try:
                reply, left = await self.inner.admit(request, client_gone)
            except AdmissionUnavailable as exc:
                if not exc.fast:
                    raise
            else:
                if reply.edges:
                    self.edges = reply.edges
                self._outage_logged = False
                return reply, left
        return self._decide(request), False

    def _decide(self, request: AdmitRequest) -> AdmitReply:
        if not self._outage_logged:
            log.warning(
                "NATS is unreachable: deciding alone within 1/%d of each provider's slots",
                self.edges,
            )
            self._outage_logged = True
        key = (request.model, request.feature)
        providers = self._providers.get(key)
        if providers is None:
            providers = self._providers[key] = local_providers(
                self._config, request.model, request.feature
            )
        choice = self.budget.choose(
            providers, request.model, request.session, request.exclude, self.edges
        )
        if choice is None:
            return AdmitReply(
                id=request.id,
                status=ReplyStatus.REFUSED,
                refusal=Refusal.NO_CAPACITY,
                message=(
                    "The gateway cannot reach NATS and this edge's share of capacity for "
                    f"{request.model!r} is in use."
                ),
                retry_after=1,
            )
        self.budget.take(choice, request.model, request.session)
        self.local_grants += 1
        now = self._clock()
        lease = LeaseRecord(
            lease_id=f"{self._prefix}{next(self._ids)}",
            provider=choice.provider.id,
            model=request.model,
            kind=LeaseKind.TEMPORARY,
            unreserved=True,
            shard=request.shard,
            edge=self.edge_id,
            granted_at=now,
            renewed_at=now,
            session=request.session,
            endpoint=choice.endpoint.id,
        )
        target = Target(
            provider=choice.provider.id,
            provider_kind="unlimited" if choice.provider.unlimited else "managed",
            endpoint=choice.endpoint.id,
            url=choice.endpoint.url,
            upstream_model=choice.endpoint.upstream_model,
        )
        return AdmitReply(
            id=request.id,
            status=ReplyStatus.ADMITTED,
            target=target,
            lease=lease,
            route=Route.LOCAL.value,
        )
