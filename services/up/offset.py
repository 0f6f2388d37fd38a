"""`llmgw up --port-offset N`: a second local cluster from the same config, every port moved.

The edge's `listen` and `admin_listen` (and so the admin ports that follow it), the embedded NATS
port (when fixed), and the URL of every endpoint `llmgw up` simulates itself move by N. Endpoints
without a `simulate` block are someone else's servers and keep their URLs. The moved config is
written to a file of its own that every child reads (endpoint URLs cannot move through
environment overrides).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = ["shift_ports", "write_shifted"]


def _shift_address(address: str, offset: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + offset}"


def _shift_url(url: str, offset: int) -> str:
    parts = urlsplit(url)
    if parts.port is None:
        return url
    host = parts.netloc.rsplit(":", 1)[0]
    return parts._replace(netloc=f"{host}:{parts.port + offset}").geturl()


def shift_ports(raw: dict[str, Any], offset: int) -> dict[str, Any]:
    """A copy of the raw config (as read from YAML) with its local ports moved by `offset`."""
    data = dict(raw)
    for key, default in (("listen", "127.0.0.1:8080"), ("admin_listen", "127.0.0.1:9090")):
        data[key] = _shift_address(str(data.get(key, default)), offset)
    nats = dict(data.get("nats") or {})
    if nats.get("url", "embedded") == "embedded" and nats.get("embedded_port", 4222) != 0:
        nats["embedded_port"] = int(nats.get("embedded_port", 4222)) + offset
        data["nats"] = nats
    data["endpoints"] = [
        {**e, "url": _shift_url(e["url"], offset)} if e.get("simulate") else e
        for e in data.get("endpoints") or []
    ]
    return data


def write_shifted(config_path: str, offset: int) -> str:
    """Write the moved config next to the temp files and return its path."""
    raw = yaml.safe_load(Path(config_path).read_text(encoding="utf-8"))
    moved = shift_ports(raw, offset)
    handle = tempfile.NamedTemporaryFile(
        "w", prefix=f"llmgw-up-offset{offset}-", suffix=".yaml", delete=False, encoding="utf-8"
    )
    with handle:
        handle.write(f"# {config_path} with every local port moved by {offset} (llmgw up)\n")
        yaml.safe_dump(moved, handle, sort_keys=False)
    return handle.name
