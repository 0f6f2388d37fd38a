"""Settings for operating the gateway: logs, metrics, replayable events and traces.

Four sections, each optional with defaults that cost nothing on the request path: text logs at
`info` with an access log line per request, metrics without tenant labels, an events stream
kept for an hour, tracing off.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmgw.config.common import StrictModel
from llmgw.config.durations import PositiveDuration

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class LogConfig(StrictModel):
    """`log`: format and levels of every service's log (stderr)."""

    # text: one human line per record (the terminal of `llmgw up`); json: one object per line.
    format: Literal["text", "json"] = "text"
    level: LogLevel = "info"
    # Per logger overrides, e.g. {"llmgw.admission": "debug"}.
    levels: dict[str, LogLevel] = Field(default_factory=dict)
    # The edge's access log (logger `llmgw.access`): one line per request.
    access_log: bool = True
    # Share of successful requests that get an access line (errors always do): 1.0 logs all.
    access_sample: float = Field(1.0, ge=0.0, le=1.0)


class MetricsConfig(StrictModel):
    """`metrics`: label choices for the services' Prometheus metrics."""

    # Label the edge's request counters with the tenant (a hash of the API key or `user`).
    tenant_label: bool = False
    # Distinct tenants labelled at most; the rest count under tenant="other" (bounded series).
    max_tenants: int = Field(100, ge=1, le=10_000)


class EventsConfig(StrictModel):
    """`events`: the JetStream stream that keeps `llmgw.v1.events.>` for late subscribers."""

    enabled: bool = True
    stream: str = Field("llmgw_events", pattern=r"^[A-Za-z0-9_-]+$")
    max_age: PositiveDuration = 3600.0
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    storage: Literal["file", "memory"] = "file"


class TracingConfig(StrictModel):
    """`tracing`: OpenTelemetry spans (needs the `tracing` extra). Off by default."""

    enabled: bool = False
    # OTLP/HTTP traces endpoint (e.g. http://collector:4318/v1/traces); None: no exporter
    # (spans are still made and propagated, for an in-process exporter or a test).
    otlp_endpoint: str | None = None
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
