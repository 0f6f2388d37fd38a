"""What the edge records per request: the access line, the request id's path, labelled metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.logs import JsonFormatter

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
