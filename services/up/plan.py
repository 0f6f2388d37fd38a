"""What `llmgw up` starts, as pure data: one `ServiceSpec` per child process.

`plan_cluster` reads only the config object, so the compose file test and
`llmgw up --dry-run` see exactly the plan the supervisor runs.

Admin ports: the edge serves /metrics and /health on `admin_listen`; admission, the reaper and the
scraper on the next three ports (+1, +2, +3), unless `admin_listen`'s port is 0.

NATS (`plan_nats`): with `nats.url: embedded`, one nats-server on `embedded_port`, or with
`nats.embedded_cluster: N` (or `llmgw up --nats-cluster N`, which wins) a JetStream cluster of N
nodes on `embedded_port + i`. It starts before every tier and stops after them. With a cluster,
the services get the whole server list and `nats.replicas` (3 unless the config sets it), so
every bucket they create is replicated.

Order (tiers start in this order and stop in reverse):
  1. a simulator per endpoint that has a `simulate` block (`llmgw sim engine|provider`),
  2. the admission service, the reaper and the scraper (together: none needs another),
  3. the edge (last: when it is ready, the whole cluster is).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from llmgw.config import Config, EndpointConfig

ServiceKind = Literal["sim-engine", "sim-provider", "admission", "reaper", "scraper", "edge"]

# Every service prints a line containing "llmgw <service> ready" once it serves (the services'
# contract). Simulators are matched loosely: either sim flavour's line counts.
READY_PATTERNS: dict[str, re.Pattern[str]] = {
    "sim-engine": re.compile(r"llmgw sim (engine|provider) ready"),
    "sim-provider": re.compile(r"llmgw sim (engine|provider) ready"),
    "admission": re.compile(r"llmgw admission ready"),
    "reaper": re.compile(r"llmgw reaper ready"),
    "scraper": re.compile(r"llmgw scraper ready"),
    "edge": re.compile(r"llmgw edge ready"),
}
_URL_IN_LINE = re.compile(r"\bhttps?://\S+")
TIER_OF_KIND: dict[str, int] = {
    "sim-engine": 0,
    "sim-provider": 0,
    "admission": 1,
    "reaper": 1,
    "scraper": 1,
    "edge": 2,
}


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A host:port a service binds, with what it is for (used in error messages)."""

    host: str
    port: int
    purpose: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One child process: `argv` are the arguments of the `llmgw` command (no interpreter)."""

    name: str
    argv: tuple[str, ...]
    kind: ServiceKind
    listens: tuple[ListenAddress, ...] = field(default=())
    # An admission process, or an edge that runs admission in process (admission.colocated):
    # its instance's name without the supervisor's per-start suffix (services/up/supervisor.py,
    # `incarnation_args`).
    admission_instance: str | None = None

    def is_ready_line(self, line: str) -> bool:
        return READY_PATTERNS[self.kind].search(line) is not None

    @property
    def tier(self) -> int:
        return TIER_OF_KIND[self.kind]


CLUSTER_NAME = "llmgw-up"
# Replicas of the services' buckets on an embedded cluster when the config does not say.
CLUSTER_REPLICAS = 3


class PlanError(ValueError):
    """The config and the command line ask for a NATS setup `llmgw up` cannot start."""


@dataclass(frozen=True, slots=True)
class NatsNodeSpec:
    """One embedded nats-server: its label in the output and its client port (0 = a free one)."""

    name: str
    port: int


@dataclass(frozen=True, slots=True)
class NatsPlan:
    """Where the services find NATS. No nodes: external servers (`url`), nothing is started.

    `replicas` is what the services pass to every bucket they create (`nats.replicas`); for a
    cluster `llmgw up` hands it to them as LLMGW_NATS__REPLICAS.
    """

    url: str
    nodes: tuple[NatsNodeSpec, ...]
    replicas: int
    store_dir: str | None = None

    @property
    def embedded(self) -> bool:
        return bool(self.nodes)

    @property
    def is_cluster(self) -> bool:
        return len(self.nodes) > 1

    def child_env(self, server_url: str) -> dict[str, str]:
        """The environment the services get once the embedded servers run at `server_url`."""
        if not self.embedded:
            return {}
        env = {"LLMGW_NATS__URL": server_url}
        if self.is_cluster:
            env["LLMGW_NATS__REPLICAS"] = str(self.replicas)
        return env


def plan_nats(config: Config, cluster_size: int | None = None) -> NatsPlan:
    """The NATS part of the plan; `cluster_size` (from --nats-cluster) overrides the config.

    Raises PlanError when a cluster is asked of external servers, for a size Raft cannot use,
    or when buckets would need more replicas than there are servers.
    """
    from llmgw.config.sections import MAX_EMBEDDED_CLUSTER

    nats = config.nats
    if not nats.is_embedded:
        if cluster_size is not None:
            raise PlanError(f"--nats-cluster needs nats.url: embedded; this config uses {nats.url}")
        return NatsPlan(nats.url, (), nats.replicas)
    size = nats.embedded_cluster if cluster_size is None else cluster_size
    if size == 2 or not 1 <= size <= MAX_EMBEDDED_CLUSTER:
        raise PlanError(
            f"--nats-cluster {size}: use 1 (one server) or 3..{MAX_EMBEDDED_CLUSTER} "
            "(a Raft majority must survive losing a server)"
        )
    replicas = nats.replicas
    if size > 1 and "replicas" not in nats.model_fields_set:
        replicas = CLUSTER_REPLICAS
    wanted = max(replicas, config.pinning.replicas or 0)
    if wanted > size:
        raise PlanError(
            f"buckets with {wanted} replicas need at least {wanted} NATS servers and `llmgw up` "
            f"would start {size}: set nats.embedded_cluster (or --nats-cluster) to {max(wanted, 3)}"
            ", or lower nats.replicas / pinning.replicas"
        )
    port = nats.embedded_port
    if size == 1:
        nodes: tuple[NatsNodeSpec, ...] = (NatsNodeSpec("nats", port),)
    else:
        nodes = tuple(NatsNodeSpec(f"nats-{i}", port + i if port else 0) for i in range(size))
    return NatsPlan(nats.url, nodes, replicas, nats.store_dir)


def format_nats_plan(plan: NatsPlan) -> str:
    """The NATS lines of `llmgw up --dry-run`."""
    if not plan.embedded:
        return f"{'nats':<16} external {plan.url}"
    store = plan.store_dir or "a temporary directory"
    if not plan.is_cluster:
        port = plan.nodes[0].port or "a free port"
        return f"{'nats':<16} embedded nats-server on 127.0.0.1:{port} (JetStream store: {store})"
    lines = [
        f"{'nats':<16} embedded JetStream cluster {CLUSTER_NAME} of {len(plan.nodes)} nodes; "
        f"bucket replicas: {plan.replicas} (stores under {store})"
    ]
    for index, node in enumerate(plan.nodes):
        port = node.port or "a free port"
        lines.append(
            f"{node.name:<16} nats-server {CLUSTER_NAME}-{index} on 127.0.0.1:{port} "
            "(cluster port: a free one)"
        )
    return "\n".join(lines)


def plan_cluster(config: Config, config_path: str) -> list[ServiceSpec]:
    """The child processes for `config`, in start order; every child reads `config_path`.

    With ``admission.colocated`` no separate admission process runs: the one edge's own
    instance owns every shard, so every decision is made in the edge's process. The admin
    ports keep their offsets from the edge's (admission +1, reaper +2, scraper +3)."""
    specs: list[ServiceSpec] = []
    for endpoint in config.endpoints:
        simulate = getattr(endpoint, "simulate", None)
        if simulate is None:
            continue
        sim_kind = simulate.kind  # "engine" | "provider"
        specs.append(
            ServiceSpec(
                name=endpoint.id,
                argv=("sim", sim_kind, "--config", config_path, "--endpoint", endpoint.id),
                kind="sim-engine" if sim_kind == "engine" else "sim-provider",
                listens=_endpoint_listen(endpoint),
            )
        )
    services: tuple[ServiceKind, ...] = ("admission", "reaper", "scraper")
    for offset, kind in enumerate(services, start=1):
        if kind == "admission" and config.admission.colocated:
            continue  # the edge is the admission instance (it owns every shard)
        argv: tuple[str, ...] = (kind, "--config", config_path)
        listens: tuple[ListenAddress, ...] = ()
        if config.admin_port:  # admin ports follow the edge's: admission +1, reaper +2, scraper +3
            admin = ListenAddress(config.admin_host, config.admin_port + offset, f"{kind} admin")
            argv += ("--admin-listen", str(admin))
            listens = (admin,)
        specs.append(
            ServiceSpec(
                kind,
                argv,
                kind,
                listens=listens,
                admission_instance="up-admission" if kind == "admission" else None,
            )
        )
    specs.append(
        ServiceSpec(
            "edge",
            ("edge", "--config", config_path),
            "edge",
            listens=(
                ListenAddress(config.listen_host, config.listen_port, "edge `listen`"),
                ListenAddress(config.admin_host, config.admin_port, "edge `admin_listen`"),
            ),
            admission_instance="up-edge" if config.admission.colocated else None,
        )
    )
    return specs


def edge_env(config: Config) -> dict[str, str]:
    """The edge's own environment under `llmgw up`: ``router.drain_delay`` 0 unless it is set.

    The delay keeps a stopping edge serving while a load balancer notices it is unready; `llmgw
    up` has no load balancer in front of its one edge and stops it only to stop the whole
    cluster, so the wait would only hold up Ctrl-C. A delay that the config (or the environment)
    sets is kept. Running requests still drain (``router.drain_timeout``)."""
    if "drain_delay" in config.router.model_fields_set:
        return {}
    return {"LLMGW_ROUTER__DRAIN_DELAY": "0s"}


def url_in_line(line: str) -> str | None:
    """The first http(s) URL in a ready line ("llmgw edge ready on http://...")."""
    match = _URL_IN_LINE.search(line)
    return match.group(0).rstrip(".,;)") if match else None


def _endpoint_listen(endpoint: EndpointConfig) -> tuple[ListenAddress, ...]:
    parts = urlsplit(endpoint.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or "127.0.0.1"
    return (ListenAddress(host, port, f"simulated endpoint {endpoint.id}"),)


def duplicate_listens(specs: Iterable[ServiceSpec]) -> list[str]:
    """Problems where two services of the plan would bind the same port (port 0 excepted)."""
    seen: dict[int, ListenAddress] = {}
    problems = []
    for spec in specs:
        for address in spec.listens:
            if address.port == 0:
                continue
            other = seen.get(address.port)
            if other is not None:
                problems.append(
                    f"port {address.port} is used twice: {other.purpose} and {address.purpose}"
                )
            else:
                seen[address.port] = address
    return problems


def format_plan(specs: Iterable[ServiceSpec], nats_line: str) -> str:
    """Human-readable plan for `llmgw up --dry-run`."""
    lines = [nats_line]
    for spec in specs:
        where = ", ".join(f"{a} ({a.purpose})" for a in spec.listens)
        lines.append(
            f"{spec.name:<16} llmgw {' '.join(spec.argv)}" + (f"   # {where}" if where else "")
        )
    return "\n".join(lines)
