"""`llmgw spend`'s report over recorded totals: periods, grouping, our fleet's endpoint-hours."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import warnings
from pathlib import Path

import pytest
import yaml
from nats.aio.client import Client as NatsClient

from llmgw.config import ConfigWarning, config_from_dict
from llmgw.config.catalog import EndpointConfig
from llmgw.config.fleet import fleet_bucket
from llmgw.core.spend import PICOS, SpendTotals, TokenUse, fleet_cost, period_of, spend_key
from llmgw.fleet import FleetRecord
from llmgw.services.admission.spend import open_spend_bucket
from llmgw.services.spend.main import fleet_of, report, run
from llmgw.services.spend.report import record_of
from llmgw.state.fleet import open_fleet
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


async def test_the_fleets_hours_are_those_of_the_live_fleet_when_the_file_lists_no_endpoint(
    nats_client: NatsClient, nats_url: str, unique_id: str, tmp_path: Path, capsys
) -> None:
    """`endpoints: []`: the engines joined at run time (`llmgw endpoints add`, registration,
    discovery). `llmgw spend` counts the endpoint-hours of the live fleet, as admission runs
    on it, not the file's (none)."""
    data = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    data["nats"] = {"url": nats_url, "connect_timeout": "1s"}
    data["pinning"] = {"bucket": unique_id}
    data["router"] = {"load_bucket": f"load_{unique_id}"}
    data["spend"]["bucket"] = f"spend_{unique_id}"
    data["spend"]["prices"].append({"provider": "iris", "endpoint_hour": 2})
    data["endpoints"] = []
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(ConfigWarning):  # pairs no file endpoint serves: expected here
        config = config_from_dict(data, env={})
    fleet = await open_fleet(nats_client, config)
    spend = await open_spend_bucket(nats_client, config)
    try:
        for index in (1, 2):
            endpoint = {"id": f"engine-{index}", "url": f"http://127.0.0.1:{9000 + index}"}
            endpoint |= {"provider": "iris", "models": ["llama-3.3-70b"]}
            await fleet.add(FleetRecord(endpoint=EndpointConfig.model_validate(endpoint)))
        before = time.time()
        today = period_of(before)
        served = _report("e1", today, [(("k1", "a", "iris", "llama-3.3-70b"), 300, 100, 0)])
        await spend.put(spend_key(today, "e1"), served.model_dump_json().encode())
        args = argparse.Namespace(
            config=str(path), by="tenant,provider", period="day", since=None, until=None,
            json=True, port_offset=None,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            assert await asyncio.to_thread(run, args) == 0
        after = time.time()
        result = json.loads(capsys.readouterr().out)
        [day] = result["periods"]
        picos = sum(r["fleet_picos"] for r in day["rows"])
        rate = config.spend.endpoint_hours()["iris"]
        assert fleet_cost(rate, 2, before % 86_400) <= picos <= fleet_cost(rate, 2, after % 86_400)
    finally:
        for bucket in (fleet_bucket(config), config.spend.bucket):
            with contextlib.suppress(Exception):
                await nats_client.jetstream().delete_key_value(bucket)
