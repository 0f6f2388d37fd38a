"""Each implementation of the edge's ports satisfies its Protocol (`llmgw.contracts`): at run
time (`isinstance`: the members are there) and for mypy --strict (conformance.py: their types
and signatures too), so a drift in either fails here."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import FakeAdmission, FakeHold, FakeLeases, Queued, RecordingReporter, target

from llmgw.contracts import (
    AdmissionClient,
    AdmissionUnavailable,
    EventSink,
    LeaseHold,
    LeaseStore,
    RequestReporter,
)
from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.core.outage import LocalBudget
from llmgw.core.outcomes import Refusal
from llmgw.events import EventPublisher
from llmgw.services.edge.admission_client import NatsAdmission
from llmgw.services.edge.auth import TokenCountingReporter
from llmgw.services.edge.colocated import ColocatedAdmission
from llmgw.services.edge.leases import EdgeLeases, HeldLease
from llmgw.services.edge.outage import OutageAdmission
from llmgw.services.edge.reporting import NatsReporter
from llmgw.wire import AdmitRequest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

RECORD = LeaseRecord(
    lease_id="l-1",
    provider="p",
    model="m",
    kind=LeaseKind.TEMPORARY,
    unreserved=False,
    shard=0,
    edge="e",
    granted_at=0.0,
    renewed_at=0.0,
)
NOT_NATS = object()  # none of these constructors touches its connection (or config)


def test_every_implementation_has_its_ports_members() -> None:
    nats = NatsAdmission(NOT_NATS, request_timeout=1.0, queue_ttl=1.0)  # type: ignore[arg-type]
    clients = [
        nats,
        OutageAdmission(nats, NOT_NATS, "e", LocalBudget(), is_connected=lambda: False),  # type: ignore[arg-type]
        ColocatedAdmission(NOT_NATS, nats),  # type: ignore[arg-type]
        FakeAdmission(target("p", "e1", "http://127.0.0.1:1", "m")),
    ]
    for client in clients:
        assert isinstance(client, AdmissionClient), type(client)
    edge_leases = EdgeLeases(NOT_NATS, "e", lease_timeout=3.0, request_timeout=1.0)  # type: ignore[arg-type]
    for store in (edge_leases, FakeLeases()):
        assert isinstance(store, LeaseStore), type(store)
    for hold in (HeldLease(RECORD, 0.0), FakeHold(RECORD), edge_leases.hold(RECORD)):
        assert isinstance(hold, LeaseHold), type(hold)
    nats_reporter = NatsReporter(NOT_NATS)  # type: ignore[arg-type]
    for reporter in (
        nats_reporter,
        TokenCountingReporter(nats_reporter, NOT_NATS),  # type: ignore[arg-type]
        RecordingReporter(),
    ):
        assert isinstance(reporter, RequestReporter), type(reporter)
    assert isinstance(EventPublisher(NOT_NATS, "i"), EventSink)  # type: ignore[arg-type]


def test_every_implementation_type_checks_as_its_port(
    tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """mypy --strict on conformance.py (and the fakes). The repository keeps shared/ as the
    `llmgw` package and services/ as `llmgw.services`: mypy reads them through links. The cache
    is the one tests/test_project.py's whole-package check keeps with pytest's (same options):
    whichever runs second rechecks only what the first did not."""
    package = tmp_path / "llmgw"
    package.mkdir()
    for entry in (ROOT / "shared").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "services").symlink_to(ROOT / "services", target_is_directory=True)
    cache = getattr(pytestconfig, "cache", None)  # none under -p no:cacheprovider
    kept = cache.mkdir("mypy") if cache is not None else tmp_path
    env = {**os.environ, "MYPYPATH": f"{tmp_path}{os.pathsep}{HERE}"}
    result = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(kept),
            str(HERE / "conformance.py"), str(HERE / "fakes.py"),
        ],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


async def test_the_fake_admission_client_keeps_the_contract() -> None:
    """Decides from its script (the last decision repeats), raises AdmissionUnavailable, and a
    queued request whose client hangs up is cancelled: (CANCELLED, True)."""
    engine = target("iris", "engine-1", "http://127.0.0.1:1", "m1")
    queued = Queued(engine)
    fake = FakeAdmission(
        Refusal.NO_CAPACITY, AdmissionUnavailable("down", fast=True), queued, queued, engine
    )
    request = AdmitRequest(
        id="a-1", request_id="r-1", edge="e", model="m1", feature="chat", shard=3
    )
    refused, left = await fake.admit(request)
    assert refused.refusal is Refusal.NO_CAPACITY and not left
    with pytest.raises(AdmissionUnavailable):
        await fake.admit(request)
    gone = asyncio.Event()
    asking = asyncio.ensure_future(fake.admit(request, gone.wait))
    await asyncio.sleep(0)
    gone.set()
    cancelled, left = await asking
    assert cancelled.refusal is Refusal.CANCELLED and left and fake.left == [request]
    queued.release.set()
    admitted, left = await fake.admit(request, asyncio.Event().wait)
    assert admitted.target == engine and admitted.lease is not None and not left
    assert admitted.lease.shard == 3
    for _ in range(2):  # the last decision repeats
        assert (await fake.admit(request))[0].target == engine
    assert len(fake.asked) == 6
