"""The routing view of providers and endpoints at one moment.

Admission builds a RoutingSnapshot from the config and endpoint health; the
pinning algorithm picks the provider, then the snapshot yields the provider's
usable endpoints (highest endpoint priority first). Endpoint scoring and
balancing read the same views.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from llmgw.core.requests import Feature


class ProviderKind(enum.StrEnum):
    MANAGED = "managed"  # our engines: health checks and capacity limits
    UNLIMITED = "unlimited"  # third-party APIs: overflow, neither checks nor limits


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One upstream endpoint as routing sees it."""

    id: str
    url: str
    provider: str
    models: frozenset[str]
    healthy: bool = True
    priority: int = 100
    pool: str = "default"
    weight: int = 100
    upstream_models: Mapping[str, str] = field(default_factory=dict)

    def upstream_model(self, model: str) -> str:
        return self.upstream_models.get(model, model)


@dataclass(frozen=True, slots=True)
class ProviderView:
    """A provider with its endpoints in endpoint-priority order."""

    id: str
    kind: ProviderKind
    features: Mapping[str, frozenset[Feature]]  # model -> supported features
    endpoints: tuple[EndpointView, ...]

    def supports(self, model: str, feature: Feature) -> bool:
        return feature in self.features.get(model, frozenset())

    def healthy_endpoints(self, model: str, exclude: Collection[str] = ()) -> list[EndpointView]:
        return [
            e for e in self.endpoints if model in e.models and e.healthy and e.id not in exclude
        ]

    def degraded(self, model: str) -> bool:
        """A managed provider is degraded for a model when no endpoint of it is healthy.

        Unlimited providers are never degraded: they have no health checks.
        """
        if self.kind is ProviderKind.UNLIMITED:
            return False
        return not self.healthy_endpoints(model)


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """Providers in priority order (managed first), as of one moment."""

    providers: tuple[ProviderView, ...]
