"""compose.yaml, config/compose.yaml and config/local.yaml stay in step with `llmgw up`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from llmgw.config import load_config
from llmgw.services.up.plan import ServiceSpec, plan_cluster

REPO = Path(__file__).resolve().parents[2]
COMPOSE_CONFIG_IN_CONTAINER = "/src/config/compose.yaml"
COMPOSE_NATS_URL = "nats://nats:4222"
# Overrides a compose command may add after the plan's arguments (containers listen everywhere).
ALLOWED_EXTRA_ARGS = (["--host", "0.0.0.0"],)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def plan() -> list[ServiceSpec]:
    config = load_config(REPO / "config" / "compose.yaml", env={})
    return plan_cluster(config, COMPOSE_CONFIG_IN_CONTAINER)


def _llmgw_services(compose: dict[str, Any]) -> dict[str, Any]:
    return {name: svc for name, svc in compose["services"].items() if name != "nats"}


def test_compose_has_one_service_per_planned_process(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    assert sorted(_llmgw_services(compose)) == sorted(spec.name for spec in plan)


def test_compose_commands_match_the_plan(compose: dict[str, Any], plan: list[ServiceSpec]) -> None:
    services = _llmgw_services(compose)
    for spec in plan:
        command = services[spec.name]["command"]
        assert command[0] == "llmgw", spec.name
        planned, extra = command[1 : 1 + len(spec.argv)], command[1 + len(spec.argv) :]
        assert planned == list(spec.argv), spec.name
        assert not extra or extra in ALLOWED_EXTRA_ARGS, (spec.name, extra)


def test_every_llmgw_service_reaches_the_compose_nats(compose: dict[str, Any]) -> None:
    config = load_config(REPO / "config" / "compose.yaml", env={})
    assert config.nats.url == COMPOSE_NATS_URL
    for name, service in _llmgw_services(compose).items():
        assert service["environment"]["LLMGW_NATS__URL"] == COMPOSE_NATS_URL, name
        assert "nats" in service["depends_on"], name
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:2.1")
    assert "-js" in nats["command"]


def test_simulators_are_reachable_under_their_endpoint_urls(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    for spec in plan:
        for address in spec.listens if spec.kind.startswith("sim") else ():
            assert address.host == spec.name  # the compose service name is the url's host
            health = " ".join(compose["services"][spec.name]["healthcheck"]["test"])
            assert f":{address.port}/health" in health


def test_edge_ports_are_published(compose: dict[str, Any]) -> None:
    config = load_config(REPO / "config" / "compose.yaml", env={})
    published = compose["services"]["edge"]["ports"]
    assert any(p.endswith(f":{config.listen_port}:{config.listen_port}") for p in published)
    assert f"127.0.0.1:{config.admin_port}:{config.admin_port}" in published


def _without_addresses(raw: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(raw)
    data.pop("listen", None)
    data.pop("admin_listen", None)
    for field in ("url", "embedded_port", "store_dir"):
        data.get("nats", {}).pop(field, None)
    for endpoint in data["endpoints"]:
        endpoint["url"] = urlsplit(endpoint["url"]).port  # the port must stay; the host may differ
    return data


def test_compose_config_differs_from_local_only_in_addresses() -> None:
    local = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    in_compose = yaml.safe_load((REPO / "config" / "compose.yaml").read_text())
    assert _without_addresses(in_compose) == _without_addresses(local)


def test_local_and_compose_plans_start_the_same_processes(plan: list[ServiceSpec]) -> None:
    local = plan_cluster(load_config(REPO / "config" / "local.yaml", env={}), "c.yaml")
    assert [(s.name, s.kind) for s in local] == [(s.name, s.kind) for s in plan]
