"""What the edge records per request: the access line, the request id's path, labelled metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core.outcomes import Outcome
from llmgw.core.requests import Feature
from llmgw.logs import JsonFormatter
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.telemetry import EdgeTelemetry, RequestRecord

CHAT = "/v1/chat/completions"
ACCESS_FIELDS = {
    "request_id",
    "feature",
    "model",
    "served_model",
    "provider",
    "endpoint",
    "route",
    "band",
    "tenant",
    "stream",
    "status",
    "outcome",
    "ttft_ms",
    "duration_ms",
    "prompt_tokens",
    "completion_tokens",
    "retries",
}


class Lines(logging.Handler):
    """The access log as JSON objects, formatted by the service formatter."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter("edge"))
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(self.format(record)))


@pytest.fixture
def access_lines() -> Iterator[Lines]:
    lines = Lines()
    access = logging.getLogger("llmgw.access")
    access.addHandler(lines)
    previous = access.level
    access.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        access.removeHandler(lines)
        access.setLevel(previous)


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


async def test_access_line_request_id_and_labelled_metrics(
    gateway: Any, access_lines: Lines
) -> None:
    edge, recorders, lines = gateway.edge, gateway.received, access_lines
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        plain = await http.post(CHAT, json=body, headers={"x-request-id": "client-id-1"})
        streamed = await http.post(CHAT, json={**body, "stream": True})
        bad = await http.post(CHAT, json={"model": "small"}, headers={"x-request-id": "bad-1"})
    assert plain.status_code == 200 and streamed.status_code == 200, plain.text
    assert bad.status_code == 400

    # The client's id is returned and forwarded; an edge-made one likewise.
    assert plain.headers["x-request-id"] == "client-id-1"
    forwarded = [h["x-request-id"] for r in recorders.values() for h in r.seen]
    assert forwarded == ["client-id-1", streamed.headers["x-request-id"]]

    edge.app.edge.telemetry.flush()  # the last ends wait `hold` to be written: now
    by_id = {line["request_id"]: line for line in lines.records}
    assert set(by_id) == {"client-id-1", streamed.headers["x-request-id"], "bad-1"}
    first = by_id["client-id-1"]
    assert ACCESS_FIELDS <= set(first)
    assert first["model"] == "small" and first["served_model"] == "m1"
    assert (first["provider"], first["endpoint"], first["route"]) == ("iris", "engine-1", "new_pin")
    assert (first["status"], first["outcome"], first["retries"]) == (200, "success", 0)
    assert first["completion_tokens"] == plain.json()["usage"]["completion_tokens"] > 0
    assert first["prompt_tokens"] > 0 and first["ttft_ms"] is None and first["duration_ms"] > 0
    stream_line = by_id[streamed.headers["x-request-id"]]
    assert (
        stream_line["stream"] is True and 0 < stream_line["ttft_ms"] <= stream_line["duration_ms"]
    )
    assert stream_line["completion_tokens"] > 0  # usage injected and read from the stream
    assert by_id["bad-1"]["status"] == 400 and by_id["bad-1"]["outcome"] == "bad_request"
    assert by_id["bad-1"]["provider"] is None

    scraped = generate_latest(edge.deps.metrics.registry).decode()
    route = {"model": "m1", "provider": "iris", "endpoint": "engine-1"}
    requests = {
        (labels["feature"], labels["outcome"], labels["endpoint"]): value
        for labels, value in _samples(scraped, "llmgw_edge_requests_total")
    }
    assert requests[("chat", "success", "engine-1")] == 2
    assert requests[("chat", "bad_request", "none")] == 1
    ttft = _samples(scraped, "llmgw_edge_time_to_first_token_seconds_count")
    assert ttft == [(route, 1.0)]
    assert [v for labels, v in _samples(scraped, "llmgw_edge_time_per_output_token_seconds_count")]
    tokens = {labels["direction"]: v for labels, v in _samples(scraped, "llmgw_edge_tokens_total")}
    assert tokens["output"] == first["completion_tokens"] + stream_line["completion_tokens"]
    assert not [line for line in scraped.splitlines() if "_created" in line]
    assert _samples(scraped, "llmgw_build_info")[0][0]["service"] == "edge"
    assert _samples(scraped, "process_cpu_seconds_total")


async def test_a_request_end_is_written_after_the_response_turn_and_before_a_scrape(
    access_lines: Lines,
) -> None:
    """The metrics and access line of an end wait (off the client's critical path) and are
    written within `hold` seconds, batched; a scrape writes what waits first."""
    metrics = EdgeMetrics()
    telemetry = EdgeTelemetry(metrics)
    started = time.perf_counter()
    first = RequestRecord("late-1", Feature.CHAT, started, model="m", provider="p", endpoint="e")
    telemetry.ended(first, Outcome.SUCCESS, 200)
    assert access_lines.records == []  # not in the turn that ended it
    assert metrics.requests.labels("chat", "success", "m", "p", "e")._value.get() == 0
    deadline = time.monotonic() + 5
    while not access_lines.records:
        assert time.monotonic() < deadline, "the access line never written"
        await asyncio.sleep(telemetry.hold)
    assert [line["request_id"] for line in access_lines.records] == ["late-1"]
    assert metrics.requests.labels("chat", "success", "m", "p", "e")._value.get() == 1

    telemetry.hold = 60.0  # the next end waits for the scrape
    second = RequestRecord("late-2", Feature.CHAT, started, model="m", provider="p", endpoint="e")
    telemetry.ended(second, Outcome.SUCCESS, 200)
    ended = time.perf_counter()
    await asyncio.sleep(0.05)  # the clock moves on before the scrape: the duration is the end's
    assert [line["request_id"] for line in access_lines.records] == ["late-1"]
    scraped = generate_latest(metrics.registry).decode()
    requests = _samples(scraped, "llmgw_edge_requests_total")
    assert [v for labels, v in requests if labels["outcome"] == "success"] == [2.0]
    assert [line["request_id"] for line in access_lines.records] == ["late-1", "late-2"]
    assert access_lines.records[1]["duration_ms"] <= (ended - started) * 1000


async def test_with_few_requests_in_flight_the_ends_are_written_while_one_waits_upstream(
    access_lines: Lines,
) -> None:
    """A sequential client: its last request's end is written as soon as its next request waits
    for the upstream (the loop's next turn), not when the window's timer falls, maybe in the
    next request's own turn. Under load (many in flight) the window's batch waits."""
    metrics = EdgeMetrics()
    telemetry = EdgeTelemetry(metrics)
    telemetry.hold = 60.0  # only the upstream wait writes here
    started = time.perf_counter()
    for name, in_flight, written in (("busy", 64, []), ("quiet", 1, ["busy", "quiet"])):
        record = RequestRecord(name, Feature.CHAT, started, model="m", provider="p", endpoint="e")
        telemetry.ended(record, Outcome.SUCCESS, 200)
        telemetry.upstream_wait(in_flight)
        assert access_lines.records == []  # not in the caller's turn
        await asyncio.sleep(0)  # the wait: the loop's next turn
        assert [line["request_id"] for line in access_lines.records] == written
    telemetry.upstream_wait(1)  # nothing waits: nothing to do
    await asyncio.sleep(0)
    assert len(access_lines.records) == 2
