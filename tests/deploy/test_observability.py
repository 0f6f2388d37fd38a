"""The Grafana dashboard and the Prometheus alert rules query only what the services export: a
metric or label name with a typo fails here. Compose provisions both."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from metric_catalog import Family, exported_families

from llmgw.config import load_config

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "llmgw.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
# Prometheus' own series, and the labels its scrape adds to every series.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance"}
KEYWORDS = {
    # aggregation operators may be followed by `by (...)` rather than by their parenthesis
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "le",
    "inf",
    "nan",
}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Every series selector of a PromQL expression (or a Grafana label_values query): its
    metric name and the label names it matches on."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings hide nothing
    text = re.sub(r"\$__\w+|\$\w+", "1m", text)  # Grafana variables
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", "0", text)  # numbers (1e-9)
    text = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", text)  # Grafana's: the metric
    found = []
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", text):
        name, matchers = match.group(1), match.group(2)
        rest = text[match.end() :].lstrip()
        before = text[: match.start()].rstrip()
        if name.lower() in KEYWORDS or rest.startswith("(") or re.fullmatch(r"\d.*", name):
            continue
        if re.search(r"(by|without|on|ignoring|group_left|group_right)\s*\([^)]*$", before):
            continue  # a label in a grouping list
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers or ""))
        found.append((name, labels))
    return found


@pytest_asyncio.fixture
async def families(nats_url: str, unique_id: str) -> dict[str, Family]:
    env = {"LLMGW_NATS__URL": nats_url, "LLMGW_PINNING__BUCKET": f"o_{unique_id}"}
    config = load_config(REPO / "config" / "local.yaml", env=env)
    return {series: f for f in await exported_families(config, nats_url) for series in f.series}


def _problems(exprs: list[str], families: dict[str, Family]) -> list[str]:
    problems = []
    for expr in exprs:
        chosen = selectors(expr)
        if not chosen:
            problems.append(f"no metric in {expr!r}")
        for name, labels in chosen:
            if name in PROMETHEUS_SERIES:
                continue
            family = families.get(name)
            if family is None:
                problems.append(f"{name}: exported by no service (in {expr!r})")
            elif unknown := labels - family.labels - TARGET_LABELS:
                problems.append(f"{name}: no label {sorted(unknown)} (in {expr!r})")
    return problems


def test_the_dashboard_queries_only_exported_metrics(families: dict[str, Family]) -> None:
    assert not _problems(dashboard_queries(), families)


def test_the_alert_rules_query_only_exported_metrics(families: dict[str, Family]) -> None:
    assert not _problems(alert_queries(), families)


@pytest.mark.parametrize(
    "typo",
    [
        "rate(llmgw_edge_request_total[5m])",  # requests
        'sum(llmgw_admission_queue_depth{bnd="gold"})',  # band
        "histogram_quantile(0.9, rate(llmgw_edge_ttft_seconds_bucket[1m]))",
        "lmgw_edge_requests_total",
    ],
)
def test_the_check_catches_a_typo(typo: str, families: dict[str, Family]) -> None:
    assert _problems([typo], families)


def test_the_dashboard_shows_what_operators_ask_for() -> None:
    queried = {name for expr in dashboard_queries() for name, _ in selectors(expr)}
    for needed in (
        "llmgw_edge_requests_total",  # request rate, errors by outcome
        "llmgw_edge_request_duration_seconds_bucket",  # latency percentiles per model
        "llmgw_edge_time_to_first_token_seconds_bucket",
        "llmgw_admission_queue_depth",
        "llmgw_admission_queue_wait_seconds_bucket",
        "llmgw_admission_pool_saturation",
        "llmgw_admission_offloads_total",  # overflow share
        "llmgw_admission_pins",
        "llmgw_admission_leases",
        "llmgw_admission_endpoint_breaker",
    ):
        assert needed in queried, needed


def test_alert_rules_are_well_formed() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    names = [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    assert len(names) == len(set(names))
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in {"info", "warning", "critical"}
            assert rule["annotations"]["summary"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["for"]


def test_compose_provisions_the_dashboard_and_the_rules() -> None:
    compose: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    for rule_file in prometheus["rule_files"]:
        assert f"./deploy/prometheus/{Path(rule_file).name}:{rule_file}:ro" in mounts
    provider = yaml.safe_load(
        (REPO / "deploy" / "grafana" / "provisioning" / "dashboards" / "llmgw.yml").read_text()
    )["providers"][0]
    grafana = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in grafana
    source = yaml.safe_load(
        (
            REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
        ).read_text()
    )["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
