"""Every service's metrics: named by Prometheus' conventions, bounded labels, and documented in
docs/metrics.md exactly (a metric missing there, or a name there no service exports, fails)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest_asyncio
from metric_catalog import Family, exported_families
from prometheus_client import generate_latest

from llmgw.config import load_config
from llmgw.core.outcomes import Outcome
from llmgw.core.requests import Feature
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.telemetry import EdgeTelemetry, RequestRecord

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("edge", "admission", "scraper", "reaper")
NAME = re.compile(
    r"^llmgw_(?:(?:edge|admission|scraper|reaper|spend)_[a-z][a-z0-9_]*[a-z0-9]|build_info)$"
)
UNITS = ("_seconds", "_bytes", "_tokens", "_ratio")
# Labels whose values are unbounded: never a label of ours (the tenant only where configured).
UNBOUNDED = {"request_id", "session", "lease", "pin_id", "user", "id"}


@pytest_asyncio.fixture
async def families(nats_url: str, unique_id: str) -> list[Family]:
    env = {"LLMGW_NATS__URL": nats_url, "LLMGW_PINNING__BUCKET": f"m_{unique_id}"}
    config = load_config(REPO / "config" / "local.yaml", env=env)
    return await exported_families(config, nats_url)


def test_every_service_exports_process_and_build_metrics(families: list[Family]) -> None:
    for service in SERVICES:
        names = {f.name for f in families if f.service == service}
        assert {"llmgw_build_info", "process_cpu_seconds", "process_resident_memory_bytes"} <= (
            names
        ), service
        foreign = {
            f.name
            for f in families
            if f.service == service
            and f.name.startswith("llmgw_")
            and not f.name.startswith((f"llmgw_{service}_", "llmgw_build_info"))
            # Spend is counted where requests end, at the edge, and named for what it is.
            and not (service == "edge" and f.name.startswith("llmgw_spend_"))
        }
        assert not foreign, (service, foreign)  # a service's metrics carry its name


def test_names_follow_prometheus_conventions(families: list[Family]) -> None:
    problems = []
    for f in families:
        if f.name.startswith(("process_", "python_")):
            continue
        if not NAME.match(f.name):
            problems.append(f"{f.name}: not llmgw_<service>_<snake_case>")
        if f.name.endswith(("_total", "_count", "_sum", "_bucket", "_created")):
            problems.append(f"{f.name}: a reserved suffix in the family name")
        if f.type == "histogram" and not f.name.endswith(UNITS):
            problems.append(f"{f.name}: a histogram without a base unit (_seconds, _bytes, ...)")
        if re.search(r"_(ms|millis|milliseconds|kb|mb|minutes|hours)(_|$)", f.name):
            problems.append(f"{f.name}: not in a base unit")
        if f.type == "gauge" and f.name.endswith("_timestamp"):
            problems.append(f"{f.name}: a timestamp takes _seconds")
        for label in f.labels:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", label) or label.startswith("__"):
                problems.append(f"{f.name}: label {label!r} is not snake_case")
        if f.labels & UNBOUNDED:
            problems.append(f"{f.name}: unbounded label(s) {sorted(f.labels & UNBOUNDED)}")
        # The tenant label only where its values are bounded (metrics.max_tenants): the
        # requests by tenant, and what tenants spent (docs/metrics.md).
        if "tenant" in f.labels and f.name != "llmgw_edge_tenant_requests":
            if not f.name.startswith("llmgw_spend_"):
                problems.append(f"{f.name}: the tenant label belongs on tenant_requests alone")
        if not f.help.strip():
            problems.append(f"{f.name}: no help text")
    assert not problems, "\n".join(problems)


def test_no_created_series_in_the_exposition() -> None:
    metrics = EdgeMetrics()
    record = RequestRecord("r", Feature.CHAT, 0.0, model="m", provider="p", endpoint="e")
    record.first_token, record.completion_tokens = 0.0, 3
    EdgeTelemetry(metrics).ended(record, Outcome.SUCCESS, 200)
    text = generate_latest(metrics.registry).decode()
    assert "llmgw_edge_requests_total{" in text and "llmgw_edge_tokens_total{" in text
    assert "_created" not in text


def _documented() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"`(llmgw_[a-z0-9_]+)`", text))


def test_docs_list_every_exported_metric_and_nothing_else(families: list[Family]) -> None:
    exported = {
        f.series[0] if f.type == "counter" else f.name
        for f in families
        if f.name.startswith("llmgw_")
    }
    documented = _documented()
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "in docs/metrics.md but exported by no service"
