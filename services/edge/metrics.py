"""The edge's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from llmgw.core.outcomes import Outcome
from llmgw.core.requests import Feature

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


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "llmgw_edge_requests",
            "Requests through the edge by feature and outcome.",
            ["feature", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "llmgw_edge_request_duration_seconds",
            "Time from the request's arrival until its response ended.",
            ["feature"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission_duration = Histogram(
            "llmgw_edge_admission_duration_seconds",
            "Round trip of the admission request over NATS.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.tokens = Counter(
            "llmgw_edge_tokens",
            "Tokens of successful upstream requests, from their usage (direction: input, output).",
            ["direction"],
            registry=self.registry,
        )
        for direction in ("input", "output"):
            self.tokens.labels(direction)
        self.retries = Counter(
            "llmgw_edge_retries",
            "Requests retried on another endpoint, by the outcome of the failed attempt.",
            ["outcome"],
            registry=self.registry,
        )
        # Pre-create every label pair so dashboards see zeros, and the hot
        # path does a dict lookup instead of labels() parsing.
        self._requests = {
            (f, o): self.requests.labels(f.value, o.value) for f in Feature for o in Outcome
        }
        self._duration = {f: self.duration.labels(f.value) for f in Feature}

    def observe(self, feature: Feature, outcome: Outcome, seconds: float) -> None:
        self._requests[feature, outcome].inc()
        self._duration[feature].observe(seconds)
