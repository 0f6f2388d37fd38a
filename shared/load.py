"""Endpoint load reports: what the scraper learns about each managed endpoint, on the wire.

One `EndpointReport` per managed endpoint per scrape. The scraper

- puts it in the load bucket (JetStream KV, config ``router.load_bucket``) under
  `report_key(endpoint)`, so a newly started admission instance reads current state at once
  (a KV watch delivers the last report of every endpoint, then every new one);
- publishes it on `endpoint_event_subject("scraped", provider)`, and a health transition on
  ``...endpoint.healthy.<provider>`` / ``...endpoint.unhealthy.<provider>`` (docs/events.md).

After each round it also publishes one `PoolReport` per (provider, pool) on
`pool_event_subject("measured", provider)`, for dashboards (not kept in the bucket: admission
derives pool saturation from the endpoint reports, with its own grants counted).

Several scrapers may run. Duplicates are harmless by construction rather than avoided: a report
is a complete, timestamped state (never a delta), readers keep the newest report per endpoint
(`scraped_at`) and the largest learned capacity, so two scrapers only cost the engines a second
scrape. Health transition events may then be announced once per scraper.

Times are unix seconds by the scraper's clock; readers compare them with their own clock to
judge staleness, so hosts must keep their clocks in sync (NTP: a few ms matter little next to
``router.stale_after``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmgw.core.engine_metrics import EngineDialect, EngineSample

if TYPE_CHECKING:
    from llmgw.config.schema import Config

__all__ = [
    "ENDPOINT_EVENT_VERBS",
    "LOAD_BUCKET_HISTORY",
    "LOAD_BUCKET_STORAGE",
    "POOL_EVENT_VERBS",
    "REPORT_KEY_PREFIX",
    "EndpointReport",
    "LoadSample",
    "MetricsMode",
    "PoolReport",
    "capacity_floors",
    "configured_capacities",
    "endpoint_event_subject",
    "pool_event_subject",
    "report_key",
]

REPORT_KEY_PREFIX = "endpoint."
# How an endpoint's metrics were read (`EndpointReport.metrics` says what each means).
MetricsMode = Literal["full", "partial", "none", "error"]
# `llmgw.v1.events.endpoint.<verb>.<provider>`: one vocabulary with the routing events.
ENDPOINT_EVENT_VERBS = ("scraped", "healthy", "unhealthy")
POOL_EVENT_VERBS = ("measured",)
# How every user opens the load bucket (`open_routing_bucket(js, config.router.load_bucket,
# storage=LOAD_BUCKET_STORAGE, history=LOAD_BUCKET_HISTORY, replicas=config.replicas_of(
# config.router.load_bucket))`): an opener asking for other settings gets BucketConfigMismatch.
# Memory storage: the reports are rebuilt every scrape interval, so surviving a server restart
# is worth nothing; history 1: only the latest counts.
LOAD_BUCKET_STORAGE = "memory"
LOAD_BUCKET_HISTORY = 1


def configured_capacities(config: Config) -> dict[str, int]:
    """The managed endpoints whose batch capacity the configuration states: their
    ``capacity``, else a simulated engine's ``max_num_seqs``. A count above it is queue
    (`llmgw.core.saturation`); the others' capacity is the engine's own statement, or learned."""
    managed = {p.id for p in config.providers if p.kind == "managed"}
    stated = {}
    for endpoint in config.endpoints:
        if endpoint.provider not in managed:
            continue
        simulated = getattr(endpoint.simulate, "max_num_seqs", None)
        if endpoint.capacity is not None:
            stated[endpoint.id] = endpoint.capacity
        elif simulated is not None:
            stated[endpoint.id] = int(simulated)
    return stated


def capacity_floors(config: Config) -> dict[str, int]:
    """Each managed endpoint's batch capacity before anything was observed: what the
    configuration states (`configured_capacities`), else ``scoring.target_inflight`` scaled by
    its weight relative to the heaviest managed endpoint (at least 1). Never 0: a cold engine
    with free slots must not look full."""
    managed = {p.id for p in config.providers if p.kind == "managed"}
    endpoints = [e for e in config.endpoints if e.provider in managed]
    top = max((e.weight for e in endpoints), default=1)
    stated = configured_capacities(config)
    floors = {}
    for endpoint in endpoints:
        if endpoint.id in stated:
            floors[endpoint.id] = stated[endpoint.id]
        else:
            scaled = config.scoring.target_inflight * endpoint.weight / top
            floors[endpoint.id] = max(1, math.ceil(scaled))
    return floors


def report_key(endpoint_id: str) -> str:
    """The load bucket key of an endpoint's latest report (endpoint ids are key-safe slugs)."""
    return REPORT_KEY_PREFIX + endpoint_id


def endpoint_event_subject(verb: str, provider: str) -> str:
    if verb not in ENDPOINT_EVENT_VERBS:
        raise ValueError(f"unknown endpoint event verb {verb!r}")
    return f"llmgw.v1.events.endpoint.{verb}.{provider}"


def pool_event_subject(verb: str, provider: str) -> str:
    """`llmgw.v1.events.pool.<verb>.<provider>` (pool names may hold "/": never a token)."""
    if verb not in POOL_EVENT_VERBS:
        raise ValueError(f"unknown pool event verb {verb!r}")
    return f"llmgw.v1.events.pool.{verb}.{provider}"


class LoadSample(BaseModel):
    """The engine's own load gauges at scrape time (see llmgw.core.engine_metrics); a gauge the
    engine does not expose is None."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    dialect: EngineDialect
    running: int | None = Field(None, ge=0)
    waiting: int | None = Field(None, ge=0)
    kv_usage: float | None = Field(None, ge=0, le=1)
    # Its KV cache (vllm:cache_config_info): what bounds its prefix index in admission.
    block_size: int | None = Field(None, ge=1)
    num_gpu_blocks: int | None = Field(None, ge=1)
    # LoRA adapters in its batch or queue (vllm:lora_requests_info): loaded, so preferred.
    lora_adapters: tuple[str, ...] | None = None

    @classmethod
    def from_core(cls, sample: EngineSample) -> LoadSample:
        return cls(
            dialect=sample.dialect,
            running=sample.running,
            waiting=sample.waiting,
            kv_usage=sample.kv_usage,
            block_size=sample.block_size,
            num_gpu_blocks=sample.num_gpu_blocks,
            lora_adapters=sample.lora_adapters,
        )

    def to_core(self) -> EngineSample:
        return EngineSample(
            self.dialect,
            self.running,
            self.waiting,
            self.kv_usage,
            self.block_size,
            self.num_gpu_blocks,
            self.lora_adapters,
        )


class EndpointReport(BaseModel):
    """One endpoint at one scrape.

    Invariants: ``sample`` is None when the engine exposes no load gauges or they could not be
    read (``metrics_error`` says why); ``metrics`` says which: "full" (running, waiting and KV
    usage), "partial", "none" (no load gauges: the gateway's own accounting carries the load),
    or "error" (unreadable); ``healthy`` is the /health probe's verdict (False also when unreachable);
    ``capacity`` is the batch capacity the scraper holds: configured, else the engine's own
    statement, else learned (the high-water mark of ``running``), never decreasing within one
    scraper's life unless the engine states less; ``stated_capacity`` is what the engine itself
    says it runs at once (SGLang's ``/server_info``, TGI's ``/info``, llama.cpp's ``/props``;
    `llmgw.core.engine_capacity`; the latest answer, repeated in every report), None when it
    says nothing; ``saturation`` is the scraper's own reading, for dashboards: admission
    recomputes it with its own grants counted; ``context_window`` is the window the engine last
    reported (kept while a later read fails), None when it never did.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    endpoint: str
    provider: str
    pool: str
    models: tuple[str, ...]
    healthy: bool
    health_error: str | None = None
    sample: LoadSample | None = None
    metrics: MetricsMode | None = None
    metrics_error: str | None = None
    capacity: int = Field(0, ge=0)
    stated_capacity: int | None = Field(None, ge=1)
    saturation: float | None = None
    scraped_at: float  # unix seconds when the scrape was sent
    scraper: str  # the instance that made it
    # The engine's context window in tokens, as it last said it (vLLM's max_model_len, ...;
    # llmgw.core.context), and whether the requested output must fit in it beside the prompt
    # (False: llama.cpp, which only refuses a prompt that fills the context). None: not known.
    context_window: int | None = Field(None, ge=1)
    window_holds_output: bool = True

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


class PoolReport(BaseModel):
    """One pool (the endpoints of one provider sharing ``pool``) after one scraper round.

    Invariants: ``endpoints`` lists every configured endpoint of the pool, in config order (a
    stale or unreachable one included: never dropped); ``healthy`` and ``stale`` are subsets of
    it; ``saturation`` is the mean endpoint saturation (`llmgw.core.saturation.pool_saturation`,
    stale endpoints counted as at least 1.0) by the scraper's own reading, without admission's
    grants.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    provider: str
    pool: str
    endpoints: tuple[str, ...]
    healthy: tuple[str, ...]
    stale: tuple[str, ...]
    saturation: float = Field(ge=0)
    measured_at: float  # unix seconds when the round's reports were complete
    scraper: str

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()
