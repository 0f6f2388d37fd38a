"""Operating what `llmgw up` starts, with the shipped defaults (flow control on) and JSON logs:
the access line of a request, its id end to end, labelled metrics, /health and /ready on every
port, and events a late reader replays with `llmgw events`."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from up_harness import UpProcess, llmgw_cli, write_cluster_config

from llmgw.events import EndpointEvent, PinEvent, parse_event

pytestmark = pytest.mark.e2e

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)
NATS = r"^llmgw up: edge \S+, admin \S+, NATS (\S+)$"
ACCESS_FIELDS = {
    "ts",
    "level",
    "service",
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


def _cli(config: Path, nats_url: str, *args: str) -> str:
    done = llmgw_cli(config, *args, env={"LLMGW_NATS__URL": nats_url})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _events(config: Path, nats_url: str, subject: str) -> list[str]:
    return _cli(config, nats_url, "events", "--json", "--subject", subject).splitlines()


def test_access_log_metrics_health_and_replay_through_llmgw_up(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml", log={"format": "json"})
    data = yaml.safe_load(config.read_text())
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)

    response = httpx.post(
        f"{api}/chat/completions",
        json={
            "model": "llama",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "ignore_eos": True,  # exactly 8 tokens
            "stream": True,
        },
        headers={
            "x-request-id": "op-test-1",
            "x-session-id": "operator",
            "authorization": f"Bearer {key}",
        },
        timeout=30,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "op-test-1"
    assert response.text.rstrip().endswith("data: [DONE]")

    line = up.wait_for(r'^\[edge\] (\{.*"request_id":"op-test-1".*\})$', timeout=30).group(1)
    access = json.loads(line)
    assert ACCESS_FIELDS <= set(access)
    assert access["logger"] == "llmgw.access" and access["service"] == "edge"
    assert (access["model"], access["served_model"]) == ("llama", "llama-3.3-70b")
    assert access["provider"] == "iris" and access["endpoint"] in {"engine-1", "engine-2"}
    assert (access["route"], access["status"], access["outcome"]) == ("new_pin", 200, "success")
    assert access["completion_tokens"] == 8 and access["prompt_tokens"] > 0
    assert 0 < access["ttft_ms"] <= access["duration_ms"]
    # log.format reaches every service: no text-format record from any of them.
    text_records = [
        x for x in up.lines if re.match(r"^\[(edge|admission|reaper|scraper)\] \d{4}-\d\d-\d\d ", x)
    ]
    assert not text_records

    admin = int(data["admin_listen"].rsplit(":", 1)[1])
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=10).text
    served = [
        s
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "llmgw_edge_time_to_first_token_seconds_count"
    ]
    assert [(s.labels["model"], s.labels["provider"], s.value) for s in served] == [
        ("llama-3.3-70b", "iris", 1.0)
    ]
    assert "_created" not in metrics

    # Admission runs in the edge (admission.colocated): its metrics are on the edge's port.
    assert "llmgw_admission_decision_seconds_count" in metrics
    ports = {"edge": admin, "reaper": admin + 2, "scraper": admin + 3}
    ports |= {e["id"]: int(e["url"].rsplit(":", 1)[1]) for e in data["endpoints"]}
    for name, port in ports.items():
        for path in ("/health", "/ready"):
            answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert answer.status_code == 200, (name, path, answer.text)

    # A reader that starts now replays what happened before it.
    pins = [parse_event(x) for x in _events(config, nats_url, "pin.created.>")]
    assert [p.provider for p in pins if isinstance(p, PinEvent)] == ["iris"]
    scraped = [parse_event(x) for x in _events(config, nats_url, "endpoint.scraped.iris")]
    assert {e.report.endpoint for e in scraped if isinstance(e, EndpointEvent)} == {
        "engine-1",
        "engine-2",
    }
    # llmgw state, with flow control and the limits on: the session's pin, held by its owner
    # and not yet in the bucket (a new pin is written once its session comes back).
    state = json.loads(_cli(config, nats_url, "state", "--json", "--pins"))
    iris = {(p["provider"], p["model"]): p for p in state["pairs"]}[("iris", "llama-3.3-70b")]
    assert iris["pins"] == 1 and iris["pins_stored"] == 0
    assert state["pins"] == []
    text = _cli(config, nats_url, "state", "--pins")
    assert "1 more held in memory only" in text, text
    assert up.stop(signal.SIGTERM) == 0
