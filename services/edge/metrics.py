"""The edge's Prometheus metrics, in a registry of its own (never the global one).

Request metrics are labelled by model (canonical, from the config), provider and endpoint (from
the config; ``none`` when the request never reached one): every label value comes from the
config or a closed enum, so the series are bounded. The tenant is a label only of
`llmgw_edge_tenant_requests_total`, only with ``metrics.tenant_label``, and for at most
``metrics.max_tenants`` distinct tenants (the rest count as ``other``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from llmgw.services.edge.spend import SpendMetrics
from llmgw.telemetry import LabelledChildren, service_registry

NONE = "none"  # the provider/endpoint label of a request that reached no upstream
OTHER_TENANT = "other"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
_ROUTE = ("model", "provider", "endpoint")


class EdgeMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        tenant_label: bool = False,
        max_tenants: int = 100,
    ) -> None:
        self.registry = registry or service_registry("edge")
        r = self.registry
        # Run before the request metrics are read (a scrape): the ends that wait are counted
        # first (`EdgeTelemetry.flush`).
        self.before_scrape: Callable[[], None] | None = None
        r.register(_BeforeScrape(self))
        self.requests = Counter(
            "llmgw_edge_requests",
            "Requests through the edge by feature, outcome, model, and the provider and endpoint "
            "of their last attempt.",
            ["feature", "outcome", *_ROUTE],
            registry=r,
        )
        self.duration = Histogram(
            "llmgw_edge_request_duration_seconds",
            "End to end: from the request's arrival until its response ended.",
            ["feature", *_ROUTE],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llmgw_edge_time_to_first_token_seconds",
            "Streams: from the request's arrival until its first chunk reached the client.",
            list(_ROUTE),
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "llmgw_edge_time_per_output_token_seconds",
            "Streams: time after the first chunk per further output token.",
            list(_ROUTE),
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.admission_duration = Histogram(
            "llmgw_edge_admission_duration_seconds",
            "Round trip of the admission request over NATS (queueing in flow control included).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.tokens = Counter(
            "llmgw_edge_tokens",
            "Tokens of successful upstream requests, from their usage (direction: input, output).",
            [*_ROUTE, "direction"],
            registry=r,
        )
        self.retries = Counter(
            "llmgw_edge_retries",
            "Requests retried on another endpoint, by the outcome of the failed attempt.",
            ["outcome"],
            registry=r,
        )
        self.fallbacks = Counter(
            "llmgw_edge_fallbacks",
            "Requests served by a fallback model, by the model asked for and the one that served.",
            ["model", "served_model"],
            registry=r,
        )
        self.responses_stored = Counter(
            "llmgw_edge_responses_stored",
            "Responses API responses kept for previous_response_id, by result: stored, too_large "
            "(over the server's largest message), failed (the write did not land).",
            ["result"],
            registry=r,
        )
        self.tenant_requests: Counter | None = None
        self._max_tenants = max_tenants
        self._tenants: set[str] = set()
        if tenant_label:
            self.tenant_requests = Counter(
                "llmgw_edge_tenant_requests",
                "Requests by tenant (a hash of the API key or user), model and outcome.",
                ["tenant", "model", "outcome"],
                registry=r,
            )
        # labels() parses its arguments on every call; the hot path looks children up here.
        self.child = LabelledChildren()
        # llmgw_spend_*: what the attempts cost (services/edge/spend.py).
        self.spend = SpendMetrics(r, self.tenant)

    def tenant(self, tenant: str | None) -> str:
        """The label value of `tenant`: itself for the first `max_tenants`, else ``other``."""
        if tenant is None:
            return NONE
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self._max_tenants:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANT


class _BeforeScrape(Collector):
    """Registered ahead of the edge's metrics: a scrape calls `EdgeMetrics.before_scrape`
    first. It exports nothing."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        if self._metrics.before_scrape is not None:
            self._metrics.before_scrape()
        return ()
