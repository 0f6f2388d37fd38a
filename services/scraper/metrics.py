"""The scraper's Prometheus metrics, in a registry of its own (never the global one).

Per endpoint (label ``endpoint``): scrapes by result, scrape duration, scrape age, health,
saturation, learned capacity, the engine's metrics dialect and how much of it it shows, and the
engine's own running / waiting / KV usage (a gauge the engine does not report has no series);
for an engine with KV cache events, its batches by result, events left out by reason, replays
by result, the lag of republishing, the last batch's time and the blocks it holds. Per pool
(labels ``provider``, ``pool``): saturation. Endpoints are a config-bounded set, so the labels
stay low-cardinality.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from llmgw.core.kv_events import BatchResult, Dropped, ReplayResult
from llmgw.load import EndpointReport, PoolReport
from llmgw.services.scraper.reports import ScrapeOutcome
from llmgw.telemetry import service_registry

__all__ = ["PUBLISH_KINDS", "ScraperMetrics"]

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PUBLISH_KINDS = ("kv", "event", "prefix")

AgeSource = Callable[[], Iterable[tuple[str, float | None]]]


class ScraperMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or service_registry("scraper")
        r = self.registry
        self.scrapes = Counter(
            "llmgw_scraper_scrapes",
            "Scrapes of an endpoint, by result.",
            ["endpoint", "result"],
            registry=r,
        )
        self.scrape_duration = Histogram(
            "llmgw_scraper_scrape_duration_seconds",
            "Duration of one endpoint's scrape (/health and /metrics, concurrently).",
            ["endpoint"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.round_duration = Histogram(
            "llmgw_scraper_round_duration_seconds",
            "Duration of one round over every endpoint, publishing included.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.rounds = Counter("llmgw_scraper_rounds", "Scrape rounds completed.", registry=r)
        self.last_round = Gauge(
            "llmgw_scraper_last_round_timestamp_seconds",
            "Unix time at which the last round ended.",
            registry=r,
        )
        self.healthy = Gauge(
            "llmgw_scraper_endpoint_healthy",
            "1 when the endpoint's last /health probe answered 200, else 0.",
            ["endpoint"],
            registry=r,
        )
        self.saturation = Gauge(
            "llmgw_scraper_endpoint_saturation",
            "max(queue/target_waiting, kv/kv_ceiling); at least 1 when the metrics are stale.",
            ["endpoint"],
            registry=r,
        )
        self.capacity = Gauge(
            "llmgw_scraper_endpoint_capacity",
            "Batch capacity the scraper holds: configured, stated by the engine, or learned "
            "(the most requests the endpoint was seen running).",
            ["endpoint"],
            registry=r,
        )
        self.running = Gauge(
            "llmgw_scraper_engine_running",
            "Requests running, by the engine's last metrics read.",
            ["endpoint"],
            registry=r,
        )
        self.waiting = Gauge(
            "llmgw_scraper_engine_waiting",
            "Requests waiting, by the engine's last metrics read.",
            ["endpoint"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "llmgw_scraper_engine_kv_usage",
            "KV cache usage (0..1), by the engine's last metrics read.",
            ["endpoint"],
            registry=r,
        )
        self.engine_info = Gauge(
            "llmgw_scraper_engine_info",
            "1 for the metrics dialect (vllm, sglang, llamacpp, tgi; none: no load gauges) and "
            "coverage (full, partial, none) of the endpoint's last successful /metrics read.",
            ["endpoint", "dialect", "metrics"],
            registry=r,
        )
        self._info: dict[str, tuple[str, str]] = {}
        self.pool_saturation = Gauge(
            "llmgw_scraper_pool_saturation",
            "Mean endpoint saturation of a provider's pool.",
            ["provider", "pool"],
            registry=r,
        )
        self.publish_failures = Counter(
            "llmgw_scraper_publish_failures",
            "Reports that could not be written to the load bucket (kv) or published (event), "
            "and KV cache updates the prefix stream did not store (prefix).",
            ["kind"],
            registry=r,
        )
        for kind in PUBLISH_KINDS:
            self.publish_failures.labels(kind)
        self._ages = _AgeCollector()
        r.register(self._ages)
        self.kv_batches = Counter(
            "llmgw_scraper_kv_batches",
            "KV cache event batches read from the endpoint's engine, by result.",
            ["endpoint", "result"],
            registry=r,
        )
        self.kv_events_dropped = Counter(
            "llmgw_scraper_kv_events_dropped",
            "KV cache events left out, by reason.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.kv_replays = Counter(
            "llmgw_scraper_kv_replays",
            "Replays of missed batches asked of the endpoint's engine, by result.",
            ["endpoint", "result"],
            registry=r,
        )
        self.kv_lag = Histogram(
            "llmgw_scraper_kv_lag_seconds",
            "From a batch's timestamp (the engine's clock) to its republishing (the scraper's).",
            ["endpoint"],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.kv_last_batch = Gauge(
            "llmgw_scraper_kv_last_batch_timestamp_seconds",
            "Unix time at which the endpoint's last KV cache event batch was read.",
            ["endpoint"],
            registry=r,
        )
        self.kv_blocks = Gauge(
            "llmgw_scraper_kv_blocks",
            "Blocks the endpoint's engine holds as its KV cache events said (those republished).",
            ["endpoint"],
            registry=r,
        )

    def watch_ages(self, source: AgeSource) -> None:
        """Read scrape ages from `source` at collection time: (endpoint, age or None if never)."""
        self._ages.source = source

    def declare(self, endpoints: Iterable[str]) -> None:
        """Pre-create every endpoint's result series so dashboards see zeros from the start."""
        for endpoint in endpoints:
            for outcome in ScrapeOutcome:
                self.scrapes.labels(endpoint, outcome.value)

    def declare_kv(self, endpoint: str) -> None:
        """Pre-create an endpoint's KV cache event series (zeros from the start)."""
        for result in BatchResult:
            self.kv_batches.labels(endpoint, result.value)
        for reason in Dropped:
            self.kv_events_dropped.labels(endpoint, reason.value)
        for replay in ReplayResult:
            self.kv_replays.labels(endpoint, replay.value)
        self.kv_blocks.labels(endpoint).set(0)

    def observe_scrape(
        self, report: EndpointReport, outcome: ScrapeOutcome, duration: float
    ) -> None:
        endpoint = report.endpoint
        self.scrapes.labels(endpoint, outcome.value).inc()
        self.scrape_duration.labels(endpoint).observe(duration)
        self.healthy.labels(endpoint).set(1 if report.healthy else 0)
        self.capacity.labels(endpoint).set(report.capacity)
        if report.saturation is not None:
            self.saturation.labels(endpoint).set(report.saturation)
        self._observe_info(report)
        sample = report.sample
        if sample is not None:  # the last reading stays; scrape age says how old it is
            for gauge, value in (
                (self.running, sample.running),
                (self.waiting, sample.waiting),
                (self.kv_usage, sample.kv_usage),
            ):
                if value is None:  # not reported by this engine: no series, not a stale one
                    gauge.remove(endpoint)
                else:
                    gauge.labels(endpoint).set(value)

    def _observe_info(self, report: EndpointReport) -> None:
        """One ``llmgw_scraper_engine_info`` series per endpoint: its latest successful read (a
        read that failed leaves the last one)."""
        if report.metrics not in ("full", "partial", "none"):
            return
        dialect = report.sample.dialect.value if report.sample is not None else "none"
        labels = (dialect, report.metrics)
        previous = self._info.get(report.endpoint)
        if previous == labels:
            return
        if previous is not None:
            self.engine_info.remove(report.endpoint, *previous)
        self.engine_info.labels(report.endpoint, *labels).set(1)
        self._info[report.endpoint] = labels

    def observe_pool(self, report: PoolReport) -> None:
        self.pool_saturation.labels(report.provider, report.pool).set(report.saturation)


class _AgeCollector:
    """``llmgw_scraper_scrape_age_seconds``, computed when Prometheus collects (never stale)."""

    def __init__(self) -> None:
        self.source: AgeSource | None = None

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        if self.source is not None:
            for endpoint, age in self.source():
                # +Inf for an endpoint never read: "older than any threshold" for alerts.
                family.add_metric([endpoint], math.inf if age is None else age)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "llmgw_scraper_scrape_age_seconds",
            "Seconds since the endpoint's /metrics was last read successfully, whatever it "
            "held (all, some or none of the load gauges, or a 404); +Inf: never.",
            labels=["endpoint"],
        )
