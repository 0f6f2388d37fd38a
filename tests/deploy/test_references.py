"""What one deployment file names, another must provide: Secret keys, environment variables,
NATS roles and ports, across the Kubernetes manifests, the NATS chart's values, compose.yaml,
the NATS, Prometheus and Grafana files, the Dockerfile and the commands docs/deployment.md shows.

Rendered offline, as the other tests here read them: the kustomize base (test_kubernetes's
reader) and the example overlay (its namespace, images, replicas and delete patches applied
here), nats-values.yaml, compose.yaml with every `${NAME:-default}` at its default, and every
`kubectl create secret` command of docs/deployment.md and of the manifests' comments (a shell
`for` loop over names expanded). Then, both ways where both make sense:

- Secret keys: every key that a workload (env, envFrom, a mounted file its arguments name), the
  chart's values or a documented command reads is created by everything that creates that
  Secret (its manifest, each command), in the base and in the overlay (which leaves the Secrets
  to the commands); every key created is read; the commands create the manifest's keys, in the
  overlay's namespace; the NATS users' Secret has exactly one key per role of llmgw.nats_auth.
- Environment variables: every variable a container sets is read by something: a config field
  (LLMGW_SECTION__FIELD, resolved against the config schema), a provider's `api_key_env`, the
  `secret_env` of a keys file the container seeds, or a password the NATS users read; every
  password variable the NATS users read is set. Every LLMGW_ name the files mention resolves.
- Roles: every NATS user named (LLMGW_NATS__USER, the chart's and compose's users, the password
  key a workload reads, the roles the docs and comments list) is a role of llmgw.nats_auth, and
  every list of all roles is complete.
- Ports: container ports, probes, Services, Prometheus annotations and scrape targets, compose's
  port mappings, health checks, NATS and endpoint URLs point at a port the process there serves
  (an llmgw process: `listen` and `admin_listen` of its config, or `--admin-listen`); the image
  exposes every port an llmgw service serves.

Each problem names the file, the reference and what is missing.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from test_compose_nats_cluster import _default, _mounts
from test_dockerfile import _stages
from test_kubernetes import (
    BASE,
    KUBERNETES,
    NATS_CHART_URL,
    NATS_VALUES,
    _base_documents,
    _config_of,
    _environment,
    _kustomization,
    _selects,
)

from llmgw.cli import build_parser
from llmgw.config import Config, ConfigError, config_from_dict, parse_hostport
from llmgw.config.loader import _model_at
from llmgw.config.schema import ENV_NESTED_DELIMITER, ENV_PREFIX
from llmgw.nats_auth import NATS_USERS_SECRET, ROLES, SERVICE_ROLES, password_variable

REPO = Path(__file__).resolve().parents[2]
OVERLAY = KUBERNETES / "overlays" / "example"
DOCS = "docs/deployment.md"
CONFIG_DOCS = "docs/config.md"
COMPOSE = "compose.yaml"
PROMETHEUS = "deploy/prometheus/prometheus.yml"
GRAFANA_SOURCES = "deploy/grafana/provisioning/datasources/prometheus.yml"
HELM = str(NATS_VALUES.relative_to(REPO))
WORKLOAD_KINDS = ("Deployment", "Job", "StatefulSet", "DaemonSet")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
NATS_CLIENT_PORT = 4222  # nats-server's default
# Where commands, env var names and role lists are looked for.
TEXT_FILES = (DOCS, CONFIG_DOCS, COMPOSE, "Dockerfile", "config/*.yaml", "deploy/**/*.y*ml")
TEXT_FILES_OF_NATS = ("deploy/**/*.conf",)
# Files that must list every NATS role (a role added to llmgw.nats_auth goes into each).
ROLE_LISTS_IN = (DOCS, CONFIG_DOCS, COMPOSE)

Documents = list[tuple[str, dict[str, Any]]]  # (repository path, resource)


@dataclass
class Rendered:
    texts: dict[str, str]  # repository path -> text
    base: Documents
    overlay: Documents
    namespace: str  # the overlay's
    helm: dict[str, Any]
    compose: dict[str, Any]


def _render_overlay(folder: Path, base: Documents) -> tuple[Documents, str]:
    """The example overlay as kustomize builds it, for what it uses of kustomize."""
    overlay = _kustomization(folder)
    assert [(folder / r).resolve() for r in overlay["resources"]] == [BASE.resolve()]
    deleted = set()
    for patch in overlay.get("patches", []):
        target = yaml.safe_load(patch["patch"])
        assert target.get("$patch") == "delete", f"{folder}: render this kind of patch here"
        deleted.add((target["kind"], target["metadata"]["name"]))
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in overlay["images"]}
    replicas = {r["name"]: r["count"] for r in overlay.get("replicas", [])}
    documents = []
    for file, resource in copy.deepcopy(base):
        if (resource["kind"], resource["metadata"]["name"]) in deleted:
            continue
        resource["metadata"]["namespace"] = overlay["namespace"]
        if resource["kind"] in WORKLOAD_KINDS:
            for container in _containers(resource):
                image = images.get(container["image"].split(":")[0])
                container["image"] = image or container["image"]
        if resource["metadata"]["name"] in replicas and resource["kind"] == "Deployment":
            resource["spec"]["replicas"] = replicas[resource["metadata"]["name"]]
        documents.append((file, resource))
    return documents, overlay["namespace"]


def _render() -> Rendered:
    texts = {}
    for pattern in TEXT_FILES + TEXT_FILES_OF_NATS:
        for path in sorted(REPO.glob(pattern)):
            texts[str(path.relative_to(REPO))] = path.read_text()
    base = [(str((BASE / file).relative_to(REPO)), r) for file, r in _base_documents()]
    overlay, namespace = _render_overlay(OVERLAY, base)
    return Rendered(
        texts=texts,
        base=base,
        overlay=overlay,
        namespace=namespace,
        helm=_load(texts[HELM]),
        compose=_load(texts[COMPOSE]),
    )


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return _render()


# --- reading the files --------------------------------------------------------------------------


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def _workloads(documents: Documents) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], str]]:
    """(file, workload, container, "Kind name, container c") of every container."""
    for file, resource in documents:
        if resource["kind"] in WORKLOAD_KINDS:
            for container in _containers(resource):
                where = f"{resource['kind']} {resource['metadata']['name']}"
                yield file, resource, container, f"{where}, container {container['name']}"


def _resources(documents: Documents) -> list[dict[str, Any]]:
    return [resource for _, resource in documents]


def _shell_lines(text: str) -> list[str]:
    """A text's logical shell lines: comment markers dropped, lines continued by a trailing
    backslash or an open `$(` joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        line = re.sub(r"^\s*#", "", raw).strip()
        current = f"{current} {line}" if current else line
        if current.endswith("\\"):
            current = current[:-1].rstrip()
        elif current.count("$(") <= current.count(")"):
            lines.append(current)
            current = ""
    return [*lines, current] if current else lines


def _expand_for_loops(command: str) -> str:
    """`$(for r in a b; do echo --x=$r; done)` -> `echo --x=a echo --x=b`."""

    def expand(match: re.Match[str]) -> str:
        name, words, body = match.groups()
        return " ".join(body.replace(f"${name}", word) for word in words.split())

    return re.sub(r"\$\(\s*for (\w+) in ([^;]+);\s*do\s+(.*?);\s*done\s*\)", expand, command)


@dataclass(frozen=True)
class SecretCommand:
    file: str
    secret: str
    namespace: str | None
    keys: frozenset[str]

    def __str__(self) -> str:
        return f"{self.file} (`kubectl create secret generic {self.secret}`)"


def _secret_commands(texts: Mapping[str, str]) -> list[SecretCommand]:
    """Every `kubectl create secret generic` command shown in the docs and the manifests."""
    commands = []
    for file, text in texts.items():
        for line in _shell_lines(text):
            start = line.find("kubectl")
            match = re.search(r"\bcreate secret generic (\S+)", line[max(start, 0) :])
            if start < 0 or match is None:
                continue
            command = _expand_for_loops(line[start:].split("`")[0])
            keys = set(re.findall(r"--from-literal[= ]([^=\s]+)=", command))
            for source in re.findall(r"--from-file[= ](\S+)", command):
                keys.add(source.split("=")[0] if "=" in source else PurePosixPath(source).name)
            namespace = re.search(r"(?:\s-n|--namespace)[= ](\S+)", command)
            ns = namespace.group(1) if namespace else None
            commands.append(SecretCommand(file, match.group(1), ns, frozenset(keys)))
    return commands


@dataclass(frozen=True)
class SecretRead:
    file: str
    what: str
    secret: str
    key: str | None  # None: the whole Secret


def _workload_secret_reads(documents: Documents) -> Iterator[SecretRead]:
    for file, workload, container, where in _workloads(documents):
        for var in container.get("env", []):
            if ref := var.get("valueFrom", {}).get("secretKeyRef"):
                yield SecretRead(file, f"{where}: env {var['name']}", ref["name"], ref["key"])
        for env_from in container.get("envFrom", []):
            if ref := env_from.get("secretRef"):
                yield SecretRead(file, f"{where}: envFrom", ref["name"], None)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            secret = volumes.get(mount["name"], {}).get("secret")
            if secret is None:
                continue
            name, items = secret["secretName"], secret.get("items", [])
            what = f"{where}: volume {mount['name']}"
            for item in items:
                yield SecretRead(file, f"{what}, item {item['path']}", name, item["key"])
            by_path = {item["path"]: item["key"] for item in items}
            for arg in [*container.get("command", []), *container.get("args", [])]:
                path = PurePosixPath(arg)
                if path.is_absolute() and path.parent == PurePosixPath(mount["mountPath"]):
                    key = by_path.get(path.name, path.name) if items else path.name
                    yield SecretRead(file, f"{where}: argument {arg}", name, key)


def _other_secret_reads(rendered: Rendered) -> Iterator[SecretRead]:
    """The NATS chart's environment, and the Secrets the docs' commands read."""
    for variable, spec in rendered.helm["container"]["env"].items():
        if ref := spec.get("valueFrom", {}).get("secretKeyRef"):
            yield SecretRead(HELM, f"container.env {variable}", ref["name"], ref["key"])
    for match in re.finditer(
        r"get secret (\S+) [^\n]*?\{\.data\.([\w.-]+)\}", rendered.texts[DOCS]
    ):
        what = f"`kubectl get secret {match.group(1)}` (.data.{match.group(2)})"
        yield SecretRead(DOCS, what, match.group(1), match.group(2))


def _seeded_secret_envs(keys_file: str) -> set[str]:
    """The environment variables a keys file (`llmgw keys seed FILE`) takes secrets from."""
    entries = _load(keys_file)["keys"]
    return {entry["secret_env"] for entry in entries if "secret_env" in entry}


def _config_field(name: str) -> str | None:
    """The config field an LLMGW_SECTION__FIELD variable overrides, None if it names none."""
    if not name.startswith(ENV_PREFIX):
        return None
    path = name.removeprefix(ENV_PREFIX).lower().split(ENV_NESTED_DELIMITER)
    model = _model_at(path[:-1])
    return ".".join(path) if model is not None and path[-1] in model.model_fields else None


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _args(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args([str(arg) for arg in argv])


@functools.cache
def _parsed(text: str) -> Any:
    return yaml.safe_load(text)


def _load(text: str) -> Any:
    """yaml.safe_load, parsing each text once: the checks run on many edited copies."""
    return copy.deepcopy(_parsed(text))


_CONFIGS: dict[str, Config] = {}


def _config(resources: list[dict[str, Any]], workload: dict[str, Any]) -> Config:
    """test_kubernetes's _config_of, once per ConfigMaps and workload."""
    maps = [r for r in resources if r["kind"] == "ConfigMap"]
    key = json.dumps([maps, workload], sort_keys=True)
    if key not in _CONFIGS:
        _CONFIGS[key] = _config_of(resources, workload)
    return _CONFIGS[key]


def _served_ports(argv: list[str], config: Config) -> dict[int, str]:
    """port -> what it serves, for the llmgw process `argv` started with `config`."""
    args = _args(argv)
    if args.command == "edge":
        return {
            parse_hostport(args.listen or config.listen)[1]: "the API (`listen`)",
            parse_hostport(args.admin_listen or config.admin_listen)[1]: "`admin_listen`",
        }
    if args.command in ("admission", "reaper", "scraper") and args.admin_listen:
        return {parse_hostport(args.admin_listen)[1]: "--admin-listen"}
    if args.command == "sim":
        if args.port:
            return {args.port: "--port"}
        (url,) = [e.url for e in config.endpoints if e.id == args.endpoint]
        return {urlsplit(url).port or 8000: f"endpoint {args.endpoint}'s url"}
    return {}


def _admin_ports(argv: list[str], config: Config) -> set[int]:
    served = _served_ports(argv, config)
    return {port for port, what in served.items() if "admin" in what}


# --- compose ------------------------------------------------------------------------------------


@dataclass
class ComposeProcess:
    """An llmgw service of compose.yaml: its arguments, environment and the config they make."""

    argv: list[str]
    env: dict[str, str]
    config: Config
    seeded_envs: set[str]  # secret_env of the keys file it seeds


def _host_file(service: dict[str, Any], path: str) -> Path:
    for target, source in _mounts(service).items():
        if path == target or path.startswith(f"{target}/"):
            return source / path.removeprefix(target).lstrip("/")
    raise AssertionError(f"{COMPOSE}: {path} is not on a mount of this repository")


@functools.cache
def _compose_process(service_json: str) -> ComposeProcess:
    service = json.loads(service_json)
    argv = [str(arg) for arg in service["command"]]
    args = _args(argv)
    env = {name: _default(value) for name, value in service.get("environment", {}).items()}
    raw = _load(_host_file(service, args.config).read_text())
    config = config_from_dict(raw, source=args.config, env=env)
    seeded = set()
    if args.command == "keys" and args.keys_command == "seed":
        seeded = _seeded_secret_envs(_host_file(service, args.file).read_text())
    return ComposeProcess(argv, env, config, seeded)


def _compose_llmgw(compose: dict[str, Any]) -> dict[str, ComposeProcess]:
    """The services built from the Dockerfile, by name."""
    services = compose["services"].items()
    return {
        name: _compose_process(json.dumps(service, sort_keys=True))
        for name, service in services
        if "build" in service
    }


def _flag(command: list[str], *names: str) -> str | None:
    for index, arg in enumerate(command[:-1]):
        if arg in names:
            return str(command[index + 1])
    return None


def _nats_auth_file(service: dict[str, Any], rendered: Rendered) -> tuple[str, str] | None:
    """(repository path, text) of the nats-server config a compose NATS node loads."""
    config = _flag(service.get("command", []), "-c", "--config")
    if not str(service.get("image", "")).startswith("nats:") or config is None:
        return None
    file = str(_host_file(service, config).relative_to(REPO))
    return file, rendered.texts[file]


def _compose_served(rendered: Rendered) -> dict[str, dict[int, str]]:
    """compose service -> port -> what listens there: an llmgw process by its command and
    config, a NATS node by its command line, any other image on the port its health check
    asks (the only word compose has on it)."""
    llmgw = _compose_llmgw(rendered.compose)
    served: dict[str, dict[int, str]] = {}
    for name, service in rendered.compose["services"].items():
        command = [str(arg) for arg in service.get("command", [])]
        if name in llmgw:
            served[name] = _served_ports(llmgw[name].argv, llmgw[name].config)
        elif str(service.get("image", "")).startswith("nats:"):
            client = _flag(command, "-p", "--port") or NATS_CLIENT_PORT
            served[name] = {int(client): "clients"}
            if monitor := _flag(command, "-m", "--http_port"):
                served[name][int(monitor)] = "monitoring"
            if cluster := _flag(command, "--cluster"):
                served[name][urlsplit(cluster).port or 6222] = "routes"
        else:
            served[name] = {urlsplit(url).port or 80: "its image" for url in _probe_urls(service)}
    return served


def _probe_urls(service: dict[str, Any]) -> list[str]:
    test = service.get("healthcheck", {}).get("test", [])
    return [str(arg) for arg in test if "://" in str(arg)]


# --- Secret keys --------------------------------------------------------------------------------


def _secret_problems(rendered: Rendered) -> list[str]:
    commands = _secret_commands(rendered.texts)
    problems = []
    read: dict[str, set[str | None]] = {}
    for rendering, documents in (("the base", rendered.base), ("the overlay", rendered.overlay)):
        creators: dict[str, list[tuple[str, frozenset[str]]]] = {}
        for file, resource in documents:
            if resource["kind"] == "Secret":
                keys = frozenset({**resource.get("data", {}), **resource.get("stringData", {})})
                where = f"{file} (Secret {resource['metadata']['name']})"
                creators.setdefault(resource["metadata"]["name"], []).append((where, keys))
        for command in commands:
            creators.setdefault(command.secret, []).append((str(command), command.keys))
        for ref in [*_workload_secret_reads(documents), *_other_secret_reads(rendered)]:
            read.setdefault(ref.secret, set()).add(ref.key)
            if ref.secret not in creators:
                problems.append(
                    f"{ref.file}: {ref.what} reads Secret {ref.secret}, which nothing creates "
                    f"in {rendering} (no manifest, no `kubectl create secret` command)"
                )
            for creator, keys in creators.get(ref.secret, []):
                if ref.key is not None and ref.key not in keys:
                    problems.append(
                        f"{ref.file}: {ref.what} reads key {ref.key!r} of Secret {ref.secret}, "
                        f"which {creator} does not create"
                    )
        for secret, found in creators.items():
            for creator, keys in found:
                if secret in read and None not in read[secret]:
                    for key in sorted(keys - read[secret]):
                        problems.append(f"{creator}: key {key!r} is read by nothing")
                if secret == NATS_USERS_SECRET:
                    for role in ROLES:
                        if role not in keys:
                            problems.append(f"{creator}: no key for the NATS role {role!r}")
    manifests = {
        r["metadata"]["name"]: (file, r) for file, r in rendered.base if r["kind"] == "Secret"
    }
    helm = re.search(r"helm install \S+ \S+ --namespace (\S+) -f (\S+)", rendered.texts[DOCS])
    if helm is None or (helm.group(1), helm.group(2)) != (rendered.namespace, HELM):
        problems.append(
            f"{DOCS}: no `helm install ... --namespace {rendered.namespace} -f {HELM}`: the "
            f"chart reads Secret {NATS_USERS_SECRET} from its own namespace"
        )
    for command in commands:
        if command.namespace != rendered.namespace:
            problems.append(
                f"{command}: creates the Secret in namespace {command.namespace or '(current)'}; "
                f"the overlay runs llmgw in {rendered.namespace}"
            )
        if command.secret in manifests:
            file, secret = manifests[command.secret]
            keys = {*secret.get("data", {}), *secret.get("stringData", {})}
            if missing := sorted(keys - command.keys):
                problems.append(
                    f"{command}: lacks the keys {missing} of {file} (Secret {command.secret})"
                )
    return list(dict.fromkeys(problems))


# --- environment variables ----------------------------------------------------------------------


def _unread_variables(
    file: str, where: str, env: Mapping[str, str], config: Config, seeded: set[str]
) -> list[str]:
    provider_keys = {p.api_key_env for p in config.providers if p.api_key_env}
    return [
        f"{file}: {where} sets {name}, which nothing reads: no config field, no provider's "
        "api_key_env, no secret_env of a keys file it seeds"
        for name in env
        if _config_field(name) is None and name not in provider_keys | seeded
    ]


def _password_variable_problems(
    read_by: str, read: set[str], set_by: str, given: set[str]
) -> list[str]:
    return [f"{read_by} reads ${name}, which {set_by} does not set" for name in read - given] + [
        f"{set_by} sets {name}, which {read_by} does not read" for name in given - read
    ]


def _env_problems(rendered: Rendered) -> list[str]:
    problems = []
    resources = _resources(rendered.base)
    secrets = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Secret"}
    for file, workload, container, where in _workloads(rendered.base):
        seeded: set[str] = set()
        for ref in _workload_secret_reads([(file, workload)]):
            secret = secrets.get(ref.secret, {}).get("stringData", {})
            if ref.what.startswith(f"{where}: argument") and ref.key in secret:
                seeded |= _seeded_secret_envs(secret[ref.key])
        try:
            config = _config(resources, workload)
        except ConfigError as error:  # a variable naming a field that is not there, say
            problems.append(f"{file}: {where}: its environment makes an invalid config: {error}")
            continue
        problems += _unread_variables(file, where, _environment(container), config, seeded)

    users = rendered.helm["config"]["merge"]["authorization"]["users"]
    read = {m for u in users for m in re.findall(r"<< \$(\w+) >>", str(u["password"]))}
    given = set(rendered.helm["container"]["env"])
    problems += _password_variable_problems(
        f"{HELM}: config.merge.authorization", read, f"{HELM}: container.env", given
    )

    for name, service in rendered.compose["services"].items():
        if "build" not in service:
            continue
        try:
            process = _compose_process(json.dumps(service, sort_keys=True))
        except ConfigError as error:
            problems.append(
                f"{COMPOSE}: service {name}: its environment makes an invalid config: {error}"
            )
            continue
        where = f"service {name}"
        problems += _unread_variables(
            COMPOSE, where, process.env, process.config, process.seeded_envs
        )
    for name, service in rendered.compose["services"].items():
        if (auth := _nats_auth_file(service, rendered)) is not None:
            file, text = auth
            read = set(re.findall(r"^\s*password:\s*\$(\w+)\s*$", text, flags=re.M))
            given = set(service.get("environment", {}))
            problems += _password_variable_problems(file, read, f"{COMPOSE}: service {name}", given)

    # Every LLMGW_ name the files mention: a field, a role's password, a keys file's secret_env.
    known = {password_variable(role) for role in ROLES} | {password_variable("<ROLE>")}
    for file, text in rendered.texts.items():
        if file.startswith("config/") and isinstance(loaded := _load(text), dict):
            known |= _seeded_secret_envs(text) if "keys" in loaded else set()
    for secret in secrets.values():
        for value in secret.get("stringData", {}).values():
            if isinstance(loaded := _load(value), dict) and "keys" in loaded:
                known |= _seeded_secret_envs(value)
    for file, text in rendered.texts.items():
        if file == CONFIG_DOCS:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            for name in re.findall(r"\bLLMGW_[A-Z0-9_]*(?:<ROLE>|[A-Z0-9])", line):
                if _config_field(name) is None and name not in known:
                    problems.append(
                        f"{file}: {name} (line {number}) is no config field, no NATS role's "
                        "password variable and no keys file's secret_env"
                    )
    return list(dict.fromkeys(problems))


# --- NATS roles ---------------------------------------------------------------------------------


def _role_lists(texts: Mapping[str, str]) -> Iterator[tuple[str, str, list[str]]]:
    """(file, what, roles) for every list of roles the docs and comments give."""
    for file, text in texts.items():
        for match in re.finditer(r"the service's role \(([^)]*)\)", text):
            yield file, "the NATS user's roles", re.findall(r"`(\w+)`", match.group(1))
        for match in re.finditer(r"`LLMGW_NATS_PASSWORD_([A-Z]+)`((?:,\s*`_[A-Z]+`)+)", text):
            roles = [match.group(1), *re.findall(r"`_([A-Z]+)`", match.group(2))]
            yield file, "the password variables", [role.lower() for role in roles]
        for match in re.finditer(r"LLMGW_NATS_PASSWORD_<ROLE>\s+([A-Z]+(?:,\s*[A-Z]+)+)", text):
            roles = re.findall(r"[A-Z]+", match.group(1))
            yield file, "the password variables", [role.lower() for role in roles]


def _role_problems(rendered: Rendered) -> list[str]:
    problems = []
    roles = set(ROLES)

    def named(file: str, what: str, role: str) -> None:
        if role not in roles:
            problems.append(f"{file}: {what} names {role!r}, which is no NATS role {list(ROLES)}")

    def complete(file: str, what: str, listed: list[str] | set[str]) -> None:
        for role in listed:
            named(file, what, role)
        for role in ROLES:
            if role not in listed:
                problems.append(f"{file}: {what} lacks the NATS role {role!r}")

    for file, _workload, container, where in _workloads(rendered.base):
        user = _environment(container).get("LLMGW_NATS__USER")
        if user is not None:
            named(file, f"{where}: LLMGW_NATS__USER", user)
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef", {})
            if var["name"] == "LLMGW_NATS__PASSWORD" and (ref.get("name"), ref.get("key")) != (
                NATS_USERS_SECRET,
                user,
            ):
                problems.append(
                    f"{file}: {where}: LLMGW_NATS__PASSWORD reads {ref}, not the key {user!r} "
                    f"(its LLMGW_NATS__USER) of Secret {NATS_USERS_SECRET}"
                )
    users = rendered.helm["config"]["merge"]["authorization"]["users"]
    complete(HELM, "config.merge.authorization.users", [u["user"] for u in users])

    for name, service in rendered.compose["services"].items():
        env = service.get("environment", {})
        if "build" not in service or (user := env.get("LLMGW_NATS__USER")) is None:
            continue
        named(COMPOSE, f"service {name}: LLMGW_NATS__USER", user)
        password = str(env.get("LLMGW_NATS__PASSWORD"))
        if not password.startswith(f"${{{password_variable(user)}:-"):
            problems.append(
                f"{COMPOSE}: service {name}: LLMGW_NATS__PASSWORD is {password!r}, not "
                f"{password_variable(user)} (the password of its user {user!r})"
            )
    for name, service in rendered.compose["services"].items():
        if (auth := _nats_auth_file(service, rendered)) is not None:
            file, text = auth
            complete(
                file, f"the users ({COMPOSE} service {name})", re.findall(r'user: "(\w+)"', text)
            )

    found = set()
    for file, what, listed in _role_lists(rendered.texts):
        found.add(file)
        complete(file, what, listed)
    for file in ROLE_LISTS_IN:
        if file not in found:
            problems.append(f"{file}: the list of NATS roles is gone (see _role_lists)")
    for file, text in rendered.texts.items():
        for role in re.findall(r"LLMGW_NATS__USER=(\w+)", text):
            named(file, "LLMGW_NATS__USER=", role)
        for match in re.finditer(r"`LLMGW_NATS__USER` \(((?:\w+, )*\w+)\)", text):
            services = [role.strip() for role in match.group(1).split(",")]
            for role in services:
                named(file, "the services' NATS users", role)
            if sorted(services) != sorted(SERVICE_ROLES.values()):
                expected = sorted(SERVICE_ROLES.values())
                problems.append(f"{file}: the services' NATS users {services} are not {expected}")
    for role in re.findall(r"`(\w+)` role\b", rendered.texts[DOCS]):
        named(DOCS, f"`{role}` role", role)
    return list(dict.fromkeys(problems))


# --- ports --------------------------------------------------------------------------------------


def _port_number(port: int | str, declared: Mapping[int | str, int]) -> int | None:
    """A probe's or Service's port: a containerPort's name, or a number."""
    return declared.get(port, port if isinstance(port, int) else None)


def _kubernetes_port_problems(rendered: Rendered) -> list[str]:
    problems = []
    resources = _resources(rendered.base)
    pods = []  # (labels, container, declared: name or number -> port, served: port -> what)
    for file, workload, container, where in _workloads(rendered.base):
        served = _served_ports(container["args"], _config(resources, workload))
        declared: dict[int | str, int] = {}
        for entry in container.get("ports", []):
            port = entry["containerPort"]
            declared[port] = declared[entry.get("name", port)] = port
            if port not in served:
                problems.append(
                    f"{file}: {where}: containerPort {port} ({entry.get('name')}) is served by "
                    f"nothing (the process serves {served or 'no port'})"
                )
        for port, what in served.items():
            if port not in declared:
                problems.append(f"{file}: {where}: serves {what} on {port}, no containerPort")
        for probe in PROBES:
            for action in ("httpGet", "tcpSocket", "grpc"):
                port = container.get(probe, {}).get(action, {}).get("port")
                if port is not None and _port_number(port, declared) not in served:
                    problems.append(
                        f"{file}: {where}: {probe} asks port {port!r}, which no container port "
                        f"the process serves is (declared {sorted(map(str, declared))})"
                    )
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in annotations:
            port = int(annotations["prometheus.io/port"])
            if port not in _admin_ports(container["args"], _config(resources, workload)):
                problems.append(
                    f"{file}: {where}: prometheus.io/port {port} is not its admin port "
                    f"(the process serves {served or 'no port'})"
                )
        for var in container.get("env", []):
            if var["name"] == "LLMGW_NATS__URL" and var.get("value") != NATS_CHART_URL:
                problems.append(
                    f"{file}: {where}: LLMGW_NATS__URL {var.get('value')} is not the NATS "
                    f"chart's client Service ({NATS_CHART_URL})"
                )
        labels = workload["spec"]["template"]["metadata"]["labels"]
        pods.append((labels, container, declared, served))

    service_ports = {urlsplit(NATS_CHART_URL).hostname: {urlsplit(NATS_CHART_URL).port}}
    for file, service in rendered.base:
        if service["kind"] != "Service":
            continue
        name = service["metadata"]["name"]
        service_ports[name] = {port["port"] for port in service["spec"]["ports"]}
        selected = [pod for pod in pods if _selects(service["spec"]["selector"], pod[0])]
        if not selected:
            problems.append(f"{file}: Service {name} selects no pod")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for _, container, declared, served in selected:
                if _port_number(target, declared) not in served:
                    problems.append(
                        f"{file}: Service {name} port {port['port']} targets {target!r}, which "
                        f"container {container['name']} does not serve"
                    )
    for match in re.finditer(
        r"port-forward (?:service|svc)/(\S+) (?:\d+:)?(\d+)", rendered.texts[DOCS]
    ):
        name, port = match.group(1), int(match.group(2))
        if port not in service_ports.get(name, set()):
            problems.append(
                f"{DOCS}: `kubectl port-forward service/{name}` asks port {port}, which "
                f"Service {name} does not have ({sorted(service_ports.get(name, set()))})"
            )
    return problems


def _compose_port_problems(rendered: Rendered) -> list[str]:
    problems = []
    services = rendered.compose["services"]
    served = _compose_served(rendered)

    def check(where: str, host: str | None, port: int | None, what: str) -> None:
        if host not in served:
            problems.append(f"{where}: {what} names {host}, which is no service of {COMPOSE}")
        elif port not in served[host]:
            problems.append(
                f"{where}: {what} asks {host}:{port}, which {host} does not serve "
                f"(it serves {served[host] or 'no port'})"
            )

    for name, service in services.items():
        for mapping in service.get("ports", []):
            container = int(str(mapping).split("/")[0].rsplit(":", 1)[-1])
            check(f"{COMPOSE}: service {name}", name, container, f"port mapping {mapping}")
        for url in _probe_urls(service):
            check(
                f"{COMPOSE}: service {name}", name, urlsplit(url).port or 80, f"health check {url}"
            )
    for name, process in _compose_llmgw(rendered.compose).items():
        where = f"{COMPOSE}: service {name}"
        if url := process.env.get("LLMGW_NATS__URL"):
            for server in url.split(","):
                parts = urlsplit(server.strip())
                check(where, parts.hostname, parts.port or NATS_CLIENT_PORT, "LLMGW_NATS__URL")
        for endpoint in process.config.endpoints:
            parts = urlsplit(endpoint.url)
            if parts.hostname in services:
                check(where, parts.hostname, parts.port or 80, f"endpoint {endpoint.id}")

    scraped = set()
    prometheus = _load(rendered.texts[PROMETHEUS])
    for job in prometheus["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                check(PROMETHEUS, host, sd["port"], f"job {job['job_name']}")
                scraped.add((host, sd["port"]))
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                check(PROMETHEUS, host, int(port), f"job {job['job_name']}")
                scraped.add((host, int(port)))
    for name, process in _compose_llmgw(rendered.compose).items():
        for port in sorted(_admin_ports(process.argv, process.config)):
            if (name, port) not in scraped:
                problems.append(f"{PROMETHEUS}: no job scrapes {name}'s admin port {port}")
    for source in _load(rendered.texts[GRAFANA_SOURCES])["datasources"]:
        parts = urlsplit(source["url"])
        check(GRAFANA_SOURCES, parts.hostname, parts.port or 80, f"data source {source['name']}")
    return problems


def _image_port_problems(rendered: Rendered) -> list[str]:
    exposed = {int(p) for args in _stages()[-1].args("EXPOSE") for p in args.split()}
    problems = []
    resources = _resources(rendered.base)
    for file, workload, container, where in _workloads(rendered.base):
        for port, what in _served_ports(container["args"], _config(resources, workload)).items():
            if port not in exposed:
                problems.append(f"Dockerfile: EXPOSE lacks {port} ({file}: {where} serves {what})")
    for name, process in _compose_llmgw(rendered.compose).items():
        if _args(process.argv).command == "sim":
            continue  # a simulator is not the gateway: its ports are the endpoints' own
        for port, what in _served_ports(process.argv, process.config).items():
            if port not in exposed:
                problems.append(
                    f"Dockerfile: EXPOSE lacks {port} ({COMPOSE}: {name} serves {what})"
                )
    return problems


def _port_problems(rendered: Rendered) -> list[str]:
    return [
        *_kubernetes_port_problems(rendered),
        *_compose_port_problems(rendered),
        *_image_port_problems(rendered),
    ]


# --- the tests ----------------------------------------------------------------------------------


def test_every_secret_key_read_is_created(rendered: Rendered) -> None:
    assert _secret_problems(rendered) == []


def test_every_environment_variable_is_read_and_every_llmgw_name_resolves(
    rendered: Rendered,
) -> None:
    assert _env_problems(rendered) == []


def test_every_nats_user_is_a_role_and_every_role_list_is_complete(rendered: Rendered) -> None:
    assert _role_problems(rendered) == []


def test_every_port_referred_to_is_served(rendered: Rendered) -> None:
    assert _port_problems(rendered) == []


def test_the_readers_find_what_they_check(rendered: Rendered) -> None:
    """A reader that finds nothing would pass everything."""
    commands = {c.secret: c for c in _secret_commands(rendered.texts) if c.file == DOCS}
    assert set(commands[NATS_USERS_SECRET].keys) == set(ROLES)
    assert set(commands) == {
        r["metadata"]["name"] for _, r in rendered.base if r["kind"] == "Secret"
    }
    reads = list(_workload_secret_reads(rendered.base))
    assert {(r.secret, r.key) for r in reads if "argument" in r.what} == {
        ("llmgw-api-keys", "keys.yaml")
    }
    assert {r.secret for r in _other_secret_reads(rendered)} == {NATS_USERS_SECRET}
    assert {file for file, _, _ in _role_lists(rendered.texts)} == set(ROLE_LISTS_IN)
    assert _config_field("LLMGW_FLEET__KUBERNETES__NAMESPACE") == "fleet.kubernetes.namespace"
    assert _config_field("LLMGW_LISTEN") == "listen"
    assert {_config_field(n) for n in ("LLMGW_NAST__USER", "LLMGW_NATS__UESR", "LLMGW_")} == {None}
    assert _compose_served(rendered)["edge"] == {8080: "the API (`listen`)", 9090: "`admin_listen`"}


def _edit(path: str, old: str, new: str) -> Callable[[Rendered], None]:
    def edit(rendered: Rendered) -> None:
        assert old in rendered.texts[path], (path, old)
        rendered.texts[path] = rendered.texts[path].replace(old, new)
        rendered.helm = _load(rendered.texts[HELM])
        rendered.compose = _load(rendered.texts[COMPOSE])

    return edit


def _resource(rendered: Rendered, kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for _, r in rendered.base if (r["kind"], r["metadata"]["name"]) == (kind, name)]
    return found


def _env_var(rendered: Rendered, deployment: str, name: str) -> dict[str, Any]:
    container = _resource(rendered, "Deployment", deployment)["spec"]["template"]["spec"]
    (var,) = [v for v in container["containers"][0]["env"] if v["name"] == name]
    return var


def _container_of(rendered: Rendered, deployment: str) -> dict[str, Any]:
    return _resource(rendered, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][
        0
    ]


def _without_fleet_key(rendered: Rendered) -> None:
    """The NATS users' Secret as it was filed: no key for the fleet role."""
    for _, resource in rendered.base:
        if resource["metadata"]["name"] == NATS_USERS_SECRET:
            del resource["stringData"]["fleet"]


@pytest.mark.parametrize(
    ("check", "mutate", "expected"),
    [
        (
            _secret_problems,
            _edit(DOCS, "keys state events fleet;", "keys state events;"),
            f"{HELM}: container.env LLMGW_NATS_PASSWORD_FLEET reads key 'fleet' of Secret "
            f"llmgw-nats-users, which {DOCS} (`kubectl create secret generic llmgw-nats-users`) "
            "does not create",
        ),
        (
            _secret_problems,
            _edit(DOCS, "keys state events fleet;", "keys state events;"),
            f"{DOCS} (`kubectl create secret generic llmgw-nats-users`): no key for the NATS "
            "role 'fleet'",
        ),
        (
            _secret_problems,
            _without_fleet_key,
            "container.env LLMGW_NATS_PASSWORD_FLEET reads key 'fleet' of Secret "
            "llmgw-nats-users, which deploy/kubernetes/base/nats-users.yaml (Secret "
            "llmgw-nats-users) does not create",
        ),
        (
            _secret_problems,
            lambda r: _env_var(r, "llmgw-edge", "THIRDPARTY_API_KEY")["valueFrom"][
                "secretKeyRef"
            ].update(key="THIRDPARTY_KEY"),
            "env THIRDPARTY_API_KEY reads key 'THIRDPARTY_KEY' of Secret llmgw-provider-keys",
        ),
        (
            _secret_problems,
            _edit(DOCS, "--from-file=keys.yaml=./keys.yaml", "--from-file=./api-keys.yaml"),
            "argument /etc/llmgw-keys/keys.yaml reads key 'keys.yaml' of Secret llmgw-api-keys, "
            f"which {DOCS}",
        ),
        (
            _secret_problems,
            _edit(
                DOCS,
                "kubectl -n llmgw create secret generic llmgw-api-keys",
                "kubectl create secret generic llmgw-api-keys",
            ),
            "creates the Secret in namespace (current); the overlay runs llmgw in llmgw",
        ),
        (
            _secret_problems,
            _edit(DOCS, "{.data.state}", "{.data.stats}"),
            "reads key 'stats' of Secret llmgw-nats-users",
        ),
        (
            _role_problems,
            _edit(CONFIG_DOCS, "`fleet` for the tools", "`fleet`, `fleet2` for the tools"),
            f"{CONFIG_DOCS}: the NATS user's roles names 'fleet2'",
        ),
        (
            _role_problems,
            _edit(CONFIG_DOCS, ", `fleet` for the tools", " for the tools"),
            f"{CONFIG_DOCS}: the NATS user's roles lacks the NATS role 'fleet'",
        ),
        (
            _role_problems,
            _edit(COMPOSE, "STATE, EVENTS, FLEET", "STATE, EVENTS"),
            f"{COMPOSE}: the password variables lacks the NATS role 'fleet'",
        ),
        (
            _role_problems,
            _edit(COMPOSE, "LLMGW_NATS__USER: reaper", "LLMGW_NATS__USER: reaperr"),
            f"{COMPOSE}: service reaper: LLMGW_NATS__USER names 'reaperr'",
        ),
        (
            _role_problems,
            lambda r: _env_var(r, "llmgw-scraper", "LLMGW_NATS__PASSWORD")["valueFrom"][
                "secretKeyRef"
            ].update(key="reaper"),
            "LLMGW_NATS__PASSWORD reads {'name': 'llmgw-nats-users', 'key': 'reaper'}, not the "
            "key 'scraper'",
        ),
        (
            _env_problems,
            _edit(COMPOSE, 'LLMGW_NATS__REPLICAS: "3"', 'LLMGW_NAST__REPLICAS: "3"'),
            f"{COMPOSE}: service admission sets LLMGW_NAST__REPLICAS, which nothing reads",
        ),
        (
            _env_problems,
            lambda r: _env_var(r, "llmgw-admission", "LLMGW_ADMISSION__INSTANCE_NAME").update(
                name="LLMGW_ADMISION__INSTANCE_NAME"
            ),
            "Deployment llmgw-admission, container admission sets LLMGW_ADMISION__INSTANCE_NAME, "
            "which nothing reads",
        ),
        (
            _env_problems,
            _edit(COMPOSE, "LLMGW_NATS_PASSWORD_FLEET: ${", "LLMGW_NATS_PASSWORD_FLEETS: ${"),
            "deploy/nats/llmgw-auth.conf reads $LLMGW_NATS_PASSWORD_FLEET, which compose.yaml: "
            "service nats-1 does not set",
        ),
        (
            _env_problems,
            _edit(HELM, "LLMGW_NATS_PASSWORD_FLEET:\n", "LLMGW_NATS_PASSWORD_FLET:\n"),
            f"{HELM}: config.merge.authorization reads $LLMGW_NATS_PASSWORD_FLEET",
        ),
        (
            _env_problems,
            _edit(DOCS, "`LLMGW_ADMISSION__INSTANCE_NAME`", "`LLMGW_ADMISSION__NAME`"),
            f"{DOCS}: LLMGW_ADMISSION__NAME (line ",
        ),
        (
            _port_problems,
            lambda r: _container_of(r, "llmgw-reaper")["readinessProbe"]["httpGet"].update(
                port=9099
            ),
            "Deployment llmgw-reaper, container reaper: readinessProbe asks port 9099",
        ),
        (
            _port_problems,
            lambda r: _resource(r, "Service", "llmgw-edge")["spec"]["ports"][0].update(
                targetPort="admn"
            ),
            "Service llmgw-edge port 80 targets 'admn'",
        ),
        (
            _port_problems,
            lambda r: _container_of(r, "llmgw-scraper")["ports"][0].update(containerPort=9094),
            "containerPort 9094 (admin) is served by nothing",
        ),
        (
            _port_problems,
            _edit(COMPOSE, '"127.0.0.1:9090:9090"', '"127.0.0.1:9090:9091"'),
            f"{COMPOSE}: service edge: port mapping 127.0.0.1:9090:9091 asks edge:9091",
        ),
        (
            _port_problems,
            _edit(PROMETHEUS, "port: 9093", "port: 9094"),
            f"{PROMETHEUS}: job llmgw-scraper asks scraper:9094",
        ),
        (
            _port_problems,
            _edit(DOCS, "service/llmgw-edge 8080:80", "service/llmgw-edge 8080:8080"),
            "`kubectl port-forward service/llmgw-edge` asks port 8080",
        ),
    ],
    ids=[
        "docs-command-without-fleet-key",
        "docs-command-without-fleet-role",
        "secret-manifest-without-fleet",
        "provider-key-misspelt",
        "seeded-file-not-created",
        "secret-in-another-namespace",
        "docs-read-a-missing-key",
        "config-docs-unknown-role",
        "config-docs-role-list-without-fleet",
        "compose-comment-without-fleet",
        "compose-user-misspelt",
        "password-of-another-role",
        "compose-env-names-no-section",
        "kubernetes-env-names-no-field",
        "compose-nats-password-not-set",
        "helm-password-not-set",
        "docs-name-no-field",
        "probe-on-an-unserved-port",
        "service-target-port-misspelt",
        "container-port-nothing-serves",
        "compose-mapping-to-an-unserved-port",
        "prometheus-scrapes-an-unserved-port",
        "docs-port-forward-to-a-missing-port",
    ],
)
def test_the_check_catches(
    rendered: Rendered,
    check: Callable[[Rendered], list[str]],
    mutate: Callable[[Rendered], None],
    expected: str,
) -> None:
    broken = copy.deepcopy(rendered)
    mutate(broken)
    problems = check(broken)
    assert any(expected in problem for problem in problems), problems
