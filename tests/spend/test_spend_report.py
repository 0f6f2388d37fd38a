"""`llmgw spend`'s report over recorded totals: periods, grouping, our fleet's endpoint-hours."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmgw.config import config_from_dict
from llmgw.core.spend import PICOS, SpendTotals, TokenUse
from llmgw.services.spend.main import fleet_of, report
from llmgw.services.spend.report import record_of
from llmgw.wire import SpendTotalsReport

REPO = Path(__file__).resolve().parents[2]
DAY = 1_796_256_000.0  # 2026-12-03T00:00:00Z


def _report(edge: str, day: str, rows: list[tuple[tuple[str, str, str, str], int, int, int]]):
    totals = SpendTotals()
    for where, n_in, out, picos in rows:
        totals.add(where, TokenUse(input=n_in, output=out), picos)
    return SpendTotalsReport(edge=edge, day=day, currency="USD", rows=totals.to_wire())


def test_the_report_sums_edges_and_days_and_spreads_our_fleets_hours_over_its_tokens():
    data = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    data["spend"]["prices"].append({"provider": "iris", "endpoint_hour": 2})
    config = config_from_dict(data, env={})
    reports = [
        _report("e1", "2026-12-02", [(("k1", "a", "iris", "m"), 300, 100, 0)]),
        _report(
            "e2",
            "2026-12-02",
            [
                (("k2", "b", "iris", "m"), 100, 100, 0),
                (("k2", "b", "tensorx", "m"), 10, 10, 5 * PICOS),
            ],
        ),
        _report("e1", "2026-12-03", [(("k1", "a", "iris", "m"), 50, 50, 0)]),
    ]
    # One entry per edge and day, as the bucket holds them.
    record = record_of(r.model_dump_json().encode() for r in reports)
    now = DAY + 6 * 3600  # 06:00 on 2026-12-03
    result = report(
        record,
        period="day",
        by=("tenant", "provider"),
        since=None,
        until="2026-12-03",
        currency="USD",
        fleet=fleet_of(config, now),
    )
    days = {p["period"]: p for p in result["periods"]}
    # 2026-12-02: 2 engines x 24 h x $2 = $96, spread by tokens served: a 400, b 200.
    ours = {r["tenant"]: r for r in days["2026-12-02"]["rows"] if r["provider"] == "iris"}
    assert {t: r["fleet_picos"] for t, r in ours.items()} == {"a": 64 * PICOS, "b": 32 * PICOS}
    assert days["2026-12-02"]["picos"] == 101 * PICOS  # and b's $5 on the third party
    # today so far: 6 h x 2 x $2 = $24
    assert days["2026-12-03"]["picos"] == 24 * PICOS
    assert result["total"]["cost"] == "125.000000" and result["edges"] == 2
