"""`llmgw up` with the local config: the edge runs the admission instance in its own process
(`admission.colocated`) and no separate admission process runs, so the edge's instance owns
every shard and decides every request (tests/edge/test_colocated.py has an edge's instance
beside separate ones)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_up_operability import READY
from up_harness import UpProcess, write_cluster_config

pytestmark = pytest.mark.e2e


def test_llmgw_up_decides_every_request_in_the_edge_with_no_admission_process(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml")  # the local config, as shipped
    admin = int(yaml.safe_load(config.read_text())["admin_listen"].rsplit(":", 1)[1])
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    assert "[admission]" not in up.output()  # no separate admission process was started
    sent = 24
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as http:
        metrics = http.get(f"http://127.0.0.1:{admin}/metrics").text
        assert _sample(metrics, "shards") == 32  # the edge's instance owns every shard
        for n in range(sent):
            response = http.post(
                f"{api}/chat/completions",
                json={
                    "model": "llama",
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                    "user": f"colocated-{n}",
                },
            )
            assert response.status_code == 200, response.text
        metrics = http.get(f"http://127.0.0.1:{admin}/metrics").text
    assert _sample(metrics, "decision_seconds_count") == sent  # all decided in the edge


def _sample(metrics: str, name: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == f"llmgw_admission_{name}"
    )
