"""Traces across the gateway with an in-memory exporter: the client's trace id runs through the
edge's request span, the admission decision (over NATS headers) and the upstream call, and the
engine receives a traceparent naming the upstream span."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw.config.observability import TracingConfig
from llmgw.tracing import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracers(exporter: InMemorySpanExporter) -> tuple[Tracing, Tracing]:
    on = TracingConfig(enabled=True)
    return Tracing("edge", on, exporter=exporter), Tracing("admission", on, exporter=exporter)


async def test_one_trace_from_the_client_through_admission_to_the_engine(
    gateway: Any, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        traced = await http.post(
            "/v1/chat/completions",
            json={**body, "stream": True},
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
        )
        untraced = await http.post("/v1/chat/completions", json=body)
    assert traced.status_code == 200 and untraced.status_code == 200
    recorders = gateway.received

    spans = exporter.get_finished_spans()
    ours = [s for s in spans if format(s.context.trace_id, "032x") == TRACE_ID]
    by_name = {s.name: s for s in ours}
    assert sorted(by_name) == [
        "llmgw.admission.decide",
        "llmgw.edge.request",
        "llmgw.edge.upstream",
    ]
    assert len(ours) == 3
    request = by_name["llmgw.edge.request"]
    assert format(request.parent.span_id, "016x") == CLIENT_SPAN and request.parent.is_remote
    decide, upstream = by_name["llmgw.admission.decide"], by_name["llmgw.edge.upstream"]
    assert decide.parent.span_id == request.context.span_id  # across NATS
    assert (
        decide.parent.is_remote and decide.resource.attributes["service.name"] == "llmgw-admission"
    )
    assert decide.attributes["llmgw.endpoint"] == upstream.attributes["llmgw.endpoint"]
    assert decide.attributes["llmgw.status"] == "admitted"
    assert upstream.parent.span_id == request.context.span_id
    assert request.attributes["llmgw.outcome"] == "success"
    assert request.start_time <= decide.start_time and upstream.end_time <= request.end_time

    # The engine got the upstream span as its parent; the untraced request a trace of its own.
    sent = [h["traceparent"] for r in recorders.values() for h in r.seen]
    assert sent[0] == f"00-{TRACE_ID}-{format(upstream.context.span_id, '016x')}-01"
    assert len(sent) == 2 and TRACE_ID not in sent[1]
    assert len(spans) == 6  # the untraced request: the same three spans in a new trace
