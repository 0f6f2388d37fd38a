"""What admission knows about providers and endpoints: the config plus live endpoint health.

`ProviderCatalog` keeps one RoutingSnapshot (rebuilt whenever the health board
changes) and answers the pinning algorithm's questions from it: providers in
priority order, which (model, feature) each supports, and whether a managed
provider is degraded for a model — none of its endpoints serving the model is
healthy (health comes from probes today, from the scraper later), or an
operator or test marked it so by hand. Unlimited providers are never degraded
(seed 000: no health checks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from llmgw.core.affinity import HashRing, bounded_load_choice
from llmgw.core.requests import Feature
from llmgw.core.routing import EndpointView, ProviderKind, ProviderView, RoutingSnapshot
from llmgw.services.admission.health import HealthBoard

if TYPE_CHECKING:
    from llmgw.config.schema import Config
    from llmgw.core.breaker import BreakerBoard
    from llmgw.services.admission.balancing import RateBoard
    from llmgw.services.admission.loadboard import LoadBoard


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


class ProviderCatalog:
    """The pinning algorithm's view of providers (llmgw.core.pinning.ProviderCatalog)."""

    def __init__(
        self,
        config: Config,
        health: HealthBoard,
        load: LoadBoard | None = None,
        rates: RateBoard | None = None,
        breakers: BreakerBoard | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._breakers = breakers
        self._clock = clock
        self._health = health
        self._load = load
        self._rates = rates
        self._strategy = {p.id: p.endpoint_strategy for p in config.providers}
        self._load_factor = config.scoring.session_load_factor
        self._rings = {
            provider.id: HashRing(
                {e.id: float(e.weight or 1) for e in config.endpoints if e.provider == provider.id}
            )
            for provider in config.providers
            if any(e.provider == provider.id for e in config.endpoints)
        }
        self.forced_degraded: set[tuple[str, str]] = set()  # (provider, model) marked by hand
        self._rebuild()
        health.on_change(self._rebuild)

    def _rebuild(self) -> None:
        self._snapshot = build_snapshot(self._config, self._health)
        self._views = {view.id: view for view in self._snapshot.providers}
        self._order = [view.id for view in self._snapshot.providers]

    def _affinity(
        self, provider: str, session: str, candidates: list[EndpointView], now: float
    ) -> str | None:
        """The session's replica in the highest priority tier that has an unsaturated candidate
        (all saturated or unknown: the highest tier)."""
        assert self._load is not None
        pool = self._load.view([e.id for e in candidates], now)
        if pool is None:
            return None
        tiers = sorted({e.priority for e in candidates}, reverse=True)
        tier: list[str] = []
        for priority in tiers:
            tier = [
                e.id
                for e in candidates
                if e.priority == priority and pool.endpoint_saturation(e.id) < 1.0
            ]
            if tier:
                break
        if not tier:
            tier = [e.id for e in candidates if e.priority == tiers[0]]
        loads = {e: pool.inflight(e) for e in tier}
        return bounded_load_choice(self._rings[provider], session, loads, self._load_factor, tier)

    def in_priority_order(self) -> list[str]:
        return self._order

    def kind(self, provider: str) -> ProviderKind:
        return self._views[provider].kind

    def supports(self, provider: str, model: str, feature: Feature) -> bool:
        view = self._views.get(provider)
        return view is not None and view.supports(model, feature)

    def is_unlimited(self, provider: str) -> bool:
        view = self._views.get(provider)
        return view is not None and view.kind is ProviderKind.UNLIMITED

    def degraded(self, provider: str, model: str) -> bool:
        view = self._views.get(provider)
        if view is None or view.kind is ProviderKind.UNLIMITED:
            return False
        if (provider, model) in self.forced_degraded or view.degraded(model):
            return True
        if self._breakers is None:
            return False
        # Every endpoint serving the model has its breaker open: as good as unhealthy.
        now = self._clock()
        return not any(
            self._breakers.available(e.id, now) for e in view.healthy_endpoints(model, ())
        )

    def endpoint(
        self,
        provider: str,
        model: str,
        exclude: Collection[str] = (),
        *,
        now: float = 0.0,
        prefer: str | None = None,
        session: str | None = None,
    ) -> EndpointView | None:
        """A healthy endpoint of the provider for `model`, or None.

        Strategy "rate" (unlimited providers by default) with a rate board: drawn by seed 001's
        balancer. Strategy "score" with a load board: a request of a session goes to its replica
        by consistent hashing with bounded loads (llmgw.core.affinity; the load is each
        endpoint's inflight, the cap ``scoring.session_load_factor`` x the average) among the
        highest-priority candidates that are not saturated; other requests take `prefer` if it
        is a candidate (the endpoint flow control reserved), else the least saturated candidate
        (ties: highest priority first). Otherwise the highest-priority candidate.
        """
        chosen = self._choose(provider, model, exclude, now, prefer, session)
        if chosen is not None and self._breakers is not None:
            self._breakers.take(chosen.id, now)  # half open: this request is the probe
        return chosen

    def _choose(
        self,
        provider: str,
        model: str,
        exclude: Collection[str],
        now: float,
        prefer: str | None,
        session: str | None,
    ) -> EndpointView | None:
        view = self._views.get(provider)
        candidates = view.healthy_endpoints(model, exclude) if view is not None else []
        if self._breakers is not None:
            candidates = [e for e in candidates if self._breakers.available(e.id, now)]
        if not candidates:
            return None
        if self._strategy.get(provider) == "rate" and self._rates is not None:
            if len(candidates) == 1:
                return candidates[0]
            chosen_id = self._rates.pick([e.id for e in candidates])
            return next(e for e in candidates if e.id == chosen_id)
        if self._load is None or view is None or view.kind is ProviderKind.UNLIMITED:
            return candidates[0]
        by_id = {e.id: e for e in candidates}
        if session is not None and provider in self._rings:
            chosen = self._affinity(provider, session, candidates, now)
            if chosen is not None:
                return by_id[chosen]
        if prefer in by_id:
            return by_id[prefer]
        pool = self._load.view(by_id, now)
        chosen = pool.least_saturated(by_id) if pool is not None else None
        return by_id[chosen] if chosen is not None else candidates[0]
