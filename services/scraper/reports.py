"""The scraper's decisions, as pure functions: what a scrape means, and what to publish.

No I/O here: `service.Scraper` fetches ``/health`` and ``/metrics`` (giving `Fetched` values),
and these functions turn the fetched responses into an `EndpointReport`, a scrape outcome (the
metrics label), health transitions and `PoolReport`s. Parsing and saturation math live in
`llmgw.core.engine_metrics` and `llmgw.core.saturation`; this module only applies them.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw.core.context import ContextWindow
from llmgw.core.engine_metrics import (
    EngineDialect,
    EngineSample,
    MetricsFormatError,
    parse_engine_metrics,
)
from llmgw.core.saturation import (
    EndpointLoad,
    SaturationSettings,
    endpoint_saturation,
    is_stale,
    pool_saturation,
    state,
    update,
)
from llmgw.load import EndpointReport, LoadSample, MetricsMode, PoolReport, configured_capacities

if TYPE_CHECKING:
    from llmgw.config import Config
    from llmgw.config.catalog import KvEventsSource

__all__ = [
    "ERROR_TEXT_LIMIT",
    "NO_METRICS_STATUSES",
    "Fetched",
    "ScrapeOutcome",
    "ScrapeTarget",
    "build_report",
    "classify",
    "engine_inflight",
    "failed_report",
    "health_event_verb",
    "health_verdict",
    "known_capacities",
    "kv_event_sources",
    "pool_reports",
    "read_sample",
    "read_window",
    "saturation_settings",
    "scrape_targets",
    "window_paths",
]

# Error texts travel in every report of a failing endpoint: keep them short.
ERROR_TEXT_LIMIT = 300
# Answers to GET /metrics that mean "this server has none": 404, and 501 (llama.cpp's
# "This server does not support metrics endpoint. Start it with `--metrics`").
NO_METRICS_STATUSES = frozenset({404, 501})


class ScrapeOutcome(enum.StrEnum):
    """How one scrape of one endpoint went (closed set: the ``result`` metrics label).

    Precedence, first match wins: no HTTP answer at all (``timeout`` if a request timed out,
    else ``unreachable``), then ``unhealthy`` (``/health`` did not answer 200), then
    ``metrics_error`` (``/metrics`` answered but unreadably), ``no_metrics`` (no ``/metrics``, or
    one without load gauges: the gateway counts the endpoint's load itself), else ``ok`` (all
    or some of the load gauges).
    """

    OK = "ok"
    UNHEALTHY = "unhealthy"
    METRICS_ERROR = "metrics_error"
    NO_METRICS = "no_metrics"
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """A managed endpoint to scrape (from the config's ``endpoints``). ``configured``: its
    batch capacity is configured (what the engine states about it is reported, not used)."""

    endpoint: str
    provider: str
    pool: str
    models: tuple[str, ...]
    url: str  # base URL without a trailing "/"
    served: tuple[str, ...] = ()  # the names its engine serves them under (`upstream_model`)
    configured: bool = False


@dataclass(frozen=True, slots=True)
class Fetched:
    """One GET: the status and body when the endpoint answered, else the error (``status`` None).

    ``timed_out`` is set only for an unanswered request that ran out of time.
    """

    status: int | None = None
    body: str = ""
    error: str | None = None
    timed_out: bool = False

    @property
    def answered(self) -> bool:
        return self.status is not None


def scrape_targets(config: Config) -> list[ScrapeTarget]:
    """Every endpoint of a managed provider, in config order (unlimited providers expose none
    of the engine metrics, and their health is not ours to judge)."""
    configured = configured_capacities(config)
    return [
        ScrapeTarget(
            e.id,
            e.provider,
            e.pool,
            tuple(e.models),
            e.url.rstrip("/"),
            tuple(e.upstream_name(m) for m in e.models),
            e.id in configured,
        )
        for e in config.endpoints
        if config.provider(e.provider).kind == "managed"
    ]


# Where each engine tells its context window, by the dialect of its metrics (None: not known,
# e.g. an engine without metrics): the GETs to try, in order. vLLM and SGLang list it per model
# in `GET /v1/models` (`max_model_len`); llama.cpp in `GET /props`
# (`default_generation_settings.n_ctx`, per slot); TGI in `GET /info` (`max_total_tokens`).
_WINDOW_PATHS: dict[EngineDialect | None, tuple[str, ...]] = {
    EngineDialect.VLLM: ("/v1/models",),
    EngineDialect.SGLANG: ("/v1/models",),
    EngineDialect.LLAMACPP: ("/props",),
    EngineDialect.TGI: ("/info",),
    None: ("/v1/models", "/props", "/info"),
}
# The names a model list may give its window under: vLLM's and SGLang's, and others'.
_MODEL_LIST_FIELDS = ("max_model_len", "context_length", "max_context_length")


def window_paths(dialect: EngineDialect | None) -> tuple[str, ...]:
    """The GETs that may tell the context window of an engine of `dialect`, in order."""
    return _WINDOW_PATHS.get(dialect, _WINDOW_PATHS[None])


def _tokens(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_window(path: str, fetched: Fetched, served: Collection[str]) -> ContextWindow | None:
    """The context window a GET of `path` (one of `window_paths`) tells, if any. From a model
    list: the largest window among the models the endpoint serves them as (`served`; all of
    them when none is listed: vLLM gives one window for every name of an engine)."""
    if fetched.status != 200:
        return None
    try:
        body = json.loads(fetched.body)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    if path == "/props":  # llama.cpp: the context of one slot; the output is not reserved
        settings = body.get("default_generation_settings")
        size = _tokens(settings.get("n_ctx")) if isinstance(settings, dict) else None
        return ContextWindow(size, hold_output=False) if size is not None else None
    if path == "/info":  # TGI: input + max_new_tokens must fit max_total_tokens
        size = _tokens(body.get("max_total_tokens"))
        return ContextWindow(size) if size is not None else None
    entries = body.get("data")
    if not isinstance(entries, list):
        return None
    windows: dict[str, int] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        size = next((t for f in _MODEL_LIST_FIELDS if (t := _tokens(entry.get(f)))), None)
        if size is not None:
            windows[str(entry.get("id"))] = size
    mine = [size for name, size in windows.items() if name in served] or list(windows.values())
    return ContextWindow(max(mine)) if mine else None


def kv_event_sources(config: Config) -> dict[str, KvEventsSource]:
    """Where each endpoint's engine publishes its KV cache events (those that do), by id."""
    return {e.id: e.kv_events for e in config.endpoints if e.kv_events is not None}


def saturation_settings(config: Config) -> SaturationSettings:
    return SaturationSettings(
        target_waiting=config.scoring.target_waiting,
        kv_ceiling=config.scoring.kv_ceiling,
        stale_after=config.router.stale_after,
    )


def _short(text: str) -> str:
    return text if len(text) <= ERROR_TEXT_LIMIT else text[: ERROR_TEXT_LIMIT - 3] + "..."


def health_verdict(health: Fetched) -> tuple[bool, str | None]:
    """Healthy exactly when ``/health`` answered 200; otherwise why not."""
    if health.status == 200:
        return True, None
    if health.status is not None:
        return False, f"HTTP {health.status}"
    return False, _short(health.error or "no answer")


def read_sample(metrics: Fetched) -> tuple[EngineSample | None, MetricsMode, str | None]:
    """The engine's load from a ``/metrics`` answer: (sample, mode, error).

    mode "full" or "partial" (some gauges missing) with a sample; "none" without one (no
    ``/metrics``: 404, or llama.cpp's 501 when started without ``--metrics``; or no load gauges
    in it: not an error, the gateway's own accounting carries the endpoint); "error" when it
    could not be read (no answer, another status, a malformed exposition).
    """
    if metrics.status is None:
        return None, "error", _short(metrics.error or "no answer")
    if metrics.status in NO_METRICS_STATUSES:
        return None, "none", None
    if metrics.status != 200:
        return None, "error", f"HTTP {metrics.status}"
    try:
        sample = parse_engine_metrics(metrics.body)
    except MetricsFormatError as exc:
        return None, "error", _short(str(exc))
    if sample is None:
        return None, "none", None
    return sample, "full" if sample.complete else "partial", None


def classify(
    health: Fetched, metrics: Fetched, *, healthy: bool, mode: MetricsMode
) -> ScrapeOutcome:
    """The scrape's outcome (see `ScrapeOutcome` for the precedence)."""
    if not health.answered and not metrics.answered:
        if health.timed_out or metrics.timed_out:
            return ScrapeOutcome.TIMEOUT
        return ScrapeOutcome.UNREACHABLE
    if not healthy:
        return ScrapeOutcome.UNHEALTHY
    if mode == "error":
        return ScrapeOutcome.METRICS_ERROR
    if mode == "none":
        return ScrapeOutcome.NO_METRICS
    return ScrapeOutcome.OK


def engine_inflight(load: EndpointLoad) -> int:
    """What the engine itself holds (running + waiting) by its latest sample; 0 if none."""
    sample = load.sample
    if sample is None:
        return 0
    return (sample.running or 0) + (sample.waiting or 0)


def build_report(
    target: ScrapeTarget,
    health: Fetched,
    metrics: Fetched,
    load: EndpointLoad,
    *,
    scraped_at: float,
    now: float,
    settings: SaturationSettings,
    scraper: str,
    window: ContextWindow | None = None,
    stated: int | None = None,
) -> tuple[EndpointReport, EndpointLoad, ScrapeOutcome]:
    """The report of one scrape sent at ``scraped_at``, the endpoint's load after it, the outcome;
    `window`: the engine's context window as last read (`read_window`).

    A failed metrics read keeps the previous sample in the load (so the capacity and the last
    reading survive) but not in the report. An endpoint that answers is reported fresh whatever
    its metrics (`update` marks it reported); only an endpoint nobody reports on for
    ``stale_after`` is stale (saturation at least 1.0: scored down, never dropped).
    ``stated``: the batch capacity the engine states (`llmgw.core.engine_capacity`), reported
    as such; it is the endpoint's capacity unless one is configured.
    """
    healthy, health_error = health_verdict(health)
    sample, mode, metrics_error = read_sample(metrics)
    answered = health.answered or metrics.answered
    if stated is not None and not target.configured:
        load = state(load, stated)
    if answered:
        load = update(load, sample, scraped_at)
    saturation = endpoint_saturation(load, now, settings, inflight=engine_inflight(load))
    report = EndpointReport(
        endpoint=target.endpoint,
        provider=target.provider,
        pool=target.pool,
        models=target.models,
        healthy=healthy,
        health_error=health_error,
        sample=LoadSample.from_core(sample) if sample is not None else None,
        metrics=mode,
        metrics_error=metrics_error,
        capacity=load.capacity,
        stated_capacity=stated,
        saturation=saturation,
        scraped_at=scraped_at,
        scraper=scraper,
        context_window=window.tokens if window is not None else None,
        window_holds_output=window.hold_output if window is not None else True,
    )
    return report, load, classify(health, metrics, healthy=healthy, mode=mode)


def failed_report(
    target: ScrapeTarget,
    health: Fetched,
    load: EndpointLoad,
    error: str,
    *,
    scraped_at: float,
    now: float,
    settings: SaturationSettings,
    scraper: str,
    window: ContextWindow | None = None,
    stated: int | None = None,
) -> tuple[EndpointReport, EndpointLoad, ScrapeOutcome]:
    """The report of a scrape whose metrics the scraper itself failed to process (`build_report`
    raised: a bug): as for metrics that could not be read. The endpoint's health is still its
    ``/health`` verdict, and the metrics count as an error (no sample: the gateway's own
    accounting), so a fault on this side never makes a healthy engine look saturated."""
    return build_report(
        target,
        health,
        Fetched(error=error),
        load,
        scraped_at=scraped_at,
        now=now,
        settings=settings,
        scraper=scraper,
        window=window,
        stated=stated,
    )


def health_event_verb(previous: bool | None, healthy: bool) -> str | None:
    """ "healthy"/"unhealthy" when the verdict changed, or is this scraper's first for the
    endpoint (``previous`` None: subscribers learn the initial state); None otherwise."""
    if previous is not None and previous == healthy:
        return None
    return "healthy" if healthy else "unhealthy"


def pool_reports(
    targets: Sequence[ScrapeTarget],
    loads: Mapping[str, EndpointLoad],
    healthy: Mapping[str, bool],
    *,
    now: float,
    settings: SaturationSettings,
    scraper: str,
) -> list[PoolReport]:
    """One report per (provider, pool), in order of first appearance among ``targets``.

    An endpoint absent from ``loads`` counts as never sampled (stale), absent from ``healthy``
    as not healthy: the pool report never looks better than what was actually observed.
    """
    pools: dict[tuple[str, str], list[str]] = {}
    for target in targets:
        pools.setdefault((target.provider, target.pool), []).append(target.endpoint)
    reports = []
    for (provider, pool), members in pools.items():
        member_loads = {e: loads.get(e, EndpointLoad()) for e in members}
        inflight = {e: engine_inflight(load) for e, load in member_loads.items()}
        reports.append(
            PoolReport(
                provider=provider,
                pool=pool,
                endpoints=tuple(members),
                healthy=tuple(e for e in members if healthy.get(e, False)),
                stale=tuple(e for e in members if is_stale(member_loads[e], now, settings)),
                saturation=pool_saturation(member_loads, now, settings, inflight),
                measured_at=now,
                scraper=scraper,
            )
        )
    return reports


def known_capacities(reports: Iterable[EndpointReport]) -> dict[str, int]:
    """The largest capacity any report shows per endpoint (a floor for a starting scraper)."""
    capacities: dict[str, int] = {}
    for report in reports:
        capacities[report.endpoint] = max(capacities.get(report.endpoint, 0), report.capacity)
    return capacities
