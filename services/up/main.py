"""`llmgw up`: the whole gateway on one machine, from one config file.

Starts an embedded NATS server (when `nats.url` is "embedded"), or a JetStream
cluster of them (`nats.embedded_cluster: 3` or `--nats-cluster 3`), then the
simulators of every endpoint with a `simulate` block, the admission service and
the edge, each as a child process (`python -m llmgw ...`) reading the same config.
Children get the server list through `LLMGW_NATS__URL` (and, with a cluster, the
bucket replicas through `LLMGW_NATS__REPLICAS`). NATS stops last. A cluster node
that exits is restarted with its store (`nats_keeper.py`), and so is a single server.

Exit codes: 0 after Ctrl-C/SIGTERM, 1 when the cluster cannot start or a child
(or a NATS node) crash-loops (see `restart.py`), 2 for config errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

from llmgw.config import Config
from llmgw.nats_cluster import EmbeddedNatsCluster
from llmgw.nats_embedded import EmbeddedNats, NatsServerError, port_is_free
from llmgw.runtime import load_or_exit
from llmgw.services.fleet.reload import Reloader
from llmgw.services.up.admintoken import AdminToken
from llmgw.services.up.devkey import create_dev_key
from llmgw.services.up.nats_keeper import NatsKeeper, OneServer, node_label
from llmgw.services.up.offset import write_shifted
from llmgw.services.up.plan import (
    CLUSTER_NAME,
    NatsPlan,
    PlanError,
    ServiceSpec,
    duplicate_listens,
    edge_env,
    format_nats_plan,
    format_plan,
    plan_cluster,
    plan_nats,
)
from llmgw.services.up.secure import SecureNats
from llmgw.services.up.supervisor import ClusterSupervisor

DEFAULT_CONFIG = "config/local.yaml"
DEFAULT_READY_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 10.0
_ANY_HOSTS = {"", "0.0.0.0", "::"}


def run(args: argparse.Namespace) -> int:
    config_path = str(getattr(args, "config", None) or DEFAULT_CONFIG)
    offset = int(getattr(args, "port_offset", None) or 0)
    if not offset:
        return _run(args, config_path)
    load_or_exit(config_path)  # the original's errors, under its own name
    moved = write_shifted(config_path, offset)
    try:
        return _run(args, moved)
    finally:
        os.unlink(moved)


def _run(args: argparse.Namespace, config_path: str) -> int:
    config = load_or_exit(config_path)
    if getattr(args, "nats_passwords", None) and not getattr(args, "secure", False):
        print("llmgw up: --nats-passwords is for --secure (a NATS user per role)", file=sys.stderr)
        return 2
    try:
        nats_plan = plan_nats(config, getattr(args, "nats_cluster", None))
    except PlanError as exc:
        print(f"llmgw up: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "secure", False) and config.admission.colocated:
        config = _separate_admission(config)
    specs = plan_cluster(config, config_path)

    if getattr(args, "dry_run", False):
        nats_line = format_nats_plan(nats_plan)
        if getattr(args, "secure", False):
            nats_line += "\n" + f"{'':<16} --secure: a NATS user per service role (docs/keys.md)"
        print(format_plan(specs, nats_line))
        return 0

    problems = duplicate_listens(specs) + _busy_ports(specs, nats_plan)
    if problems:
        for problem in problems:
            print(f"llmgw up: {problem}", file=sys.stderr)
        print("llmgw up: nothing was started", file=sys.stderr)
        return 1

    secure: SecureNats | None = None
    if getattr(args, "secure", False):
        try:
            secure = _prepare_secure(config, nats_plan, getattr(args, "nats_passwords", None))
        except (PlanError, ValueError, OSError) as exc:
            print(f"llmgw up: {exc}", file=sys.stderr)
            return 2
    try:
        admin_token = AdminToken.prepare(config)
    except OSError as exc:
        print(f"llmgw up: auth.admin_token_file: {exc}", file=sys.stderr)
        if secure is not None:
            secure.cleanup()
        return 2
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # children's lines (and ready lines) arrive as printed
    env.update(admin_token.env)
    nats: EmbeddedNats | EmbeddedNatsCluster | None = None
    try:
        nats = _start_nats(nats_plan, secure)
    except NatsServerError as exc:
        print(f"llmgw up: cannot start the embedded NATS server: {exc}", file=sys.stderr)
        if secure is not None:
            secure.cleanup()
        admin_token.cleanup()
        return 1
    if nats is not None:
        env.update(nats_plan.child_env(nats.url))
    try:
        children_config = _as_children_see_it(config, nats_plan)
        if secure is not None:
            children_config = secure.as_role(children_config, "keys")
        dev_key = _dev_key(children_config, nats, args)
        if dev_key is None and config.auth.mode == "keys":
            return 1
        spec_env = dict(secure.spec_env(specs)) if secure is not None else {}
        edge_spec_env = {**spec_env.get("edge", {}), **edge_env(config)}
        if secure is not None:  # the config file says colocated; the edge must not decide here
            edge_spec_env["LLMGW_ADMISSION__COLOCATED"] = "false"
        spec_env["edge"] = edge_spec_env
        reload_config = (
            children_config if secure is None else secure.as_role(children_config, "fleet")
        )
        return asyncio.run(
            _supervise(
                specs,
                env,
                config,
                args,
                nats,
                dev_key,
                spec_env,
                (config_path, reload_config),
                admin_token.announcement,
            )
        )
    finally:
        if secure is not None:
            secure.cleanup()
        admin_token.cleanup()
        if nats is not None:
            # Stop NATS last and let a second Ctrl-C not interrupt it half-way.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                nats.stop()
                print("[nats] stopped", flush=True)
            finally:
                signal.signal(signal.SIGINT, previous)


def _separate_admission(config: Config) -> Config:
    """`--secure` runs admission as a process of its own role: an edge's own instance would
    connect as the edge role, which may not write the routing bucket (docs/keys.md)."""
    print(
        "llmgw up: --secure runs admission as a separate process (its own NATS user); "
        "admission.colocated is off for this run",
        flush=True,
    )
    admission = config.admission.model_copy(update={"colocated": False})
    return config.model_copy(update={"admission": admission})


def _as_children_see_it(config: Config, plan: NatsPlan) -> Config:
    """The config with the bucket replicas the children get (a cluster's), so the key bucket
    `llmgw up` creates is the one they open."""
    if not plan.is_cluster:
        return config
    nats = config.nats.model_copy(update={"replicas": plan.replicas})
    return config.model_copy(update={"nats": nats})


def _dev_key(
    config: Config, nats: EmbeddedNats | EmbeddedNatsCluster | None, args: argparse.Namespace
) -> str | None:
    """The development key's secret (auth.mode keys), None if it could not be stored."""
    if config.auth.mode != "keys":
        print(
            "llmgw up: warning: auth.mode is none: every caller is accepted and may choose its "
            "band (docs/keys.md)",
            flush=True,
        )
        return ""
    url = nats.url if nats is not None else config.nats.url
    try:
        return asyncio.run(create_dev_key(config, url, getattr(args, "dev_key", None)))
    except Exception as exc:
        print(f"llmgw up: cannot store the development key: {exc}", file=sys.stderr)
        return None


def _prepare_secure(config: Config, plan: NatsPlan, passwords_file: str | None) -> SecureNats:
    """The users of `--secure`; prints where their passwords are (never the passwords)."""
    if not plan.embedded:
        raise PlanError(
            f"--secure starts the embedded NATS with one user per role; this config uses "
            f"{plan.url}: give that server the users of `llmgw config nats-auth` (docs/keys.md)"
        )
    secure = SecureNats.prepare(_as_children_see_it(config, plan), passwords_file)
    print(
        f"llmgw up: NATS requires a user per service role (--secure); passwords in "
        f"{secure.passwords_path}; a tool connects as one, e.g. LLMGW_NATS__USER=keys "
        "LLMGW_NATS__PASSWORD=<its keys entry> llmgw keys list",
        flush=True,
    )
    return secure


def _start_nats(
    plan: NatsPlan, secure: SecureNats | None = None
) -> EmbeddedNats | EmbeddedNatsCluster | None:
    """Start what `plan` embeds (nothing for external servers) and print where it runs."""
    if not plan.embedded:
        return None
    extra_args = secure.server_args if secure is not None else ()
    client_auth = secure.probe_auth if secure is not None else None
    if not plan.is_cluster:
        server = EmbeddedNats(
            port=plan.nodes[0].port,
            store_dir=plan.store_dir,
            server_name=CLUSTER_NAME,
            kill_with_parent=True,
            extra_args=extra_args,
            client_auth=client_auth,
        )
        server.start()
        version = ".".join(map(str, server.version or ()))
        print(
            f"[nats] nats-server {version} ready on {server.url} "
            f"(pid {server.pid}, store {server.store_dir})",
            flush=True,
        )
        return server
    cluster = EmbeddedNatsCluster(
        len(plan.nodes),
        port=plan.nodes[0].port,
        store_dir=plan.store_dir,
        name=CLUSTER_NAME,
        kill_with_parent=True,
        extra_args=extra_args,
        client_auth=client_auth,
    )
    cluster.start()
    version = ".".join(map(str, cluster.version or ()))
    for node in cluster.nodes:
        print(
            f"[{node_label(node.index)}] nats-server {version} {node.name} ready on {node.url} "
            f"(pid {node.pid}, store {node.store_dir})"
        )
    leader = cluster.meta_leader()
    print(
        f"[nats] JetStream cluster {CLUSTER_NAME} of {len(cluster.nodes)} ready on {cluster.url} "
        f"(meta leader {node_label(leader) if leader is not None else 'unknown'}; "
        f"bucket replicas: {plan.replicas})",
        flush=True,
    )
    return cluster


async def _supervise(
    specs: list[ServiceSpec],
    env: dict[str, str],
    config: Config,
    args: argparse.Namespace,
    nats: EmbeddedNats | EmbeddedNatsCluster | None,
    dev_key: str | None = None,
    spec_env: dict[str, Mapping[str, str]] | None = None,
    reload: tuple[str, Config] | None = None,
    admin_note: str | None = None,
) -> int:
    supervisor = ClusterSupervisor(
        specs,
        env,
        spec_env=spec_env,
        ready_timeout=float(getattr(args, "ready_timeout", None) or DEFAULT_READY_TIMEOUT_S),
        grace=float(getattr(args, "grace", None) or DEFAULT_GRACE_S),
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, supervisor.request_stop)
    reloader = None
    if reload is not None:  # SIGHUP: the config file applied to the cluster, no restart
        nats_url = nats.url if nats is not None else reload[1].nats.url
        reloader = Reloader(reload[0], reload[1], nats_url, supervisor.say)
        loop.add_signal_handler(signal.SIGHUP, reloader)
    keeper: asyncio.Task[None] | None = None
    if nats is not None:  # a server or node that exits is started again with its store
        say, fail = supervisor.say, supervisor.fail
        kept = (
            NatsKeeper(nats, say=say, on_give_up=fail)
            if isinstance(nats, EmbeddedNatsCluster)
            else NatsKeeper(
                OneServer(nats),
                say=say,
                on_give_up=fail,
                label=lambda _: "nats",
                back="with its store",
            )
        )
        keeper = asyncio.create_task(kept.run())

    def announce() -> None:
        edge_url = _connectable_url(supervisor.ready_url("edge") or _edge_url_from_config(config))
        admin = f"http://{_connectable(config.admin_host)}:{config.admin_port}"
        nats_url = nats.url if nats is not None else config.nats.url
        supervisor.say(f"llmgw up: edge {edge_url}, admin {admin}, NATS {nats_url}")
        key = f", API key {dev_key}" if dev_key else ""
        supervisor.say(f"llmgw is ready: OpenAI API at {edge_url}/v1{key} (Ctrl-C to stop)")
        if dev_key:
            supervisor.say(f"llmgw up: try it with  export OPENAI_API_KEY={dev_key}")
        if admin_note:
            supervisor.say(admin_note)

    try:
        code = await supervisor.run(on_ready=announce)
    finally:
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if reloader is not None:
            loop.remove_signal_handler(signal.SIGHUP)
            await reloader.stop()
    supervisor.say("llmgw up: stopped" if code == 0 else f"llmgw up: exiting with code {code}")
    return code


def _busy_ports(specs: list[ServiceSpec], nats: NatsPlan) -> list[str]:
    """Ports of the plan that something else already listens on (checked before any start)."""
    problems = []
    for index, node in enumerate(nats.nodes):
        if node.port and not port_is_free("127.0.0.1", node.port):
            what = "nats.embedded_port" + (f" + {index}, {node.name}" if index else "")
            problems.append(
                f"port 127.0.0.1:{node.port} ({what}) is already in use; "
                "is another `llmgw up` or nats-server running?"
            )
    for spec in specs:
        for address in spec.listens:
            if address.port and not port_is_free(address.host, address.port):
                problems.append(f"port {address} ({address.purpose}) is already in use")
    return problems


def _connectable(host: str) -> str:
    return "127.0.0.1" if host in _ANY_HOSTS else host


def _connectable_url(url: str) -> str:
    """The URL a local client can use ("http://0.0.0.0:8080/" -> "http://127.0.0.1:8080")."""
    parts = urlsplit(url)
    if parts.hostname in _ANY_HOSTS and parts.port is not None:
        url = parts._replace(netloc=f"127.0.0.1:{parts.port}").geturl()
    return url.rstrip("/")


def _edge_url_from_config(config: Config) -> str:
    return f"http://{_connectable(config.listen_host)}:{config.listen_port}"
