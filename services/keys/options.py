"""`llmgw keys` options (argparse only: building the CLI's parser imports no NATS client)."""

from __future__ import annotations

import argparse

__all__ = ["add_keys_arguments"]


def add_keys_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a key; prints its secret once")
    _spec_args(create, creating=True)
    sub.add_parser("list", help="every key: id, prefix, tenant, models, limits")
    show = sub.add_parser("show", help="one key")
    show.add_argument("id")
    update = sub.add_parser("update", help="change a key (only the options given)")
    update.add_argument("id")
    _spec_args(update, creating=False)
    update.add_argument("--enabled", action="store_true", default=None, help="enable the key")
    revoke = sub.add_parser("revoke", help="delete a key (every edge refuses it within 1 s)")
    revoke.add_argument("id")
    seed = sub.add_parser("seed", help="create or update the keys listed in a YAML file")
    seed.add_argument("file")
    usage = sub.add_parser(
        "usage", help="requests and tokens per key in the current minute, from every edge"
    )
    usage.add_argument(
        "--listen",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long to listen to the edges' usage reports (default 1.5 s: every edge "
        "repeats its totals at least every second)",
    )


def _spec_args(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    parser.add_argument("--tenant", required=creating, help="fair-queueing tenant of the key")
    parser.add_argument("--models", help="comma-separated names, aliases or globs (default *)")
    parser.add_argument("--bands", help="comma-separated bands it may use (default: all)")
    parser.add_argument("--default-band", help="its band when it names none it may use")
    parser.add_argument(
        "--band-header",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="may the band header choose among its bands (default: no)",
    )
    parser.add_argument("--max-parallel", type=int, help="requests at once, all edges together")
    parser.add_argument("--rpm", type=int, help="requests per minute, all edges together")
    parser.add_argument("--tpm", type=int, help="tokens per minute, all edges together")
    parser.add_argument(
        "--budget-period",
        choices=("daily", "monthly", "total", "none"),
        help="the period of the key's budget (none removes the budget's period)",
    )
    parser.add_argument(
        "--max-spend", help="most the key may spend in its period, in spend.currency ('none')"
    )
    parser.add_argument(
        "--max-overflow-spend",
        help="most it may spend on third parties in its period, in spend.currency ('none')",
    )
    parser.add_argument("--expires", help="lifetime from now (30d, 12h) or unix seconds; 'never'")
    parser.add_argument("--label", action="append", default=[], metavar="K=V")
    parser.add_argument("--disabled", action="store_true", default=None, help="disable the key")
