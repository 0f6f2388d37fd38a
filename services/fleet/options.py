"""`llmgw endpoints` options (argparse only: building the CLI's parser imports no NATS client)."""

from __future__ import annotations

import argparse

__all__ = ["add_endpoints_arguments", "add_register_arguments"]


def _admin_url_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin-url",
        default=None,
        metavar="URL",
        help="call this admin port's API (e.g. http://127.0.0.1:9090) instead of NATS, with the "
        "admin token (LLMGW_AUTH__ADMIN_TOKEN_FILE, auth.admin_token_file or "
        "LLMGW_AUTH__ADMIN_TOKEN; `llmgw up` prints where its token is)",
    )


def add_endpoints_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    _admin_url_arg(parser)
    sub = parser.add_subparsers(dest="endpoints_command", required=True, metavar="ACTION")
    sub.add_parser("list", help="every endpoint: state, provider, url, models, leases")
    show = sub.add_parser("show", help="one endpoint")
    show.add_argument("id")
    add = sub.add_parser("add", help="add an endpoint; it takes work at once")
    add.add_argument("id")
    _spec_args(add, creating=True)
    update = sub.add_parser("update", help="change an endpoint (only the options given)")
    update.add_argument("id")
    _spec_args(update, creating=False)
    drain = sub.add_parser(
        "drain", help="no new work; running requests finish, pinned sessions move"
    )
    drain.add_argument("id")
    undrain = sub.add_parser("undrain", help="take new work again")
    undrain.add_argument("id")
    remove = sub.add_parser("remove", help="remove a drained endpoint once its requests ended")
    remove.add_argument("id")
    remove.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wait this long for its running requests to end (default: fleet.drain_timeout)",
    )
    remove.add_argument(
        "--force", action="store_true", help="remove now, drained or not (leases still end)"
    )


def _spec_args(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    parser.add_argument("--url", required=creating, help="base URL, e.g. http://10.0.0.7:8000")
    parser.add_argument("--provider", required=creating, help="the provider it belongs to")
    parser.add_argument(
        "--models",
        help="comma-separated model names (default: what the engine's /v1/models serves, "
        "matched against the config's models and aliases, and followed as it changes: "
        "fleet.models_refresh)",
    )
    parser.add_argument("--pool", help="its pool (default: default)")
    parser.add_argument("--weight", type=int, help="relative weight (default 100)")
    parser.add_argument("--priority", type=int, help="endpoint priority (default 100)")
    parser.add_argument("--capacity", type=int, help="batch slots (default: learned)")
    parser.add_argument(
        "--context-window",
        type=int,
        help="its context window in tokens (default: what its engine reports)",
    )
    parser.add_argument(
        "--upstream-model",
        action="append",
        default=[],
        metavar="MODEL=NAME",
        help="the name the engine serves MODEL under",
    )
    parser.add_argument("--no-probe", action="store_true", help="do not check that the URL answers")


def add_register_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="the endpoint's id (a slug)")
    _spec_args(parser, creating=True)
    parser.add_argument(
        "--ttl",
        type=float,
        required=True,
        metavar="SECONDS",
        help="drained when silent this long, removed after twice as long (heartbeat: ttl/3)",
    )
    parser.add_argument(
        "--once", action="store_true", help="register and exit (heartbeat by HTTP yourself)"
    )
    _admin_url_arg(parser)
