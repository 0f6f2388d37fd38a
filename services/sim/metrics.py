"""vLLM-compatible Prometheus metrics for a simulated engine (own registry per engine).

Gauges and counters are read from the model at scrape time (nothing is updated per token);
the latency histograms are observed when a sequence's first token / end happens. Every series
carries ``model_name`` = the engine's first served model name, as vLLM labels an engine that
serves several names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.services.sim.params import EngineParams

if TYPE_CHECKING:
    from llmgw.services.sim.engine_model import EngineModel, Sequence

__all__ = ["EngineMetrics"]

# vLLM's buckets for time to first token and end-to-end latency.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    """The engine's `CollectorRegistry` and the hooks the model calls."""

    def __init__(self, params: EngineParams, model_name: str) -> None:
        self.params = params
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._model: EngineModel | None = None
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            ["model_name"],
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self._ttft = ttft.labels(model_name)
        self._e2e = e2e.labels(model_name)
        self.registry.register(_StateCollector(self))

    def bind(self, model: EngineModel) -> None:
        self._model = model

    def observe_first_token(self, seq: Sequence) -> None:
        if seq.first_token_at is not None:
            self._ttft.observe(seq.first_token_at - seq.arrived_at)

    def observe_finish(self, seq: Sequence) -> None:
        if seq.finished_at is not None and seq.first_token_at is not None:
            self._e2e.observe(seq.finished_at - seq.arrived_at)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StateCollector:
    """Reads the model's gauges and counters at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        model = self._metrics._model
        if model is None:
            return
        name = [self._metrics.model_name]
        params = self._metrics.params
        stats = model.stats
        usage = model.kv.usage

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(model.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(model.waiting),
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage (older name).",
            usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "model_name",
            ],
        )
        info.add_metric(
            [str(params.block_size), "auto", "True", str(params.num_gpu_blocks), name[0]], 1.0
        )
        yield info
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        # vLLM counts preemptions; this model never preempts (running sequences hold
        # reservations for their whole output, see engine_model), so the counter stays 0.
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 0)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in stats.finished.items():
            success.add_metric([name[0], reason], count)
        yield success
