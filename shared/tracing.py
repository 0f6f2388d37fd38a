"""OpenTelemetry traces, off by default (``tracing.enabled``; the SDK is the `tracing` extra).

The span tree of one request, in one trace that starts at the client's ``traceparent`` (or at
the edge when it sends none):

    llmgw.edge.request            the edge, from arrival to the end of the response (SERVER)
    ├── llmgw.admission.decide    the admission instance, from the request's arrival to its
    │                             answer: queue wait (a ``queued`` event) and placement
    └── llmgw.edge.upstream       one per attempt, from sending upstream to its end (CLIENT);
        └── (the engine's spans)  ``traceparent`` is sent upstream with the request

The context crosses NATS in the AdmitRequest's message headers (W3C ``traceparent`` and
``tracestate``) and HTTP in the upstream request's headers. Each service has its own
`TracerProvider` (never the global one), so tests can run several in one process with an
in-memory exporter. With tracing off nothing here runs on the request path but a None check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

try:  # the API ships with fastapi; the SDK only with the `tracing` extra
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR: Any = TraceContextTextMapPropagator()
except ImportError:  # pragma: no cover - an install without the API cannot enable tracing
    trace = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]
    _PROPAGATOR = None

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from llmgw.config.observability import TracingConfig

# `trace` and `otel_context` are re-exported: the services reach the API through this module,
# which stands None in for them when it is not installed.
__all__ = ["Tracing", "current_headers", "open_tracing", "otel_context", "trace"]


class Tracing:
    """One service's tracer. `exporter` replaces the configured OTLP exporter (tests)."""

    def __init__(
        self, service: str, config: TracingConfig, *, exporter: SpanExporter | None = None
    ) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        except ImportError as exc:
            raise RuntimeError(
                "tracing.enabled needs the OpenTelemetry SDK: pip install 'llmgw[tracing]'"
            ) from exc
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": f"llmgw-{service}"}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif config.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint))
            )
        self.tracer = self.provider.get_tracer("llmgw")

    def extract(self, headers: Mapping[str, str] | None) -> Context | None:
        """The remote parent in `headers` (HTTP or NATS), or None."""
        if not headers:
            return None
        parent: Context = _PROPAGATOR.extract(carrier=dict(headers))
        return parent

    def start(self, name: str, parent: Context | None = None, *, server: bool = False) -> Any:
        kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
        return self.tracer.start_span(name, context=parent, kind=kind)

    def start_child(self, name: str, parent_span: Any) -> Any:
        """A CLIENT span under `parent_span` (an upstream call)."""
        return self.tracer.start_span(
            name, context=trace.set_span_in_context(parent_span), kind=trace.SpanKind.CLIENT
        )

    def shutdown(self) -> None:
        self.provider.shutdown()


def headers_of(span: Any) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) naming `span` as the parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def current_headers() -> dict[str, str] | None:
    """The current span's context as message headers; None when no span is recording (tracing
    off, or not sampled): then nothing is added to the message."""
    if trace is None:
        return None
    span = trace.get_current_span()
    if not span.is_recording():
        return None
    return headers_of(span)


def open_tracing(service: str, config: TracingConfig) -> Tracing | None:
    """The service's tracer, or None when tracing is off."""
    return Tracing(service, config) if config.enabled else None
