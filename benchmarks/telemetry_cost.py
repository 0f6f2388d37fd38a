"""Added cost per request of the edge's logs, metrics and traces, measured on the code itself.

    python benchmarks/telemetry_cost.py [--requests 20000] [--rounds 5]

What one request adds at the edge (`llmgw.services.edge.telemetry`, `llmgw.logs`,
`llmgw.tracing`): its RequestRecord, the request id in the log context, the upstream headers
(request id, and with tracing the traceparent), the attempt's end, and at the end the labelled
metrics (requests, duration, TTFT, TPOT, tokens) and the access line, formatted by the service's
JSON formatter and written to /dev/null. With tracing on, also the admission side: extracting the
context from the NATS headers and the decision span. Spans go to a BatchSpanProcessor whose
exporter drops them (what the OTLP exporter adds runs in its own thread).

Variants run interleaved in every round (same process, same warm caches):

- metrics: the metrics alone (access log off), tracing off;
- metrics+log: the shipped default (access line on, JSON), tracing off;
- metrics+log text: the same with the text formatter (`llmgw up`'s terminal);
- +tracing edge: the default plus tracing on at the edge (request and upstream spans);
- +tracing both: the same plus admission's side (context from the NATS headers, the decision
  span), as if both ran in one process.

Reported per variant: p50 and p99 of one request's added time over `--requests` requests, as
median [min..max] over rounds. An end-to-end run cannot see tens of microseconds on a shared
two-core machine; this measures them directly.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from llmgw.config.observability import LogConfig, TracingConfig
from llmgw.core.outcomes import Outcome
from llmgw.core.requests import Feature
from llmgw.core.usage import Usage
from llmgw.logs import accept_request_id, request_id, setup_logging
from llmgw.services.admission.tracing import DecisionSpans
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.telemetry import EdgeTelemetry, RequestRecord
from llmgw.tracing import Tracing, current_headers
from llmgw.wire import AdmitReply, AdmitRequest, ReplyStatus, Target

MODELS = ("llama-3.3-70b", "qwen2.5-32b")
ENDPOINTS = (("iris", "engine-1"), ("iris", "engine-2"), ("tensorx", "tensorx-east"))
PROVIDER_HEADERS = {"content-type": "application/json"}


class _Drop(SpanExporter):
    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _request_path(telemetry: EdgeTelemetry, spans: DecisionSpans | None) -> Callable[[int], None]:
    usage = Usage(input_tokens=42, output_tokens=64)
    target = Target(
        provider="iris",
        provider_kind="managed",
        endpoint="engine-1",
        url="http://127.0.0.1:8101",
        upstream_model="llama-3.3-70b",
    )
    reply = AdmitReply(id="r", status=ReplyStatus.ADMITTED, target=target, route="pinned")

    def one(i: int) -> None:
        model = MODELS[i % 2]
        provider, endpoint = ENDPOINTS[i % 3]
        record = RequestRecord(accept_request_id(None), Feature.CHAT, time.perf_counter())
        request_id.set(record.request_id)
        telemetry.began(record, {"x-request-id": record.request_id})
        record.asked_model, record.model, record.stream = model, model, True
        headers = {**PROVIDER_HEADERS, "x-request-id": record.request_id}
        telemetry.upstream_headers(record, headers)
        if spans is not None:  # admission's side of the same request
            nats_headers = current_headers()
            admit = AdmitRequest(
                id=record.request_id, edge="e", model=model, feature="chat", shard=1
            )
            token = spans.start(nats_headers, admit)
            spans.replied(reply)
            spans.detach(token)
        record.first_token = time.perf_counter()
        record.attempt_ended(provider, endpoint, "pinned", model, usage)
        telemetry.ended(record, Outcome.SUCCESS, 200)

    return one


def variants() -> dict[str, tuple[EdgeTelemetry, DecisionSpans | None, LogConfig]]:
    tracing = Tracing("edge", TracingConfig(enabled=True))
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    tracing.provider.add_span_processor(BatchSpanProcessor(_Drop()))
    admission = Tracing("admission", TracingConfig(enabled=True))
    admission.provider.add_span_processor(BatchSpanProcessor(_Drop()))
    quiet = LogConfig(access_log=False, format="json")
    json_log = LogConfig(format="json")
    text_log = LogConfig(format="text")
    return {
        "metrics": (EdgeTelemetry(EdgeMetrics(), quiet), None, quiet),
        "metrics+log": (EdgeTelemetry(EdgeMetrics(), json_log), None, json_log),
        "metrics+log text": (EdgeTelemetry(EdgeMetrics(), text_log), None, text_log),
        "+tracing edge": (EdgeTelemetry(EdgeMetrics(), json_log, tracing=tracing), None, json_log),
        "+tracing both": (
            EdgeTelemetry(EdgeMetrics(), json_log, tracing=tracing),
            DecisionSpans(admission),
            json_log,
        ),
    }


def measure(one: Callable[[int], None], requests: int) -> list[float]:
    timer = time.perf_counter
    samples = []
    for i in range(requests):
        started = timer()
        one(i)
        samples.append(timer() - started)
    return samples


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    devnull = open(os.devnull, "w")
    built = variants()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in built}
    for _ in range(args.rounds):
        for name, (telemetry, spans, log) in built.items():
            setup_logging("edge", log, stream=devnull)
            one = _request_path(telemetry, spans)
            measure(one, min(2000, args.requests))  # warm: label children, caches
            samples = measure(one, args.requests)
            results[name].append((pct(samples, 0.5), pct(samples, 0.99)))
    logging.getLogger().handlers.clear()
    out = io.StringIO()
    print(f"{args.requests} requests x {args.rounds} rounds; per request, microseconds", file=out)
    print(f"{'variant':<18} {'p50':>22} {'p99':>22}", file=out)
    for name, rounds in results.items():
        cells = []
        for index in (0, 1):
            values = [r[index] * 1e6 for r in rounds]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}..{max(values):.1f}]")
        print(f"{name:<18} {cells[0]:>22} {cells[1]:>22}", file=out)
    print(out.getvalue(), end="")


if __name__ == "__main__":
    main()
