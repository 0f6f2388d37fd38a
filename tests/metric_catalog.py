"""Every metric family each service exports, read from the services' own registries.

Each registry is built as the service's composition root builds it (admission with its load,
breaker and ledger collectors on a started instance), so a metric renamed in the code changes
what this returns, and the tests over docs/metrics.md, the Grafana dashboard and the alert rules
see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from inproc import start_admission
from prometheus_client import CollectorRegistry

from llmgw.config import Config
from llmgw.services.admission.compose import watch_service
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.reaper.metrics import ReaperMetrics
from llmgw.services.scraper.metrics import ScraperMetrics

# Suffixes Prometheus adds to a family's name in the exposition, by type.
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Family:
    service: str
    name: str  # the family's name (a counter's without _total)
    type: str
    labels: frozenset[str]
    help: str

    @property
    def series(self) -> tuple[str, ...]:
        """The names a query can use: the exposition's sample names."""
        return tuple(self.name + s for s in _SUFFIXES.get(self.type, ("",)))


def families_of(service: str, registry: CollectorRegistry) -> list[Family]:
    found = []
    for collector in list(registry._collector_to_names):  # every collector, children or not
        for family in collector.collect():
            labels: set[str] = set()
            labels.update(getattr(collector, "_labelnames", ()))
            labels.update(getattr(family, "_labelnames", ()))
            for sample in family.samples:
                labels.update(k for k in sample.labels if k not in ("le", "quantile"))
            found.append(
                Family(service, family.name, family.type, frozenset(labels), family.documentation)
            )
    return found


async def exported_families(config: Config, nats_url: str) -> list[Family]:
    """Every family of edge, admission, scraper and reaper (process metrics included)."""
    families = families_of("edge", EdgeMetrics(tenant_label=True).registry)
    scraper = ScraperMetrics()
    scraper.watch_ages(lambda: [("engine-1", 1.0)])
    families += families_of("scraper", scraper.registry)
    families += families_of("reaper", ReaperMetrics().registry)
    admission = await start_admission(config, nats_url, instance="catalog", follow_load=False)
    try:
        service = admission.service
        metrics = AdmissionMetrics()
        metrics.watch_load(service.load, [m.name for m in config.models])
        watch_service(metrics, service)
        families += families_of("admission", metrics.registry)
    finally:
        await admission.stop()
    return families
