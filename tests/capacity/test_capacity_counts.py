"""The per-request NATS traffic that docs/capacity.md's sizing uses, counted on a real run.

benchmarks/capacity.py holds the model (`PER_REQUEST`, `PER_NEW_SESSION`) and the counting
harness: real processes (nats-server, a zero-delay engine, a scraper, two admission instances,
an edge) and a subscriber on every subject of the server. The counts must be what the model
says (the load gossip at most its bound, and present: two instances run), and the document must
show the model's table and the estimate the model computes. Counts, not times.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _capacity():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "llmgw_benchmarks_capacity", REPO / "benchmarks" / "capacity.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


capacity = _capacity()

REQUESTS = 120
SESSIONS = 12


@pytest.fixture(scope="module")
def counted():
    return capacity.count(REQUESTS, SESSIONS, admissions=2)


def test_each_request_costs_the_messages_the_model_counts(counted):
    for name in ("admission.request", "admission.reply", "stats.request"):
        assert counted.counts[name] == capacity.PER_REQUEST[name] * REQUESTS, (name, counted.counts)
    # Load gossip: present with two instances, never beyond the bound (batching lowers it).
    load = counted.counts["admission.load"]
    assert 0 < load <= capacity.PER_REQUEST["admission.load"] * REQUESTS + 2 * counted.seconds
    for name in ("kv.pin", "events.pin"):
        assert counted.counts[name] == capacity.PER_NEW_SESSION[name] * SESSIONS, name


# Classes that do not grow with requests: heartbeats, scrapes, probes, renewals, quota and
# shard moves, their JetStream acks and replies (docs/capacity.md lists them).
BACKGROUND = {
    "admission.health",
    "admission.leases",
    "admission.flow",
    "inbox.other",
    "js.ack",
    "js.api",
    "kv.load",
    "kv.member",
    "kv.quota",
    "kv.shard",
    "events.endpoint",
    "events.pool",
    "events.shard",
    "spend.totals",  # each edge's spend totals, once per spend.interval
    "spend.grant",
    "kv.spend",  # admission writes them down, one put per edge per interval
    "kv.fleet",
}


def test_every_other_message_is_background(counted):
    per_request = set(capacity.PER_REQUEST) | set(capacity.PER_NEW_SESSION)
    assert set(counted.counts) <= per_request | BACKGROUND, counted.counts
    assert "kv.lease" not in counted.counts  # leases never touch the bucket


def test_pin_bytes_are_what_the_model_uses(counted):
    assert counted.pin_key_bytes <= capacity.PIN_KEY_BYTES
    assert counted.pin_value_bytes <= capacity.PIN_VALUE_BYTES + 16  # ids vary a little


def test_the_document_shows_the_model():
    doc = (REPO / "docs" / "capacity.md").read_text()
    assert capacity.per_request_table() in doc
    for name, value in capacity.estimate(capacity.Deployment()).items():
        assert f"| {name} | {value:,.0f} |" in doc, name
