"""`llmgw spend`'s arguments (argparse only: the parser imports nothing heavier)."""

from __future__ import annotations

import argparse

BY_FIELDS = ("key", "tenant", "provider", "model")


def add_spend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--period",
        choices=("day", "month", "total"),
        default="month",
        help="one row group per UTC day, per month, or one for everything (default: month)",
    )
    parser.add_argument(
        "--since", default=None, help="first day or month (YYYY-MM-DD or YYYY-MM; default: all)"
    )
    parser.add_argument("--until", default=None, help="last day or month (default: today)")
    parser.add_argument(
        "--by",
        default="tenant,provider",
        help=f"group rows by some of {', '.join(BY_FIELDS)} (default: tenant,provider)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
