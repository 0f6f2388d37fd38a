"""Prometheus metrics for a simulated engine, in the dialect of a real one (own registry per
engine).

``EngineParams.metrics_dialect`` picks whose names ``GET /metrics`` speaks; the values are the
same model state whatever the names: running = sequences in the batch, waiting = the queue, KV
usage = blocks holding tokens of running sequences. Each dialect exposes what that engine
exposes, under its names and labels, and nothing it does not (source files as read):

- ``vllm``: vLLM's V1 engine (``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``,
  token, prefix-cache, preemption and success counters, TTFT and end-to-end histograms, and,
  once the engine serves LoRA adapters, ``vllm:lora_requests_info``;
- ``vllm-legacy``: vLLM's V0 engine (``vllm/engine/metrics.py``): the same but KV usage as
  ``vllm:gpu_cache_usage_perc``, plus ``vllm:num_requests_swapped`` and
  ``vllm:cpu_cache_usage_perc`` (both 0: this model never preempts, so never swaps), no
  prefix-cache counters;
- ``sglang`` (``python/sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``, ``sglang:token_usage``, token counters,
  TTFT and end-to-end histograms;
- ``llamacpp``: llama.cpp's ``llama-server --metrics`` (``tools/server``): unlabelled
  ``llamacpp:requests_processing`` (busy slots), ``llamacpp:requests_deferred`` (waiting
  tasks), token counters; no KV gauge (current builds have none);
- ``tgi``: Text Generation Inference (``router/src``): unlabelled ``tgi_batch_current_size``,
  ``tgi_queue_size``; no KV gauge (TGI's counters and histograms are not modelled);
- ``partial``: vLLM's names without KV usage or cache info (an engine that exports only some
  load gauges).

Gauges and counters are read from the model at scrape time (nothing is updated per token);
the latency histograms are observed when a sequence's first token / end happens. vLLM's and
SGLang's series carry ``model_name`` = the engine's first served model name, as vLLM labels an
engine that serves several names.

``vllm:lora_requests_info`` (vLLM and its V0 engine, with LoRA enabled: adapters configured or
loaded at run time) is a gauge whose value is the Unix time it was set and whose labels say
``max_lora`` and the adapters of the running and waiting requests (names joined by commas, no
spaces; empty when none). vLLM sets it every engine step and a label set it no longer sets
stays with its last time, so readers take the series with the latest value; here it is set at
each scrape, and the last `_LORA_SERIES_KEPT` label sets are kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

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


_LORA_SERIES_KEPT = 256  # vLLM keeps every label set; a bound keeps a long demo's memory flat

# The latency histograms per dialect: (TTFT, end-to-end); None: the engine has none we model.
_HISTOGRAMS: dict[str, tuple[str, str] | None] = {
    "vllm": ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"),
    "vllm-legacy": ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"),
    "partial": ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"),
    "sglang": ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"),
    "llamacpp": None,
    "tgi": None,
}


class EngineMetrics:
    """The engine's `CollectorRegistry` and the hooks the model calls."""

    def __init__(
        self, params: EngineParams, model_name: str, *, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self.params = params
        self.dialect = params.metrics_dialect
        self.model_name = model_name
        self.wall_clock = wall_clock
        # LoRA is enabled once the engine serves an adapter (EngineBackend.enable_lora).
        self.lora_enabled = bool(params.lora_modules)
        # (running adapters, waiting adapters) -> Unix time last set, oldest first.
        self.lora_series: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.registry = CollectorRegistry(auto_describe=False)
        self._model: EngineModel | None = None
        self._ttft: Any = None
        self._e2e: Any = None
        names = _HISTOGRAMS[self.dialect]
        if names is not None:
            ttft = Histogram(
                names[0],
                "Histogram of time to first token in seconds.",
                ["model_name"],
                buckets=_TTFT_BUCKETS,
                registry=self.registry,
            )
            e2e = Histogram(
                names[1],
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
        if self._ttft is not None and seq.first_token_at is not None:
            self._ttft.observe(seq.first_token_at - seq.arrived_at)

    def observe_finish(self, seq: Sequence) -> None:
        if self._e2e is not None and seq.finished_at is not None and seq.first_token_at is not None:
            self._e2e.observe(seq.finished_at - seq.arrived_at)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def lora_info(self, model: EngineModel) -> GaugeMetricFamily:
        """``vllm:lora_requests_info``, its current label set set to now."""
        current = (_adapters(model.running), _adapters(model.waiting))
        series = self.lora_series
        series.pop(current, None)
        series[current] = self.wall_clock()
        while len(series) > _LORA_SERIES_KEPT:
            series.popitem(last=False)
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        max_lora = str(self.params.max_loras)
        for (running, waiting), at in series.items():
            family.add_metric([max_lora, waiting, running], at)
        return family


def _adapters(seqs: Iterable[Sequence]) -> str:
    """The adapters of `seqs`, as vLLM's label writes them: names joined by commas."""
    return ",".join(sorted({seq.lora for seq in seqs if seq.lora is not None}))


class _StateCollector:
    """Reads the model's gauges and counters at scrape time, in the engine's dialect."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        model = self._metrics._model
        if model is None:
            return
        dialect = self._metrics.dialect
        if dialect in ("vllm", "vllm-legacy", "partial"):
            yield from _vllm(self._metrics, model, dialect)
        elif dialect == "sglang":
            yield from _sglang(self._metrics.model_name, model)
        elif dialect == "llamacpp":
            yield from _llamacpp(model)
        else:
            yield from _tgi(model)


def _labelled(
    name: str,
) -> tuple[
    Callable[[str, str, float], GaugeMetricFamily], Callable[[str, str, float], CounterMetricFamily]
]:
    """Gauge and counter factories whose one series is labelled ``model_name`` = `name`."""

    def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(metric, doc, labels=["model_name"])
        family.add_metric([name], value)
        return family

    def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(metric, doc, labels=["model_name"])
        family.add_metric([name], value)
        return family

    return gauge, counter


def _vllm(metrics: EngineMetrics, model: EngineModel, dialect: str) -> Iterator[Metric]:
    name = metrics.model_name
    params = metrics.params
    stats = model.stats
    usage = model.kv.usage
    gauge, counter = _labelled(name)
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
    if dialect == "vllm":
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
    elif dialect == "vllm-legacy":
        # V0 swapped preempted requests to CPU memory; this model never preempts.
        yield gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", 0)
        yield gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield gauge(
            "vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", 0
        )
    if dialect != "partial" and metrics.lora_enabled:
        yield metrics.lora_info(model)
    if dialect != "partial":
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
            [str(params.block_size), "auto", "True", str(params.num_gpu_blocks), name], 1.0
        )
        yield info
    yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
    yield counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        stats.generation_tokens,
    )
    if dialect != "vllm-legacy":  # V0 had a hit-rate gauge instead of these counters
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
        success.add_metric([name, reason], count)
    yield success


def _sglang(name: str, model: EngineModel) -> Iterator[Metric]:
    gauge, counter = _labelled(name)
    yield gauge("sglang:num_running_reqs", "The number of running requests.", len(model.running))
    yield gauge(
        "sglang:num_queue_reqs", "The number of requests in the waiting queue.", len(model.waiting)
    )
    yield gauge(
        "sglang:num_used_tokens",
        "The number of used tokens.",
        model.kv.used_blocks * model.params.block_size,
    )
    yield gauge("sglang:token_usage", "The token usage.", model.kv.usage)
    yield counter(
        "sglang:prompt_tokens", "Number of prefill tokens processed.", model.stats.prompt_tokens
    )
    yield counter(
        "sglang:generation_tokens",
        "Number of generation tokens processed.",
        model.stats.generation_tokens,
    )


def _plain_gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(metric, doc, value=value)


def _plain_counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(metric, doc, value=value)


def _llamacpp(model: EngineModel) -> Iterator[Metric]:
    stats = model.stats
    yield _plain_counter(
        "llamacpp:prompt_tokens", "Number of prompt tokens processed.", stats.prompt_tokens
    )
    yield _plain_counter(
        "llamacpp:tokens_predicted",
        "Number of generation tokens processed.",
        stats.generation_tokens,
    )
    yield _plain_gauge(
        "llamacpp:requests_processing", "Number of requests processing.", len(model.running)
    )
    yield _plain_gauge(
        "llamacpp:requests_deferred", "Number of requests deferred.", len(model.waiting)
    )


def _tgi(model: EngineModel) -> Iterator[Metric]:
    yield _plain_gauge("tgi_queue_size", "Requests waiting in the queue.", len(model.waiting))
    yield _plain_gauge(
        "tgi_batch_current_size", "Requests in the current batch.", len(model.running)
    )
