"""Every implementation of a port (`llmgw.contracts`) given to its Protocol, for mypy --strict
(tests/edge/test_contracts.py): a method, property or signature that drifts from its contract
fails the check. Nothing here runs."""

from __future__ import annotations

from fakes import FakeAdmission, FakeHold, FakeLeases, RecordingReporter

from llmgw.clock import SYSTEM, SteppedClock, SystemClock
from llmgw.contracts import (
    AdmissionClient,
    Clock,
    EventSink,
    LeaseHold,
    LeaseStore,
    RequestReporter,
)
from llmgw.events import EventPublisher
from llmgw.services.edge.admission_client import NatsAdmission
from llmgw.services.edge.auth import TokenCountingReporter
from llmgw.services.edge.colocated import ColocatedAdmission
from llmgw.services.edge.leases import EdgeLeases, HeldLease
from llmgw.services.edge.outage import OutageAdmission
from llmgw.services.edge.reporting import NatsReporter


def admission_clients(
    nats: NatsAdmission,
    outage: OutageAdmission,
    colocated: ColocatedAdmission,
    fake: FakeAdmission,
) -> list[AdmissionClient]:
    return [nats, outage, colocated, fake]


def lease_stores(
    edge: EdgeLeases, fake: FakeLeases
) -> tuple[LeaseStore[HeldLease], LeaseStore[FakeHold]]:
    return edge, fake


def lease_holds(edge: HeldLease, fake: FakeHold) -> list[LeaseHold]:
    return [edge, fake]


def reporters(
    nats: NatsReporter, counting: TokenCountingReporter, fake: RecordingReporter
) -> list[RequestReporter]:
    return [nats, counting, fake]


def event_sinks(publisher: EventPublisher) -> list[EventSink]:
    return [publisher]


def clocks(stepped: SteppedClock) -> list[Clock]:
    return [SYSTEM, SystemClock(), stepped]
