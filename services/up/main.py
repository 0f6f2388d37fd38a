"""`llmgw up`: the whole gateway on one machine, from one config file.

Starts an embedded NATS server (when `nats.url` is "embedded"), then the
simulators of every endpoint with a `simulate` block, the admission service and
the edge, each as a child process (`python -m llmgw ...`) reading the same config.
Children get the embedded server's URL through `LLMGW_NATS__URL`.

Exit codes: 0 after Ctrl-C/SIGTERM, 1 when the cluster cannot start or a child
crash-loops (see `restart.py`), 2 for config errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from urllib.parse import urlsplit

from llmgw.config import Config
from llmgw.nats_embedded import EmbeddedNats, NatsServerError, port_is_free
from llmgw.runtime import load_or_exit
from llmgw.services.up.plan import ServiceSpec, duplicate_listens, format_plan, plan_cluster
from llmgw.services.up.supervisor import ClusterSupervisor

DEFAULT_CONFIG = "config/local.yaml"
DEFAULT_READY_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 10.0
_ANY_HOSTS = {"", "0.0.0.0", "::"}


def run(args: argparse.Namespace) -> int:
    config_path = str(getattr(args, "config", None) or DEFAULT_CONFIG)
    config = load_or_exit(config_path)
    specs = plan_cluster(config, config_path)
    embedded = config.nats.is_embedded

    if getattr(args, "dry_run", False):
        print(format_plan(specs, _nats_plan_line(config, embedded)))
        return 0

    problems = duplicate_listens(specs) + _busy_ports(specs, config, embedded)
    if problems:
        for problem in problems:
            print(f"llmgw up: {problem}", file=sys.stderr)
        print("llmgw up: nothing was started", file=sys.stderr)
        return 1

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # children's lines (and ready lines) arrive as printed
    nats: EmbeddedNats | None = None
    if embedded:
        nats = EmbeddedNats(
            port=config.nats.embedded_port,
            store_dir=config.nats.store_dir,
            server_name="llmgw-up",
            kill_with_parent=True,
        )
        try:
            nats.start()
        except NatsServerError as exc:
            print(f"llmgw up: cannot start the embedded NATS server: {exc}", file=sys.stderr)
            return 1
        env["LLMGW_NATS__URL"] = nats.url
        version = ".".join(map(str, nats.version or ()))
        print(
            f"[nats] nats-server {version} ready on {nats.url} (pid {nats.pid}, store {nats.store_dir})"
        )
        sys.stdout.flush()
    try:
        return asyncio.run(_supervise(specs, env, config, args, nats))
    finally:
        if nats is not None:
            # Stop NATS last and let a second Ctrl-C not interrupt it half-way.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                nats.stop()
                print("[nats] stopped", flush=True)
            finally:
                signal.signal(signal.SIGINT, previous)


async def _supervise(
    specs: list[ServiceSpec],
    env: dict[str, str],
    config: Config,
    args: argparse.Namespace,
    nats: EmbeddedNats | None,
) -> int:
    supervisor = ClusterSupervisor(
        specs,
        env,
        ready_timeout=float(getattr(args, "ready_timeout", None) or DEFAULT_READY_TIMEOUT_S),
        grace=float(getattr(args, "grace", None) or DEFAULT_GRACE_S),
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, supervisor.request_stop)

    def announce() -> None:
        edge_url = _connectable_url(supervisor.ready_url("edge") or _edge_url_from_config(config))
        admin = f"http://{_connectable(config.admin_host)}:{config.admin_port}"
        nats_url = nats.url if nats is not None else config.nats.url
        supervisor.say(f"llmgw up: edge {edge_url}, admin {admin}, NATS {nats_url}")
        supervisor.say(f"llmgw is ready: OpenAI API at {edge_url}/v1 (Ctrl-C to stop)")

    try:
        code = await supervisor.run(on_ready=announce)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    supervisor.say("llmgw up: stopped" if code == 0 else f"llmgw up: exiting with code {code}")
    return code


def _busy_ports(specs: list[ServiceSpec], config: Config, embedded: bool) -> list[str]:
    """Ports of the plan that something else already listens on (checked before any start)."""
    problems = []
    nats_port = config.nats.embedded_port if embedded else 0
    if nats_port and not port_is_free("127.0.0.1", nats_port):
        problems.append(
            f"port 127.0.0.1:{nats_port} (nats.embedded_port) is already in use; "
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


def _nats_plan_line(config: Config, embedded: bool) -> str:
    nats = config.nats
    if not embedded:
        return f"{'nats':<16} external {nats.url}"
    port = nats.embedded_port or "a free port"
    store = nats.store_dir or "a temporary directory"
    return f"{'nats':<16} embedded nats-server on 127.0.0.1:{port} (JetStream store: {store})"
