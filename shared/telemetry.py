"""What every service's metrics registry has besides its own metrics.

`service_registry(service)` is a fresh registry (never the global one) holding the process
collector (`process_*`: CPU, memory, file descriptors, start time), the platform collector
(`python_info`) and `llmgw_build_info{service,version}`. Counters and histograms expose no
``_created`` twins: they double the series and no dashboard reads them.

`LabelledChildren` looks up a metric's child by label values without `labels()`'s argument
parsing and lock, for the request path.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector

__all__ = ["LabelledChildren", "build_version", "service_registry"]


def build_version() -> str:
    """The installed llmgw version ("unknown" when run from a tree that is not installed)."""
    try:
        return metadata.version("llmgw")
    except metadata.PackageNotFoundError:  # pragma: no cover - always installed in practice
        return "unknown"


def service_registry(service: str) -> CollectorRegistry:
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
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


class LabelledChildren:
    """Children of labelled metrics, made once per label set: ``children(metric, *values)``.

    `labels()` parses its arguments and takes the metric's lock on every call (~2-4 us); this is
    a dict lookup. The set of label values must stay bounded, as for `labels()` itself."""

    __slots__ = ("_children",)

    def __init__(self) -> None:
        self._children: dict[tuple[object, ...], Any] = {}

    def __call__(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found
