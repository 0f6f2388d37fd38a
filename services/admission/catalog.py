"""The provider catalog the pinning algorithm reads: config plus live endpoint health.

A managed provider is *degraded* for a model when none of its endpoints that
serve the model is healthy (the health board, fed by probes today and by the
scraper later). Operators and tests can also mark a provider degraded by
hand. Unlimited providers are never degraded (seed 000: no health checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.core.requests import Feature
from llmgw.services.admission.health import HealthBoard

if TYPE_CHECKING:
    from llmgw.config.schema import Config


class ConfigCatalog:
    """Providers in priority order with their features and current degradation."""

    def __init__(self, config: Config, health: HealthBoard) -> None:
        self._health = health
        self._order = [p.id for p in config.providers_in_priority_order()]
        self._managed = {p.id for p in config.providers if p.kind == "managed"}
        self._features = {
            (p.id, m.name): frozenset(Feature(f) for f in m.features)
            for p in config.providers
            for m in p.models
        }
        self._endpoints: dict[tuple[str, str], list[str]] = {}
        for endpoint in config.endpoints:
            for model in endpoint.models:
                self._endpoints.setdefault((endpoint.provider, model), []).append(endpoint.id)
        self.forced_degraded: set[tuple[str, str]] = set()  # (provider, model) marked by hand

    def in_priority_order(self) -> list[str]:
        return self._order

    def supports(self, provider: str, model: str, feature: Feature) -> bool:
        return feature in self._features.get((provider, model), ())

    def degraded(self, provider: str, model: str) -> bool:
        if provider not in self._managed:
            return False
        if (provider, model) in self.forced_degraded:
            return True
        return not any(self._health.is_healthy(e) for e in self._endpoints.get((provider, model), ()))
