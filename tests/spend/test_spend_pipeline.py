"""Spend from the edge's book to the bucket on a real nats-server: an edge's totals per UTC day
(totals, not deltas), written down by admission instances in one queue group, one entry per edge
and day, read back by `llmgw spend`'s reader; the day turns on the edge's clock."""

from __future__ import annotations

import uuid
from pathlib import Path

import nats
import pytest
import yaml
from timing import SteppedClock, eventually

from llmgw.config import config_from_dict
from llmgw.core.usage import Usage
from llmgw.services.admission.spend import SpendRecorder, open_spend_bucket
from llmgw.services.edge.spend import SpendBook
from llmgw.services.spend.report import read_spend

REPO = Path(__file__).resolve().parents[2]
DAY = 1_796_256_000.0  # 2026-12-03T00:00:00Z


@pytest.fixture
async def pipeline(nats_url: str):
    data = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    data["nats"] = {"url": nats_url}
    data["spend"]["bucket"] = f"spend_{uuid.uuid4().hex[:10]}"
    data["spend"]["interval"] = "50ms"
    config = config_from_dict(data, env={})
    connections, recorders = [], []
    for _ in range(2):  # two admission instances: each message is written by one of them
        nc = await nats.connect(nats_url)
        recorder = SpendRecorder(nc, await open_spend_bucket(nc, config))
        await recorder.start()
        connections.append(nc)
        recorders.append(recorder)
    edge_nc = await nats.connect(nats_url)
    try:
        yield config, edge_nc, recorders
    finally:
        for recorder in recorders:
            await recorder.stop()
        await connections[0].jetstream().delete_key_value(config.spend.bucket)
        for nc in (*connections, edge_nc):
            await nc.close()


async def test_an_edges_daily_totals_reach_the_bucket_once_per_edge_and_day(pipeline) -> None:
    config, edge_nc, recorders = pipeline
    clock = SteppedClock(DAY - 60)  # a minute before midnight
    book = SpendBook(edge_nc, "edge-a", config, clock=clock)
    await book.start()
    try:
        for _ in range(3):
            book.attempt_ended(
                key="k1",
                tenant="team-a",
                provider="tensorx",
                model="llama-3.3-70b",
                usage=Usage(1000, 500, 200),
            )
        clock.now = DAY + 60  # past midnight: a new day's totals
        book.attempt_ended(
            key="k1", tenant="team-a", provider="iris", model="llama-3.3-70b", usage=Usage(7, 3)
        )
        bucket = await open_spend_bucket(edge_nc, config)

        async def both_days() -> bool:
            record = await read_spend(bucket)
            return set(record.days) == {"2026-12-02", "2026-12-03"}

        await eventually(both_days)
    finally:
        await book.stop()
    record = await read_spend(bucket)
    before = record.days["2026-12-02"]
    (row,) = before.rows.values()
    # 3 x (800 uncached x 0.60 + 200 cached x 0.30 + 500 x 2.40) per million = $0.00522
    assert (row.requests, row.input, row.cached, row.output) == (3, 3000, 600, 1500)
    assert row.picos == 3 * (800 * 600_000 + 200 * 300_000 + 500 * 2_400_000)
    (today,) = record.days["2026-12-03"].rows.items()
    assert today[0] == ("k1", "team-a", "iris", "llama-3.3-70b") and today[1].picos == 0
    entries = await bucket.list("spend.")
    assert sorted(e.key for e in entries) == [
        "spend.2026-12-02.edge-a",
        "spend.2026-12-03.edge-a",
    ]
    # Totals, not deltas: a repeated message rewrites the same entry, never adds to it.
    assert sum(r.written for r in recorders) >= 2
