"""`admission.colocated` through `llmgw up`: the edge runs an admission instance in its own
process beside the separate one (they split the shards); every request is answered, and the
edge's admin port shows the decisions its own instance made."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_up_operability import READY
from up_harness import UpProcess, write_cluster_config

pytestmark = pytest.mark.e2e


def test_llmgw_up_with_colocated_admission_decides_at_the_edge(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml", admission={"colocated": True})
    admin = int(yaml.safe_load(config.read_text())["admin_listen"].rsplit(":", 1)[1])
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as http:
        # The separate instance started first; the edge's takes its share as shards rebalance.
        deadline = time.monotonic() + 30
        while _sample(http.get(f"http://127.0.0.1:{admin}/metrics").text, "shards") == 0:
            assert time.monotonic() < deadline, "the edge's instance never served a shard"
            time.sleep(0.2)
        # New sessions until both instances have decided some (shards still move while the
        # two settle their split, so how many land on each side varies): at most 64.
        sent = decided_here = 0
        while sent < 64 and not 0 < decided_here < sent:
            response = http.post(
                f"{api}/chat/completions",
                json={
                    "model": "llama",
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                    "user": f"colocated-{sent}",
                },
            )
            assert response.status_code == 200, response.text
            sent += 1
            metrics = http.get(f"http://127.0.0.1:{admin}/metrics").text
            decided_here = _sample(metrics, "decision_seconds_count")
    # The edge's instance decided its shards' share; the separate instance the rest.
    assert 0 < decided_here < sent, (decided_here, sent)


def _sample(metrics: str, name: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == f"llmgw_admission_{name}"
    )
