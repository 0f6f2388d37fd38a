"""deploy/kubernetes: every manifest against the Kubernetes API schemas, and the references
between them that no schema sees.

No cluster, kubectl or kustomize is needed: the manifests are read as kustomize would read them
(the base's `resources`, plus the ConfigMap its `configMapGenerator` makes from llmgw.yaml), and
validated with kubernetes-validate, which ships the API schemas of every Kubernetes version it
supports. Then: each Deployment runs the llmgw command it is named after, with a config the
ConfigMap holds and that llmgw accepts under the Deployment's environment; probes, Services,
the autoscaler and the disruption budgets point at ports, pods and Deployments that exist; every
Secret or ConfigMap reference resolves; the pods run as the image's non-root user on a read-only
root filesystem with resources requested and limited.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llmgw.cli import build_parser
from llmgw.config import Config, config_from_dict, parse_hostport
from llmgw.nats_auth import (
    NATS_USERS_SECRET,
    ROLES,
    SERVICE_ROLES,
    render_helm_values,
    role_permissions,
)
from llmgw.services.keys.main import key_from_spec

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
# The oldest Kubernetes the manifests are meant for, and the newest the validator knows.
OLDEST_KUBERNETES = "1.30"
VERSIONS = sorted({OLDEST_KUBERNETES, kubernetes_validate.latest_version().rsplit(".", 1)[0]})
# Deployment name -> (llmgw command, replicas).
WORKLOADS = {
    "llmgw-edge": ("edge", 2),
    "llmgw-admission": ("admission", 2),
    "llmgw-reaper": ("reaper", 1),
    "llmgw-scraper": ("scraper", 1),
}
NATS_CHART_URL = "nats://nats:4222"  # the NATS Helm chart's client Service, release "nats"
NATS_CHART_NODES = 3  # --set config.cluster.replicas=3
NATS_VALUES = KUBERNETES / "nats-values.yaml"  # the chart's values: its users (llmgw.nats_auth)
KEYS_JOB = "llmgw-keys-seed"


# --- reading the base as kustomize does -------------------------------------------------------


def _kustomization(folder: Path) -> dict[str, Any]:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _generated_config_maps(kustomization: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    maps = []
    for generator in kustomization.get("configMapGenerator", []):
        data = {Path(f).name: (folder / f).read_text() for f in generator.get("files", [])}
        labels = generator.get("options", {}).get("labels", {})
        maps.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"], "labels": labels},
                "data": data,
            }
        )
    return maps


def _base_documents() -> list[tuple[str, dict[str, Any]]]:
    """(file in the base, resource) for every resource of the base: the generated ConfigMaps'
    file is kustomization.yaml."""
    kustomization = _kustomization(BASE)
    documents = []
    for file in kustomization["resources"]:
        documents += [(file, doc) for doc in yaml.safe_load_all((BASE / file).read_text()) if doc]
    generated = _generated_config_maps(kustomization, BASE)
    return documents + [("kustomization.yaml", config_map) for config_map in generated]


def _base_resources() -> list[dict[str, Any]]:
    return [resource for _, resource in _base_documents()]


@pytest.fixture(scope="module")
def resources() -> list[dict[str, Any]]:
    return _base_resources()


def _of_kind(resources: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def _one(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = _of_kind(resources, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


def _workloads(resources: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every Deployment and Job: what runs an llmgw pod."""
    return {**_of_kind(resources, "Deployment"), **_of_kind(resources, "Job")}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _resolve_port(container: dict[str, Any], port: int | str) -> dict[str, Any]:
    """The containerPort entry a probe or Service port refers to (by name or number)."""
    for entry in container.get("ports", []):
        if port in (entry.get("name"), entry["containerPort"]):
            return entry
    raise AssertionError(f"port {port!r} is not a declared port of container {container['name']}")


# --- schemas ----------------------------------------------------------------------------------


def test_the_base_lists_every_manifest_in_its_folder() -> None:
    kustomization = _kustomization(BASE)
    listed = set(kustomization["resources"])
    generated = {f for g in kustomization.get("configMapGenerator", []) for f in g["files"]}
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed | generated == on_disk
    assert not listed & generated


def test_the_base_has_what_an_llmgw_deployment_needs(resources: list[dict[str, Any]]) -> None:
    kinds = sorted((r["kind"], r["metadata"]["name"]) for r in resources)
    assert kinds == sorted(
        [("Deployment", name) for name in WORKLOADS]
        + [
            ("Service", "llmgw-edge"),
            ("HorizontalPodAutoscaler", "llmgw-edge"),
            ("PodDisruptionBudget", "llmgw-edge"),
            ("PodDisruptionBudget", "llmgw-admission"),
            ("ConfigMap", "llmgw-config"),
            ("Secret", "llmgw-provider-keys"),
            ("Secret", "llmgw-nats-users"),
            ("Secret", "llmgw-api-keys"),
            ("Secret", "llmgw-admin-token"),
            ("Job", "llmgw-keys-seed"),
            ("ServiceAccount", "llmgw"),
        ]
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(
    resources: list[dict[str, Any]], version: str
) -> None:
    """Strict: an unknown or misspelt field fails, as a wrong type or a missing required one."""
    problems = []
    for resource in resources:
        where = f"{resource['kind']}/{resource['metadata']['name']}"
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(map(str, error.path))
            problems.append(f"{where}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{where}: {error.message}")  # an unknown kind or apiVersion
    assert problems == []


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Service", lambda r: r["spec"]["ports"][0].update(targetPrt="http")),
        ("Deployment", lambda r: _container(r)["ports"][0].update(containerPort="8080")),
        ("Deployment", lambda r: _container(r)["readinessProbe"]["httpGet"].pop("port")),
        ("HorizontalPodAutoscaler", lambda r: r["spec"].update(minReplica=2)),
    ],
    ids=["misspelt-field", "wrong-type", "missing-required-field", "misspelt-hpa-field"],
)
def test_the_schema_check_catches_mistakes(
    resources: list[dict[str, Any]], kind: str, mutate: Any
) -> None:
    broken = copy.deepcopy(_one(resources, kind, "llmgw-edge"))
    mutate(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST_KUBERNETES, strict=True)


def test_base_manifests_leave_the_namespace_to_the_overlay(resources: list[dict[str, Any]]) -> None:
    for resource in resources:
        assert "namespace" not in resource["metadata"], resource["metadata"]["name"]


# --- the workloads ----------------------------------------------------------------------------


def test_deployments_run_their_llmgw_command_with_the_planned_replicas(
    resources: list[dict[str, Any]],
) -> None:
    deployments = _of_kind(resources, "Deployment")
    assert sorted(deployments) == sorted(WORKLOADS)
    for name, (command, replicas) in WORKLOADS.items():
        deployment = deployments[name]
        assert deployment["spec"]["replicas"] == replicas, name
        container = _container(deployment)
        assert "command" not in container, name  # the image's entrypoint: llmgw
        args = build_parser().parse_args(container["args"])
        assert args.command == command, name
        assert _selects(deployment["spec"]["selector"]["matchLabels"], _pod_labels(deployment))
        assert _pod_labels(deployment)["app.kubernetes.io/component"] == command


def test_images_are_the_project_version(resources: list[dict[str, Any]]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, deployment in _of_kind(resources, "Deployment").items():
        assert _container(deployment)["image"] == f"llmgw:{version}", name


def _config_path(deployment: dict[str, Any]) -> tuple[str, str]:
    """(ConfigMap name, key) of the file the container's --config names."""
    container = _container(deployment)
    path = Path(build_parser().parse_args(container["args"]).config)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    for mount in container.get("volumeMounts", []):
        if path.parent == Path(mount["mountPath"]):
            volume = volumes[mount["name"]]
            assert "configMap" in volume, f"{path} is not on a ConfigMap volume"
            return volume["configMap"]["name"], path.name
    raise AssertionError(f"{deployment['metadata']['name']}: nothing is mounted at {path.parent}")


def _environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment, a Secret's value standing in for each secretKeyRef."""
    env = {}
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "from-a-secret-of-32-characters-x")
    return env


def _config_of(resources: list[dict[str, Any]], deployment: dict[str, Any]) -> Config:
    map_name, key = _config_path(deployment)
    text = _one(resources, "ConfigMap", map_name)["data"][key]
    env = _environment(_container(deployment))
    return config_from_dict(yaml.safe_load(text), source=key, env=env)


def test_every_deployment_reads_a_valid_llmgw_config(resources: list[dict[str, Any]]) -> None:
    for deployment in _of_kind(resources, "Deployment").values():
        config = _config_of(resources, deployment)  # raises ConfigError, listing the problems
        assert config.nats.url == NATS_CHART_URL
        assert _environment(_container(deployment))["LLMGW_NATS__URL"] == NATS_CHART_URL
        assert config.nats.replicas == NATS_CHART_NODES
        assert config.replicas_of(config.pinning.bucket) == NATS_CHART_NODES


def test_the_config_is_production_shaped(resources: list[dict[str, Any]]) -> None:
    config = _config_of(resources, _one(resources, "Deployment", "llmgw-edge"))
    assert all(endpoint.simulate is None for endpoint in config.endpoints)  # real engines only
    managed = {p.id for p in config.providers if p.kind == "managed"}
    unlimited = [p for p in config.providers if p.kind == "unlimited"]
    assert managed and any(e.provider in managed for e in config.endpoints)
    assert len(unlimited) == 1 and unlimited[0].api_key_env
    for endpoint in config.endpoints:
        host = re.match(r"https?://([^/:]+)", endpoint.url)
        assert host and host.group(1) not in ("127.0.0.1", "localhost"), endpoint.url


def _admin_port(deployment: dict[str, Any], config: Config) -> int:
    args = build_parser().parse_args(_container(deployment)["args"])
    listen = getattr(args, "admin_listen", None) or config.admin_listen
    host, port = parse_hostport(listen)
    assert host in ("0.0.0.0", "::", ""), f"{listen}: the kubelet probes the pod's address"
    return port


def test_declared_ports_are_the_ports_the_process_listens_on(
    resources: list[dict[str, Any]],
) -> None:
    for name, deployment in _of_kind(resources, "Deployment").items():
        config = _config_of(resources, deployment)
        container = _container(deployment)
        expected = {"admin": _admin_port(deployment, config)}
        if name == "llmgw-edge":
            host, port = parse_hostport(config.listen)
            assert host in ("0.0.0.0", "::", ""), config.listen
            expected["http"] = port
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared == expected, name


def test_probes_watch_health_and_readiness_on_the_admin_port(
    resources: list[dict[str, Any]],
) -> None:
    for name, deployment in _of_kind(resources, "Deployment").items():
        container = _container(deployment)
        admin = _admin_port(deployment, _config_of(resources, deployment))
        for probe, path in (
            ("startupProbe", "/health"),
            ("livenessProbe", "/health"),
            ("readinessProbe", "/ready"),
        ):
            assert probe in container, (name, probe)
            get = container[probe]["httpGet"]
            assert get["path"] == path, (name, probe)
            assert _resolve_port(container, get["port"])["containerPort"] == admin, (name, probe)


def test_prometheus_annotations_name_the_admin_port(resources: list[dict[str, Any]]) -> None:
    for name, deployment in _of_kind(resources, "Deployment").items():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        admin = _resolve_port(_container(deployment), "admin")["containerPort"]
        assert annotations["prometheus.io/port"] == str(admin), name
        assert annotations["prometheus.io/path"] == "/metrics", name


# --- references -------------------------------------------------------------------------------


def test_every_secret_and_config_map_reference_exists(resources: list[dict[str, Any]]) -> None:
    secrets = _of_kind(resources, "Secret")
    config_maps = _of_kind(resources, "ConfigMap")

    def keys(resource: dict[str, Any]) -> set[str]:
        return set(resource.get("data", {})) | set(resource.get("stringData", {}))

    for name, deployment in _workloads(resources).items():
        pod = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        for var in container.get("env", []):
            source = var.get("valueFrom", {})
            assert set(var) <= {"name", "value", "valueFrom"}, var
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                assert ref["name"] in secrets, (name, var["name"])
                assert ref["key"] in keys(secrets[ref["name"]]), (name, var["name"])
            if "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                assert ref["name"] in config_maps, (name, var["name"])
                assert ref["key"] in keys(config_maps[ref["name"]]), (name, var["name"])
        for env_from in container.get("envFrom", []):
            for kind, found in (("secretRef", secrets), ("configMapRef", config_maps)):
                if kind in env_from:
                    assert env_from[kind]["name"] in found, (name, env_from)
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (name, volume)
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, (name, volume)
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, (name, mount)
        assert pod["serviceAccountName"] in _of_kind(resources, "ServiceAccount"), name


def test_the_edge_gets_every_provider_key_from_the_secret(resources: list[dict[str, Any]]) -> None:
    """Only the edge calls providers; every api_key_env reaches it from the Secret."""
    edge = _one(resources, "Deployment", "llmgw-edge")
    config = _config_of(resources, edge)
    wanted = {p.api_key_env for p in config.providers if p.api_key_env}
    assert wanted
    env = {var["name"]: var for var in _container(edge)["env"]}
    for name in wanted:
        assert name in env, f"{name} is not in the edge's environment"
        assert "secretKeyRef" in env[name].get("valueFrom", {}), f"{name} is not from a Secret"
    for name, deployment in _of_kind(resources, "Deployment").items():
        if name != "llmgw-edge":  # keys go where they are used, nowhere else
            assert not wanted & {v["name"] for v in _container(deployment).get("env", [])}, name


def test_the_edge_service_reaches_the_edge_api_port(resources: list[dict[str, Any]]) -> None:
    service = _one(resources, "Service", "llmgw-edge")
    selected = [
        d
        for d in _of_kind(resources, "Deployment").values()
        if _selects(service["spec"]["selector"], _pod_labels(d))
    ]
    assert [d["metadata"]["name"] for d in selected] == ["llmgw-edge"]
    config = _config_of(resources, selected[0])
    (port,) = service["spec"]["ports"]
    target = _resolve_port(_container(selected[0]), port["targetPort"])
    assert target["containerPort"] == parse_hostport(config.listen)[1]  # the API, not admin


def test_the_autoscaler_scales_the_edge_on_cpu(resources: list[dict[str, Any]]) -> None:
    hpa = _one(resources, "HorizontalPodAutoscaler", "llmgw-edge")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
    edge = _one(resources, "Deployment", ref["name"])
    assert hpa["spec"]["minReplicas"] == edge["spec"]["replicas"]
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    # Utilization is relative to the request: without one the autoscaler cannot act.
    assert "cpu" in _container(edge)["resources"]["requests"]


def test_disruption_budgets_cover_edge_and_admission_and_allow_a_drain(
    resources: list[dict[str, Any]],
) -> None:
    budgets = _of_kind(resources, "PodDisruptionBudget")
    deployments = _of_kind(resources, "Deployment")
    for name in ("llmgw-edge", "llmgw-admission"):
        budget = budgets[name]
        selector = budget["spec"]["selector"]["matchLabels"]
        covered = [d for d, dep in deployments.items() if _selects(selector, _pod_labels(dep))]
        assert covered == [name]
        replicas = deployments[name]["spec"]["replicas"]
        if "maxUnavailable" in budget["spec"]:
            assert 1 <= budget["spec"]["maxUnavailable"] < replicas, name
        else:
            assert 1 <= budget["spec"]["minAvailable"] < replicas, name


# --- security and resources -------------------------------------------------------------------


def _image_user() -> int:
    users = re.findall(r"^USER\s+(\d+)", (REPO / "Dockerfile").read_text(), flags=re.M)
    return int(users[-1])


def test_pods_run_as_the_image_user_on_a_read_only_root(resources: list[dict[str, Any]]) -> None:
    for name, deployment in _workloads(resources).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == _image_user(), name
        assert pod["automountServiceAccountToken"] is False, name
        container = _container(deployment)
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"]["drop"] == ["ALL"], name
        volumes = {v["name"]: v for v in pod["volumes"]}
        (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert "emptyDir" in volumes[tmp["name"]], name  # the one writable place


_UNITS = {"m": 1e-3, "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}


def _quantity(value: str | int) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|k|M|G)?", str(value))
    assert match, value
    return float(match.group(1)) * _UNITS[match.group(2) or ""]


def test_every_container_requests_and_limits_cpu_and_memory(
    resources: list[dict[str, Any]],
) -> None:
    for name, deployment in _workloads(resources).items():
        limits = _container(deployment)["resources"]
        for resource in ("cpu", "memory"):
            request = _quantity(limits["requests"][resource])
            limit = _quantity(limits["limits"][resource])
            assert 0 < request <= limit, (name, resource)


def test_termination_grace_outlasts_the_pre_stop_pause(resources: list[dict[str, Any]]) -> None:
    for name, deployment in _of_kind(resources, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        pre_stop = _container(deployment).get("lifecycle", {}).get("preStop")
        pause = int(pre_stop["exec"]["command"][1]) if pre_stop else 0
        # After the pause the service still needs time: the edge drains its requests (seconds).
        assert grace >= pause + 20, name
    assert "lifecycle" in _container(_one(resources, "Deployment", "llmgw-edge"))


# --- keys and NATS users ----------------------------------------------------------------------


def _secret_ref(container: dict[str, Any], variable: str) -> tuple[str, str]:
    (var,) = [v for v in container.get("env", []) if v["name"] == variable]
    ref = var["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def _plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["value"] for v in container.get("env", []) if "value" in v}


def test_every_workload_connects_to_nats_as_its_role(resources: list[dict[str, Any]]) -> None:
    roles = {name: SERVICE_ROLES[command] for name, (command, _) in WORKLOADS.items()}
    roles[KEYS_JOB] = "keys"
    assert sorted(roles) == sorted(_workloads(resources))
    for name, role in roles.items():
        container = _container(_workloads(resources)[name])
        assert _plain_env(container)["LLMGW_NATS__USER"] == role, name
        assert _secret_ref(container, "LLMGW_NATS__PASSWORD") == (NATS_USERS_SECRET, role), name
    placeholder = _one(resources, "Secret", NATS_USERS_SECRET)["stringData"]
    assert sorted(placeholder) == sorted(ROLES)


def test_admission_runs_in_its_own_deployment_not_in_the_edges(
    resources: list[dict[str, Any]],
) -> None:
    """The edges connect as the edge role, which may not write the routing bucket: every pod's
    config says admission.colocated: false (against the default), so the edges start (an edge
    on the default would refuse to) and the llmgw-admission pods own the shards."""
    for name, deployment in _of_kind(resources, "Deployment").items():
        assert _config_of(resources, deployment).admission.colocated is False, name
    edge = _container(_one(resources, "Deployment", "llmgw-edge"))
    config = _config_of(resources, _one(resources, "Deployment", "llmgw-edge"))
    grants = role_permissions(config)[_plain_env(edge)["LLMGW_NATS__USER"]]
    assert f"$KV.{config.pinning.bucket}.>" not in grants.publish


def test_the_base_requires_keys_and_a_job_seeds_them(resources: list[dict[str, Any]]) -> None:
    job = _one(resources, "Job", KEYS_JOB)
    config = _config_of(resources, job)
    assert config.auth.mode == "keys"
    container = _container(job)
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.keys_command) == ("keys", "seed")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0  # so a later apply can create it anew
    # The seed file is a mounted Secret's key, and every entry in it is a valid key spec.
    path = Path(args.file)
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    secret = _one(resources, "Secret", volumes[mount["name"]]["secret"]["secretName"])
    entries = yaml.safe_load(secret["stringData"][path.name])["keys"]
    assert entries
    for entry in entries:
        key_from_spec(entry, now=0.0)  # raises ApiKeyError naming the bad field


def test_the_nats_chart_values_are_generated_from_the_permissions_table(
    resources: list[dict[str, Any]],
) -> None:
    config = _config_of(resources, _one(resources, "Deployment", "llmgw-edge"))
    assert NATS_VALUES.read_text() == render_helm_values(config), (
        "regenerate: llmgw config nats-auth --helm deploy/kubernetes/base/llmgw.yaml > "
        "deploy/kubernetes/nats-values.yaml"
    )
    values = yaml.safe_load(NATS_VALUES.read_text())
    assert values["config"]["cluster"]["replicas"] == NATS_CHART_NODES
    users = values["config"]["merge"]["authorization"]["users"]
    assert [u["user"] for u in users] == list(ROLES)
    placeholder = _one(resources, "Secret", NATS_USERS_SECRET)["stringData"]
    for user in users:  # each password is the variable the chart's env gives from the Secret
        variable = re.fullmatch(r"<< \$(\w+) >>", user["password"]).group(1)  # type: ignore[union-attr]
        ref = values["container"]["env"][variable]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": NATS_USERS_SECRET, "key": user["user"]}
        assert ref["key"] in placeholder


# --- the example overlay ----------------------------------------------------------------------


def test_the_example_overlay_refers_to_what_the_base_has(resources: list[dict[str, Any]]) -> None:
    folder = KUBERNETES / "overlays" / "example"
    overlay = _kustomization(folder)
    assert [(folder / r).resolve() for r in overlay["resources"]] == [BASE.resolve()]
    images = {
        _container(d)["image"].split(":")[0] for d in _of_kind(resources, "Deployment").values()
    }
    assert {image["name"] for image in overlay["images"]} == images
    deployments = _of_kind(resources, "Deployment")
    for replicas in overlay.get("replicas", []):
        assert replicas["name"] in deployments, replicas
    for patch in overlay.get("patches", []):
        target = yaml.safe_load(patch["patch"])
        kinds = _of_kind(resources, target["kind"])
        assert target["metadata"]["name"] in kinds, target
