"""`llmgw spend`: what the gateway's traffic cost, from the spend bucket (docs/spend.md).

    llmgw spend                               # this month, by tenant and provider
    llmgw spend --period day --since 2026-12-01 --by tenant,provider,model
    llmgw spend --period total --by key --json

Rows are summed over every edge's daily totals (services/admission/spend.py), to the pico;
amounts are shown rounded half up to the cent (``--json`` also gives the exact picos).

Exit codes: 0 printed; 1 NATS unreachable; 2 bad arguments or config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from llmgw import natsconn
from llmgw.config import Config
from llmgw.core.spend import (
    SpendTotals,
    fleet_cost,
    format_money,
    period_of,
    spread_fleet_cost,
)
from llmgw.runtime import load_tool_config
from llmgw.services.spend.options import BY_FIELDS
from llmgw.services.spend.report import SpendRecord, open_spend_reader, read_spend
from llmgw.state.fleet import read_live_config

__all__ = ["report", "run"]

_DAY = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    by = tuple(f.strip() for f in str(args.by).split(",") if f.strip())
    bad = [f for f in by if f not in BY_FIELDS]
    if bad or not by:
        print(f"llmgw spend: --by: expected some of {', '.join(BY_FIELDS)}", file=sys.stderr)
        return 2
    for name in ("since", "until"):
        value = getattr(args, name)
        if value is not None and not _DAY.match(value):
            print(f"llmgw spend: --{name}: expected YYYY-MM-DD or YYYY-MM", file=sys.stderr)
            return 2
    refusals = natsconn.Refusals()
    try:
        record, live = asyncio.run(_read(config, refusals))
    except natsconn.UNREACHABLE as exc:
        return refusals.report("spend", exc, f"cannot read from NATS at {config.nats.url}")
    now = time.time()
    result = report(
        record,
        period=args.period,
        by=by,
        since=args.since,
        until=args.until or period_of(now),
        currency=config.spend.currency,
        fleet=fleet_of(live, now),
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(format_report(result))
    return 0


async def _read(config: Config, refusals: natsconn.Refusals) -> tuple[SpendRecord, Config]:
    """The spend record, and the config the services run on (the live fleet's endpoints: with
    `endpoints: []` the file lists none), read only when an endpoint-hour prices the fleet."""
    nc = await natsconn.connect_tool(config.nats, "llmgw-spend", refusals)
    try:
        bucket = await open_spend_reader(nc.jetstream(), config.spend.bucket)
        record = SpendRecord() if bucket is None else await read_spend(bucket)
        live = await read_live_config(nc, config) if config.spend.endpoint_hours() else config
        return record, live
    finally:
        await nc.close()


def fleet_of(config: Config, now: float) -> Callable[[str], dict[str, int]]:
    """Per UTC day: picos of each provider with an endpoint-hour price (spend.prices), for the
    endpoints `config` lists (the live fleet's, `_read`) over the day (today: so far)."""
    rates = config.spend.endpoint_hours()
    counts = {p: sum(e.provider == p for e in config.endpoints) for p in rates}
    today = period_of(now)
    elapsed = now % 86_400

    def of_day(day: str) -> dict[str, int]:
        seconds = 86_400.0 if day < today else elapsed if day == today else 0.0
        return {p: fleet_cost(rate, counts[p], seconds) for p, rate in rates.items()}

    return of_day


def report(
    record: SpendRecord,
    *,
    period: str,
    by: tuple[str, ...],
    since: str | None,
    until: str,
    currency: str,
    fleet: Callable[[str], dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The report as data: periods, each with rows grouped `by`, and the grand total. `fleet`:
    our engines' cost per day and provider, spread over the tokens each row was served."""
    periods: dict[str, SpendTotals] = {}
    for day, recorded in sorted(record.days.items()):
        if since is not None and day[: len(since)] < since:
            continue
        if day[: len(until)] > until:
            continue
        totals = recorded
        if fleet is not None and (costs := fleet(day)):
            totals = SpendTotals()
            totals.merge(recorded)
            for where, share in spread_fleet_cost(totals, costs).items():
                totals.rows[where].picos += share
                totals.rows[where].fleet += share
        name = {"day": day, "month": day[:7], "total": "total"}[period]
        periods.setdefault(name, SpendTotals()).merge(totals)
    grand = 0
    out = []
    for name, totals in periods.items():
        rows = []
        for group, row in sorted(totals.grouped(*by).items(), key=lambda kv: -kv[1].picos):
            rows.append(
                {
                    **{f: (v or None) for f, v in zip(by, group, strict=True)},
                    "requests": row.requests,
                    "input_tokens": row.input,
                    "cached_input_tokens": row.cached,
                    "output_tokens": row.output,
                    "cost": format_money(row.picos, 6),
                    "picos": row.picos,
                    "fleet_picos": row.fleet,
                }
            )
        grand += totals.picos
        out.append(
            {
                "period": name,
                "cost": format_money(totals.picos, 6),
                "picos": totals.picos,
                "rows": rows,
            }
        )
    currencies = sorted(record.currencies) or [currency]
    return {
        "currency": currencies[0] if len(currencies) == 1 else currencies,
        "edges": len(record.edges),
        "by": list(by),
        "periods": out,
        "total": {"cost": format_money(grand, 6), "picos": grand},
    }


def format_report(result: dict[str, Any]) -> str:
    currency = result["currency"]
    by = result["by"]
    lines = [f"spend in {currency}, from {result['edges']} edges' totals"]
    widths = {f: 16 for f in by}
    for period in result["periods"]:
        lines.append("")
        lines.append(f"{period['period']}: {_cents(period['picos'])} {currency}")
        head = "  ".join(f"{f.upper():{widths[f]}}" for f in by)
        lines.append(
            f"  {head}  {'REQUESTS':>9}  {'INPUT':>11}  {'CACHED':>10}  {'OUTPUT':>10}  {'COST':>12}"
        )
        for row in period["rows"]:
            cells = "  ".join(f"{(row[f] or '-'):{widths[f]}}" for f in by)
            lines.append(
                f"  {cells}  {row['requests']:>9}  {row['input_tokens']:>11}  "
                f"{row['cached_input_tokens']:>10}  {row['output_tokens']:>10}  "
                f"{_cents(row['picos']):>12}"
            )
    lines.append("")
    lines.append(f"total: {_cents(result['total']['picos'])} {currency}")
    return "\n".join(lines)


def _cents(picos: int) -> str:
    return format_money(picos, 2)
