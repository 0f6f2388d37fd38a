"""compose.yaml, config/compose.yaml and config/local.yaml stay in step with `llmgw up`.

compose.yaml is also checked on its own: against the Compose specification's JSON schema, and
for what no schema can see (the three NATS nodes route to each other, every llmgw service lists
them all, every service has a health check that probes its own port, the start order, the
Prometheus scrape targets of the observability profile).
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from llmgw.config import config_from_dict, load_config
from llmgw.nats_auth import (
    ROLES,
    SERVICE_ROLES,
    password_variable,
    render_server_config,
    role_permissions,
)
from llmgw.services.up.plan import ListenAddress, ServiceSpec, plan_cluster

REPO = Path(__file__).resolve().parents[2]
COMPOSE_CONFIG_IN_CONTAINER = "/app/config/compose.yaml"
LLMGW_IMAGE = "llmgw:local"
NATS_NODES = ("nats-1", "nats-2", "nats-3")
OBSERVABILITY = ("prometheus", "grafana")
# Services that connect to NATS (the simulators do not).
NATS_CLIENT_KINDS = ("admission", "reaper", "scraper", "edge")
# One-shot jobs built from the image (not in `llmgw up`'s plan: it does their work itself).
ONE_SHOTS = ("keys-seed",)
# The NATS role each NATS client of compose connects as (llmgw.nats_auth).
COMPOSE_ROLES = {**SERVICE_ROLES, "keys-seed": "keys"}
NATS_AUTH_CONF = "deploy/nats/llmgw-auth.conf"
NATS_AUTH_IN_CONTAINER = "/etc/nats/llmgw-auth.conf"
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
    """The services built from the Dockerfile (every other one runs a published image)."""
    return {name: svc for name, svc in compose["services"].items() if "build" in svc}


def _flags(command: list[str]) -> dict[str, str | None]:
    """nats-server's command line as {flag: value} ("-js" has no value)."""
    flags: dict[str, str | None] = {}
    index = 0
    while index < len(command):
        flag = command[index]
        assert flag.startswith("-"), f"not a flag: {flag!r} in {command}"
        if index + 1 < len(command) and not command[index + 1].startswith("-"):
            flags[flag] = command[index + 1]
            index += 2
        else:
            flags[flag] = None
            index += 1
    return flags


def _probe_url(service: dict[str, Any]) -> str:
    """The URL a service's health check fetches."""
    urls = [arg for arg in service["healthcheck"]["test"] if arg.startswith("http://")]
    assert len(urls) == 1, service["healthcheck"]
    return urls[0]


def _admin(spec: ServiceSpec) -> ListenAddress:
    (admin,) = [a for a in spec.listens if "admin" in a.purpose]
    return admin


def _server_set(url: str) -> set[tuple[str, int]]:
    servers = set()
    for server in url.split(","):
        parts = urlsplit(server.strip())
        assert parts.scheme == "nats" and parts.hostname and parts.port, server
        servers.add((parts.hostname, parts.port))
    return servers


def _nats_client_addresses(compose: dict[str, Any]) -> set[tuple[str, int]]:
    """(host, client port) of every NATS node, from the nodes' own command lines."""
    addresses = set()
    for node in NATS_NODES:
        port = _flags(compose["services"][node]["command"]).get("-p") or "4222"
        addresses.add((node, int(port)))
    return addresses


# --- in step with `llmgw up` ----------------------------------------------------------------------


def test_compose_has_one_service_per_planned_process(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    services = set(_llmgw_services(compose)) - set(ONE_SHOTS)
    assert sorted(services) == sorted(spec.name for spec in plan)


def test_every_service_is_llmgw_nats_or_observability(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name in NATS_NODES:
            assert service["image"].startswith("nats:"), name
        elif name in OBSERVABILITY:
            assert service["profiles"] == ["observability"], name  # not started by default
        else:
            assert name in _llmgw_services(compose), f"{name}: not built from the Dockerfile"


def test_every_llmgw_service_runs_the_one_image(compose: dict[str, Any]) -> None:
    for name, service in _llmgw_services(compose).items():
        assert service["build"] == ".", name  # the top-level Dockerfile
        assert service["image"] == LLMGW_IMAGE, name
        assert "entrypoint" not in service, name  # the image's: `llmgw`
        assert "profiles" not in service, name


def test_compose_commands_match_the_plan(compose: dict[str, Any], plan: list[ServiceSpec]) -> None:
    """A command is the arguments of the image's `llmgw` entrypoint (tests/deploy checks it)."""
    services = _llmgw_services(compose)
    for spec in plan:
        command = services[spec.name]["command"]
        planned, extra = command[: len(spec.argv)], command[len(spec.argv) :]
        assert planned == list(spec.argv), spec.name
        assert not extra or extra in ALLOWED_EXTRA_ARGS, (spec.name, extra)


def test_the_config_directory_is_mounted_where_commands_read_it(compose: dict[str, Any]) -> None:
    mount = f"./config:{Path(COMPOSE_CONFIG_IN_CONTAINER).parent}:ro"
    for name, service in _llmgw_services(compose).items():
        assert mount in service["volumes"], name


def test_simulators_are_reachable_under_their_endpoint_urls(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    sims = [spec for spec in plan if spec.kind.startswith("sim")]
    assert sims
    for spec in sims:
        (address,) = spec.listens
        assert address.host == spec.name  # the compose service name is the url's host
        assert _probe_url(compose["services"][spec.name]) == (
            f"http://127.0.0.1:{address.port}/health"
        )


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


def test_compose_config_differs_from_local_only_in_addresses_and_separate_admission() -> None:
    """Compose runs admission in containers of its own (a NATS user per role), as `llmgw up
    --secure` does; `llmgw up` runs it in the edge."""
    local = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    in_compose = yaml.safe_load((REPO / "config" / "compose.yaml").read_text())
    assert local["admission"] == {"colocated": True}
    assert in_compose["admission"] == {"colocated": False}
    local["admission"]["colocated"] = False
    assert _without_addresses(in_compose) == _without_addresses(local)


def test_the_compose_edge_runs_no_admission_instance_its_role_may_not_write_the_bucket() -> None:
    """admission.colocated is true by default; compose's config turns it off, and it must: the
    edge container connects as the edge role, which may not write the routing bucket."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    edge_env = compose["services"]["edge"]["environment"]
    config = load_config(REPO / "config" / "compose.yaml", env={})
    assert "colocated" in config.admission.model_fields_set and not config.admission.colocated
    assert "LLMGW_ADMISSION__COLOCATED" not in edge_env  # the config file says it, once
    user = edge_env["LLMGW_NATS__USER"]
    assert user == SERVICE_ROLES["edge"]
    assert f"$KV.{config.pinning.bucket}.>" not in role_permissions(config)[user].publish


def test_compose_starts_the_processes_of_llmgw_up_secure(plan: list[ServiceSpec]) -> None:
    as_secure = load_config(
        REPO / "config" / "local.yaml", env={"LLMGW_ADMISSION__COLOCATED": "false"}
    )
    local = plan_cluster(as_secure, "c.yaml")
    assert [(s.name, s.kind) for s in local] == [(s.name, s.kind) for s in plan]


# --- the Compose specification ----------------------------------------------------------------


def _compose_spec_schema() -> dict[str, Any]:
    """The Compose specification's schema (compose-spec/compose-spec, schema/compose-spec.json),
    as the check-jsonschema package ships it: installed with the test extra, no network."""
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text(encoding="utf-8"))


def _schema_errors(document: dict[str, Any]) -> list[str]:
    schema = _compose_spec_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '(top level)'}: {error.message}"
        for error in validator.iter_errors(document)
    ]


def test_compose_file_is_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    assert _schema_errors(compose) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["services"]["edge"]["healthcheck"].update(intervall="3s"),
        lambda c: c["services"]["edge"]["depends_on"]["admission"].update(condition="healthy"),
        lambda c: c["services"]["nats-1"].update(volume=["nats-1-data:/data"]),
    ],
    ids=["misspelt-healthcheck-field", "unknown-depends-on-condition", "misspelt-service-field"],
)
def test_the_compose_schema_check_catches_mistakes(compose: dict[str, Any], mutate: Any) -> None:
    """The schema is strict enough to be worth running: typical slips fail it."""
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert _schema_errors(broken) != []


# --- the NATS cluster -------------------------------------------------------------------------


def test_nats_nodes_form_one_jetstream_cluster_routing_to_each_other(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    nodes = {name: _flags(services[name]["command"]) for name in NATS_NODES}
    cluster_ports = {}
    for name, flags in nodes.items():
        listen = urlsplit(str(flags["--cluster"]))
        assert listen.hostname == "0.0.0.0" and listen.port, (name, flags["--cluster"])
        cluster_ports[name] = listen.port
    assert {flags["--cluster_name"] for flags in nodes.values()} == {"llmgw"}
    assert sorted(str(flags["--server_name"]) for flags in nodes.values()) == sorted(NATS_NODES)
    for name, flags in nodes.items():
        assert flags["--server_name"] == name  # unique, and the name clients and routes use
        assert "-js" in flags, name
        routes = {
            (urlsplit(r).hostname, urlsplit(r).port) for r in str(flags["--routes"]).split(",")
        }
        others = {(other, cluster_ports[other]) for other in NATS_NODES if other != name}
        assert routes == others, name  # each node solicits a route to every other node


def test_nats_nodes_are_recent_and_keep_their_own_volume(compose: dict[str, Any]) -> None:
    volumes = []
    for name in NATS_NODES:
        service = compose["services"][name]
        tag = service["image"].removeprefix("nats:").split("-")[0]
        assert tuple(int(part) for part in tag.split(".")[:2]) >= (2, 12), service["image"]
        store_dir = _flags(service["command"])["-sd"]
        (volume,) = [v for v in service["volumes"] if v.endswith(f":{store_dir}")]
        volumes.append(volume.split(":")[0])
    assert len(set(volumes)) == len(NATS_NODES)  # one volume each, never shared
    assert set(volumes) <= set(compose["volumes"])  # named volumes, declared


def test_nats_health_checks_ask_for_jetstream_on_the_monitoring_port(
    compose: dict[str, Any],
) -> None:
    for name in NATS_NODES:
        service = compose["services"][name]
        monitoring = _flags(service["command"])["-m"]
        assert _probe_url(service) == (
            f"http://127.0.0.1:{monitoring}/healthz?js-enabled-only=true"
        ), name


def test_every_llmgw_service_lists_every_nats_node(compose: dict[str, Any]) -> None:
    nodes = _nats_client_addresses(compose)
    assert len(nodes) == len(NATS_NODES)
    for name, service in _llmgw_services(compose).items():
        assert _server_set(service["environment"]["LLMGW_NATS__URL"]) == nodes, name
    config = load_config(REPO / "config" / "compose.yaml", env={})
    assert _server_set(config.nats.url) == nodes  # the file says the same as the environment


def test_nats_clients_start_after_every_node_is_healthy(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    for spec in plan:
        if spec.kind not in NATS_CLIENT_KINDS:
            continue
        depends_on = compose["services"][spec.name]["depends_on"]
        for node in NATS_NODES:
            assert depends_on[node] == {"condition": "service_healthy"}, (spec.name, node)


def test_buckets_are_replicated_on_every_node(compose: dict[str, Any]) -> None:
    """Same replicas in every service (a bucket's replicas are checked at start), and the
    environment each service gets is a valid config with them."""
    raw = yaml.safe_load((REPO / "config" / "compose.yaml").read_text())
    for name, service in _llmgw_services(compose).items():
        env = {key: str(value) for key, value in service["environment"].items()}
        config = config_from_dict(raw, source=name, env=env)  # raises if any variable is invalid
        assert env.get("LLMGW_NATS__REPLICAS") == str(len(NATS_NODES)), name
        assert config.replicas_of(config.pinning.bucket) == len(NATS_NODES), name


# --- health checks and start order ------------------------------------------------------------


def test_every_service_has_a_health_check(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name in ONE_SHOTS:  # it runs to its end: its dependants wait for that instead
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] == "CMD", name


def test_llmgw_services_probe_their_own_admin_port(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    """Every llmgw service's readiness, on the admin port it was given."""
    for spec in plan:
        if spec.kind not in NATS_CLIENT_KINDS:
            continue
        admin = _admin(spec)
        path = "/ready"
        assert _probe_url(compose["services"][spec.name]) == (
            f"http://127.0.0.1:{admin.port}{path}"
        ), spec.name


def test_edge_starts_after_admission_is_healthy(compose: dict[str, Any]) -> None:
    assert compose["services"]["edge"]["depends_on"]["admission"] == {
        "condition": "service_healthy"
    }


# --- security: API keys seeded, a NATS user per role -------------------------------------------


def test_the_nats_config_is_generated_from_the_permissions_table() -> None:
    """deploy/nats/llmgw-auth.conf is `llmgw config nats-auth config/compose.yaml`, verbatim."""
    config = load_config(REPO / "config" / "compose.yaml", env={})
    assert (REPO / NATS_AUTH_CONF).read_text() == render_server_config(config), (
        f"regenerate: llmgw config nats-auth config/compose.yaml > {NATS_AUTH_CONF}"
    )


def test_every_nats_node_loads_the_users_and_has_every_password(compose: dict[str, Any]) -> None:
    for name in NATS_NODES:
        service = compose["services"][name]
        assert _flags(service["command"])["-c"] == NATS_AUTH_IN_CONTAINER, name
        assert f"./{NATS_AUTH_CONF}:{NATS_AUTH_IN_CONTAINER}:ro" in service["volumes"], name
        assert set(service["environment"]) == {password_variable(role) for role in ROLES}, name


def _interpolated(value: str) -> str:
    """The variable a compose value `${NAME:-default}` reads (the value itself if none)."""
    return value.removeprefix("${").split(":-")[0].rstrip("}") if value.startswith("${") else ""


def test_every_nats_client_connects_as_its_role(compose: dict[str, Any]) -> None:
    nodes = compose["services"][NATS_NODES[0]]["environment"]
    for name, role in COMPOSE_ROLES.items():
        env = compose["services"][name]["environment"]
        assert env["LLMGW_NATS__USER"] == role, name
        variable = _interpolated(env["LLMGW_NATS__PASSWORD"])
        assert variable == password_variable(role), name
        assert nodes[variable] == env["LLMGW_NATS__PASSWORD"], name  # the same default as well
    for name, service in _llmgw_services(compose).items():
        if name not in COMPOSE_ROLES:  # the simulators use no NATS
            assert "LLMGW_NATS__USER" not in service["environment"], name


def test_keys_are_seeded_from_the_file_before_the_edge_starts(compose: dict[str, Any]) -> None:
    seed = compose["services"]["keys-seed"]
    assert seed["restart"] == "no"
    command = seed["command"]
    assert command[:4] == ["keys", "--config", COMPOSE_CONFIG_IN_CONTAINER, "seed"]
    keys_file = (
        REPO / "config" / Path(command[4]).relative_to(Path(COMPOSE_CONFIG_IN_CONTAINER).parent)
    )
    entries = yaml.safe_load(keys_file.read_text())["keys"]
    assert entries
    for entry in entries:  # secrets from the environment only, and compose passes each one
        assert "secret" not in entry and entry["secret_env"] in seed["environment"]
    for node in NATS_NODES:
        assert seed["depends_on"][node] == {"condition": "service_healthy"}
    assert compose["services"]["edge"]["depends_on"]["keys-seed"] == {
        "condition": "service_completed_successfully"
    }
    config = load_config(REPO / "config" / "compose.yaml", env={})
    assert config.auth.mode == "keys"


# --- the observability profile ----------------------------------------------------------------


def test_prometheus_scrapes_every_llmgw_admin_port(
    compose: dict[str, Any], plan: list[ServiceSpec]
) -> None:
    prometheus = compose["services"]["prometheus"]
    config_file = "deploy/prometheus/prometheus.yml"
    assert f"./{config_file}:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    scrape = yaml.safe_load((REPO / config_file).read_text())
    targets = {
        (name, sd["port"])
        for job in scrape["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    admin_ports = {
        (spec.name, _admin(spec).port) for spec in plan if spec.kind in NATS_CLIENT_KINDS
    }
    assert len(admin_ports) == len(NATS_CLIENT_KINDS)
    assert targets == admin_ports


def test_grafana_reads_the_compose_prometheus(compose: dict[str, Any]) -> None:
    provisioning = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    (source,) = yaml.safe_load(provisioning.read_text())["datasources"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    assert compose["services"]["grafana"]["depends_on"]["prometheus"] == {
        "condition": "service_healthy"
    }
