"""The `llmgw` command line: one console script, one subcommand per service.

Each subcommand imports its service lazily, so `llmgw config check` does not
pay for FastAPI and `llmgw edge` does not pay for the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

DEFAULT_CONFIG = "config/local.yaml"


def _config_arg(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    parser.add_argument(
        "--config",
        "-c",
        default=None if required else DEFAULT_CONFIG,
        required=required,
        help=f"path to the YAML config (default: {DEFAULT_CONFIG})",
    )


def _port_offset_arg(parser: argparse.ArgumentParser) -> None:
    """For the tools that dial the cluster: find one `llmgw up --port-offset N` started."""
    parser.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="N",
        help="the cluster was started with `llmgw up --port-offset N`: its embedded NATS port "
        "is nats.embedded_port + N",
    )


def _sim_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", default=None, help="take the endpoint's `simulate` block from this config"
    )
    parser.add_argument("--endpoint", default=None, help="endpoint id in --config to simulate")
    parser.add_argument(
        "--host", default=None, help="listen host (default 127.0.0.1 or the endpoint's url)"
    )
    parser.add_argument(
        "--port", type=int, default=None, help="listen port (default 8000 or the endpoint's url)"
    )
    parser.add_argument(
        "--model", action="append", default=None, help="served model name (repeatable)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the simulator's randomness")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one simulator parameter, e.g. --set max_num_seqs=8 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw", description="LLM inference routing gateway")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run a local cluster: embedded NATS, services and simulators")
    _config_arg(up)
    up.add_argument(
        "--dry-run", action="store_true", help="print the processes it would start and exit"
    )
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=None,
        metavar="N",
        help="run the embedded NATS as a JetStream cluster of N servers (1, or 3 or more); "
        "buckets get 3 replicas (overrides nats.embedded_cluster)",
    )
    up.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="N",
        help="move every local port (edge, admin, NATS, simulated endpoints) by N: a second "
        "cluster from the same config",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        help="seconds each service may take to get ready",
    )
    up.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping",
    )
    up.add_argument(
        "--dev-key",
        default=None,
        metavar="SECRET",
        help="the development key's secret (auth.mode keys; default: a new random key per run)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="start the embedded NATS with one user per service role and least-privilege "
        "permissions (docs/keys.md); each service connects as its role",
    )
    up.add_argument(
        "--nats-passwords",
        default=None,
        metavar="FILE",
        help="with --secure: the roles' passwords (YAML role: password), created with random "
        "ones if missing; default: random per start, in a temporary file",
    )
    up.set_defaults(target="llmgw.services.up.main:run")

    edge = sub.add_parser("edge", help="the OpenAI-compatible HTTP edge")
    _config_arg(edge)
    edge.add_argument("--listen", default=None, help="override `listen` (host:port)")
    edge.add_argument("--admin-listen", default=None, help="override `admin_listen` (host:port)")
    edge.add_argument(
        "--admission-instance",
        default=None,
        help="with admission.colocated: the name of the edge's admission instance (llmgw up)",
    )
    edge.add_argument(
        "--supersedes",
        default=None,
        metavar="INSTANCE",
        help="with admission.colocated: an admission instance whose process has exited (llmgw "
        "up restarting the edge); its shards are taken over at once instead of after member_ttl",
    )
    edge.set_defaults(target="llmgw.services.edge.main:run")

    admission = sub.add_parser("admission", help="the admission service (NATS queue group)")
    _config_arg(admission)
    admission.add_argument(
        "--admin-listen", default=None, help="serve /metrics and /health on host:port"
    )
    admission.add_argument(
        "--instance-name",
        default=None,
        metavar="NAME",
        help="a stable name from the deployment (a StatefulSet pod's name; overrides "
        "admission.instance_name): restarted under it, the instance takes its earlier "
        "incarnation's shards and quota over within seconds; refuses to start while another "
        "process runs under it",
    )
    admission.add_argument(
        "--instance",
        default=None,
        metavar="ID",
        help="this process's instance id (llmgw up; default: one made per start)",
    )
    admission.add_argument(
        "--supersedes",
        default=None,
        metavar="INSTANCE",
        help="an admission instance whose process has exited (llmgw up restarting admission); "
        "its shards and quota are taken over at once instead of after member_ttl",
    )
    admission.set_defaults(target="llmgw.services.admission.main:run")

    reaper = sub.add_parser(
        "reaper",
        help="clears what dead admission instances left (member keys, unadopted quota), drains "
        "silent registered engines, follows engines' model lists and Kubernetes discovery",
    )
    _config_arg(reaper)
    reaper.add_argument(
        "--admin-listen", default=None, help="serve /metrics and /health on host:port"
    )
    reaper.set_defaults(target="llmgw.services.reaper.main:run")

    scraper = sub.add_parser("scraper", help="scrapes managed endpoints, publishes their load")
    _config_arg(scraper)
    scraper.add_argument(
        "--admin-listen", default=None, help="serve /metrics and /health on host:port"
    )
    scraper.set_defaults(target="llmgw.services.scraper.main:run")

    state = sub.add_parser("state", help="pins, leases and capacity use, read from the live bucket")
    _config_arg(state)
    _port_offset_arg(state)
    state.add_argument("--json", action="store_true", help="machine-readable output")
    state.add_argument("--pins", action="store_true", help="also list every pin")
    state.add_argument(
        "--session",
        default=None,
        metavar="KEY",
        help="list only the pins of this session key (the session header's value or `user`) and of "
        "its sub-agents",
    )
    state.set_defaults(target="llmgw.services.state.main:run")

    spend = sub.add_parser(
        "spend", help="what the traffic cost, by period, tenant, provider, model or key"
    )
    _config_arg(spend)
    _port_offset_arg(spend)
    from llmgw.services.spend.options import add_spend_arguments  # argparse only

    add_spend_arguments(spend)
    spend.set_defaults(target="llmgw.services.spend.main:run")

    keys = sub.add_parser(
        "keys", help="API keys in the live key bucket: create, list, show, update, revoke, seed"
    )
    _config_arg(keys)
    _port_offset_arg(keys)
    from llmgw.services.keys.options import add_keys_arguments  # argparse only

    add_keys_arguments(keys)
    keys.set_defaults(target="llmgw.services.keys.main:run")
    endpoints = sub.add_parser(
        "endpoints",
        help="the live fleet's endpoints: list, show, add, update, drain, undrain, remove",
    )
    _config_arg(endpoints)
    _port_offset_arg(endpoints)
    from llmgw.services.fleet.options import (  # argparse only
        add_endpoints_arguments,
        add_register_arguments,
    )

    add_endpoints_arguments(endpoints)
    endpoints.set_defaults(target="llmgw.services.fleet.main:run")
    register = sub.add_parser(
        "register", help="an engine announces itself to the live fleet and heartbeats"
    )
    _config_arg(register)
    _port_offset_arg(register)
    add_register_arguments(register)
    register.set_defaults(target="llmgw.services.fleet.register:run")
    events = sub.add_parser("events", help="print the events kept in the events stream")
    _config_arg(events)
    _port_offset_arg(events)
    events.add_argument(
        "--since", default=None, help="only events from this long ago (10m, 1h); default: all kept"
    )
    events.add_argument("--follow", "-f", action="store_true", help="then wait for new ones")
    events.add_argument(
        "--subject",
        default="llmgw.v1.events.>",
        help="a subject filter (default: llmgw.v1.events.>); a bare 'pin.>' is prefixed",
    )
    events.add_argument("--json", action="store_true", help="payloads only, one per line")
    events.set_defaults(target="llmgw.services.events.main:run")

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_sub.add_parser(
        "check", help="validate a config file and print the effective config"
    )
    check.add_argument("file", help="path to the YAML config")
    check.set_defaults(target="llmgw.config.check:run")
    apply = config_sub.add_parser(
        "apply",
        help="validate a config file and apply it to the running cluster, no restart "
        "(what changes live: docs/config.md)",
    )
    apply.add_argument("file", help="path to the YAML config (also names the cluster's NATS)")
    _port_offset_arg(apply)
    apply.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for every admission instance to run on it (default 10)",
    )
    apply.set_defaults(target="llmgw.services.fleet.apply:run")
    nats_auth = config_sub.add_parser(
        "nats-auth",
        help="print the nats-server authorization block (one user per service role) for a config",
    )
    nats_auth.add_argument("file", help="path to the YAML config (bucket and stream names)")
    nats_auth.add_argument(
        "--helm", action="store_true", help="as values of the official NATS Helm chart"
    )
    nats_auth.set_defaults(target="llmgw.nats_auth:run")

    sim = sub.add_parser("sim", help="simulated engines and third-party providers")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True, metavar="KIND")
    engine = sim_sub.add_parser("engine", help="a vLLM-like engine (batching, KV and prefix cache)")
    _sim_args(engine)
    from llmgw.config.simulate import METRICS_DIALECTS  # pydantic only, no server

    engine.add_argument(
        "--metrics-dialect",
        choices=METRICS_DIALECTS,
        default=None,
        help="whose metric names GET /metrics speaks (default vllm, or the endpoint's "
        "simulate block); same as --set metrics_dialect=...",
    )
    engine.set_defaults(target="llmgw.services.sim.main:run_engine")
    provider = sim_sub.add_parser(
        "provider", help="a third-party-API-like server (drifting rate, 429s)"
    )
    _sim_args(provider)
    provider.set_defaults(target="llmgw.services.sim.main:run_provider")

    bench = sub.add_parser(
        "bench",
        help="load generator for any OpenAI-compatible URL (a gateway or an engine)",
        description="Load an OpenAI-compatible URL and report throughput, latency, TTFT, TPOT "
        "and errors; --sweep finds an engine's saturation knee.",
    )
    from llmgw.services.bench.options import add_bench_arguments  # argparse only, no aiohttp

    add_bench_arguments(bench)
    bench.set_defaults(target="llmgw.services.bench.main:run")

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, _, func_name = args.target.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`llmgw state --json | head`): not an error worth a traceback.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
