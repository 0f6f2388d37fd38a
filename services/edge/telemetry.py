"""What the edge records about each request: its metrics and its access log line.

A `RequestRecord` is made when a request arrives and filled as it goes (the model asked, band,
tenant by the ingress; provider, endpoint, route, served model, status and usage by each
attempt; the first chunk's time by a stream). `EdgeTelemetry.ended` is called exactly once per
request, once its response has been sent (for a stream: when its body ended); it notes the time,
and within `HOLD` seconds one batch writes the ends of that window (`EdgeTelemetry.flush`):

- metrics (`EdgeMetrics`): requests, end-to-end duration, TTFT and TPOT for streams, tokens;
- one access line (logger ``llmgw.access``, fields below); successful requests are sampled at
  ``log.access_sample``, every other outcome is always logged;
- with tracing on, the request's span and each attempt's upstream span (`llmgw.tracing`).

Access fields: request_id, feature, model (asked), served_model, provider, endpoint, route,
band, tenant, stream, status, outcome, ttft_ms, duration_ms, prompt_tokens, completion_tokens,
retries.

Writing them waits so that it is off the client's critical path: a sequential client's next
request is read, admitted and on its way upstream before the last one's metrics and access line
are written (what the next request depends on, the lease's release, the tpm key's tokens, the
budget's settlement, is done at the end itself: services/edge/attempts.py). With few requests in
flight, the ends are written as soon as a request has been sent upstream, while the edge waits
for its answer (`upstream_wait`), so the window's timer does not fall in a request's own turn;
under load the window's batch is what saves work. A scrape of the
edge's metrics (`EdgeMetrics.before_scrape`) and the edge's stop write what waits first; outside
an event loop an end is written at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw.core.outcomes import Outcome
from llmgw.logs import AccessLog
from llmgw.services.edge.metrics import NONE
from llmgw.tracing import headers_of, otel_context, trace

if TYPE_CHECKING:
    from llmgw.config.observability import LogConfig
    from llmgw.core.requests import Feature
    from llmgw.core.usage import Usage
    from llmgw.services.edge.metrics import EdgeMetrics
    from llmgw.tracing import Tracing

access_log = logging.getLogger("llmgw.access")
log = logging.getLogger("llmgw.edge.telemetry")

HOLD = 0.002  # seconds the ends of a window wait to be written together
# With at most this many requests in flight, what waits is written while a request waits for
# its upstream's answer (`upstream_wait`), not at the window's end.
QUIET_IN_FLIGHT = 2


@dataclass(slots=True)
class RequestRecord:
    """One request as the edge saw it; mutated only by the task handling it."""

    request_id: str
    feature: Feature
    started: float  # perf_counter at arrival
    asked_model: str | None = None
    model: str | None = None  # canonical
    served_model: str | None = None
    provider: str | None = None
    endpoint: str | None = None
    route: str | None = None
    band: str | None = None
    tenant: str | None = None
    stream: bool = False
    first_token: float | None = None  # perf_counter when a stream's first chunk was read
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    span: Any = None  # llmgw.edge.request, with tracing on
    upstream_span: Any = None  # the current attempt's llmgw.edge.upstream
    # Work that waits until the response has been sent (the attempt's end, the access line):
    # off the client's critical path, run in order by `sent`, exactly once.
    after_sent: list[Callable[[], None]] | None = None

    def when_sent(self, work: Callable[[], None]) -> None:
        """Run `work` once the response has been sent (or failed to be)."""
        if self.after_sent is None:
            self.after_sent = [work]
        else:
            self.after_sent.append(work)

    def sent(self) -> None:
        """The response has been sent, or sending it failed: run the deferred work."""
        work, self.after_sent = self.after_sent, None
        for step in work or ():
            step()

    def attempt_ended(
        self,
        provider: str,
        endpoint: str,
        route: str | None,
        served_model: str | None,
        usage: Usage | None,
    ) -> None:
        """An attempt on `endpoint` ended (the last one's values are the request's)."""
        if self.upstream_span is not None:
            self.upstream_span.set_attributes(
                {"llmgw.provider": provider, "llmgw.endpoint": endpoint, "llmgw.route": route or ""}
            )
            self.upstream_span.end()
            self.upstream_span = None
        self.provider = provider
        self.endpoint = endpoint
        self.route = route
        self.served_model = served_model
        if usage is not None:
            self.prompt_tokens = usage.input_tokens
            self.completion_tokens = usage.output_tokens


class EdgeTelemetry:
    def __init__(
        self,
        metrics: EdgeMetrics,
        log: LogConfig | None = None,
        rng: random.Random | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.sample = log.access_sample if log is not None else 1.0
        self.access = log.access_log if log is not None else True
        self._rng = rng or random.Random()
        self._access_log = AccessLog(access_log)
        self.hold = HOLD
        self._pending: list[tuple[RequestRecord, Outcome, int, float]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False  # a write is due at the loop's next turn (`upstream_wait`)
        metrics.before_scrape = self.flush

    def began(self, record: RequestRecord, headers: Mapping[str, str]) -> None:
        """With tracing: the request's span (child of the client's ``traceparent``), made the
        current span of the request's task, so admission requests carry it over NATS."""
        if self.tracing is None:
            return
        record.span = self.tracing.start(
            "llmgw.edge.request", self.tracing.extract(headers), server=True
        )
        otel_context.attach(trace.set_span_in_context(record.span))  # one task per request

    def upstream_headers(self, record: RequestRecord, headers: dict[str, str]) -> dict[str, str]:
        """With tracing: start the attempt's upstream span and name it in `headers`."""
        if record.span is not None and self.tracing is not None:
            record.upstream_span = self.tracing.start_child("llmgw.edge.upstream", record.span)
            headers.update(headers_of(record.upstream_span))
        return headers

    def ended(self, record: RequestRecord, outcome: Outcome, status: int) -> None:
        """The request's response ended with `outcome` (now); called once per request. Its
        span ends now; its metrics and access line are written within `hold` seconds (`flush`)."""
        if record.span is not None:  # its end time is now
            self._end_span(record, outcome, status)
        self._pending.append((record, outcome, status, time.perf_counter()))
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._timer = loop.call_later(self.hold, self.flush)

    def upstream_wait(self, in_flight: int) -> None:
        """A request is about to wait for its upstream's answer, `in_flight` requests running:
        with few (a sequential client), what waits is written at the loop's next turn, inside
        that wait, before its window's timer would fall in the next request's turn."""
        if self._pending and in_flight <= QUIET_IN_FLIGHT and not self._soon:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._write_soon)

    def _write_soon(self) -> None:
        self._soon = False
        self.flush()

    def flush(self) -> None:
        """Write the ends that wait, in the order they ended."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            pending, self._pending = self._pending, []
            lines = []
            for record, outcome, status, now in pending:
                try:
                    line = self._write(record, outcome, status, now)
                except Exception:  # the others are still written
                    log.exception("a request's metrics not written")
                    continue
                if line is not None:
                    lines.append(line)
            self._access_log.write_all("request", lines)  # one write for the batch

    def _write(
        self, record: RequestRecord, outcome: Outcome, status: int, now: float
    ) -> dict[str, Any] | None:
        """Count the request in the metrics; its access line's fields, unless it is not
        logged."""
        m = self.metrics
        model = record.model or NONE
        provider = record.provider or NONE
        endpoint = record.endpoint or NONE
        feature = record.feature.value
        duration = now - record.started
        m.child(m.requests, feature, outcome.value, model, provider, endpoint).inc()
        m.child(m.duration, feature, model, provider, endpoint).observe(duration)
        ttft = None
        if record.first_token is not None:
            ttft = record.first_token - record.started
            m.child(m.ttft, model, provider, endpoint).observe(ttft)
            if outcome is Outcome.SUCCESS and record.completion_tokens > 1:
                tpot = (now - record.first_token) / (record.completion_tokens - 1)
                m.child(m.tpot, model, provider, endpoint).observe(tpot)
        if outcome is Outcome.SUCCESS and record.provider is not None:
            m.child(m.tokens, model, provider, endpoint, "input").inc(record.prompt_tokens)
            m.child(m.tokens, model, provider, endpoint, "output").inc(record.completion_tokens)
        if record.served_model is not None and record.served_model != record.model:
            m.child(m.fallbacks, model, record.served_model).inc()
        if m.tenant_requests is not None:
            m.child(m.tenant_requests, m.tenant(record.tenant), model, outcome.value).inc()
        if not self.access or (
            outcome is Outcome.SUCCESS and self.sample < 1.0 and self._rng.random() >= self.sample
        ):
            return None
        return {
            "request_id": record.request_id,
            "feature": feature,
            "model": record.asked_model,
            "served_model": record.served_model or record.model,
            "provider": record.provider,
            "endpoint": record.endpoint,
            "route": record.route,
            "band": record.band,
            "tenant": record.tenant,
            "stream": record.stream,
            "status": status,
            "outcome": outcome.value,
            "ttft_ms": round(ttft * 1000, 3) if ttft is not None else None,
            "duration_ms": round(duration * 1000, 3),
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "retries": record.retries,
        }

    @staticmethod
    def _end_span(record: RequestRecord, outcome: Outcome, status: int) -> None:
        if record.upstream_span is not None:  # a stream whose attempt outlived its relay
            record.upstream_span.end()
        record.span.set_attributes(
            {
                "llmgw.request_id": record.request_id,
                "llmgw.feature": record.feature.value,
                "llmgw.model": record.model or "",
                "llmgw.provider": record.provider or "",
                "llmgw.endpoint": record.endpoint or "",
                "llmgw.outcome": outcome.value,
                "llmgw.retries": record.retries,
                "http.response.status_code": status,
            }
        )
        record.span.end()
