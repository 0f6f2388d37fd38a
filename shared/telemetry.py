"""What every service's metrics registry has besides its own metrics.

`service_registry(service)` is a fresh registry (never the global one) holding the process
collector (`process_*`: CPU, memory, file descriptors, start time), the platform collector
(`python_info`) and `llmgw_build_info{service,version}`. Counters and histograms expose no
``_created`` twins: they double the series and no dashboard reads them.
"""

from __future__ import annotations

from importlib import metadata

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector

__all__ = ["build_version", "service_registry"]


def build_version() -> str:
    """The installed llmgw version ("unknown" when run from a tree that is not installed)."""
    try:
        return metadata.version("llmgw")
    except metadata.PackageNotFoundError:  # pragma: no cover - always installed in practice
        return "unknown"


def service_registry(service: str) -> CollectorRegistry:
    prometheus_client.disable_created_metrics()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Gauge(
        "llmgw_build_info",
        "Always 1: the llmgw version and the service this process runs.",
        ["service", "version"],
        registry=registry,
    ).labels(service, build_version()).set(1)
    return registry
