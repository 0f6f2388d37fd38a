"""Shared pieces of the `llmgw state` tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = REPO / "config" / "local.yaml"
MODEL = "llama-3.3-70b"
OTHER_MODEL = "qwen2.5-32b"
IRIS = "iris"  # limits in config/local.yaml: P=200, G=64, R=16, S=4
TENSORX = "tensorx"  # no limits


def session_id(n: int) -> str:
    """A session id as the edge makes them: a hex hash (a safe key token)."""
    return f"{n:032x}"


def write_config(path: Path, nats_url: str, bucket: str) -> Path:
    """config/local.yaml pointed at `nats_url` and `bucket`."""
    data: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["nats"] = {"url": nats_url, "connect_timeout": "1s"}
    data["pinning"] = {"bucket": bucket}
    data["router"] = {"load_bucket": f"load_{bucket}"}
    # No scraper runs here: with flow control on, every engine would count as stale (saturated)
    # and gold would overflow to the third party; these tests read state, not flow control.
    data["admission"] = {"enabled": False}
    path.write_text(yaml.safe_dump(data))
    return path
