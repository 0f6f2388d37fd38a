"""Test doubles of the edge's ports (`llmgw.contracts`), for tests of the HTTP layer that need
an admission decision but nothing of how it is reached: no NATS, no admission instance.

`FakeAdmission` decides from a script: each `admit` takes the next decision (the last one
repeats). A decision is a `Target` (admitted there, with a lease), a `Refusal` (refused with it),
an `AdmissionUnavailable` (raised), or a `Queued` one (it waits for its `release`, and is
cancelled if the client hangs up first). It records every request it was asked.

Tests about NATS (timeouts, outages, asking again, queues over the wire) use the real client
against a real nats-server, never these.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from llmgw.contracts import AdmissionUnavailable
from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.core.outcomes import Refusal
from llmgw.wire import AdmitReply, AdmitRequest, ReplyStatus, RequestEnded, Target


@dataclass
class Queued:
    """A decision that waits in a queue until `release` is set (then it is `then`); a client
    that hangs up first gets it cancelled, as admission does."""

    then: Target | Refusal
    release: asyncio.Event = field(default_factory=asyncio.Event)


Decision = Target | Refusal | AdmissionUnavailable | Queued


class FakeAdmission:
    """`llmgw.contracts.AdmissionClient` deciding from a script (see the module docstring)."""

    def __init__(self, *script: Decision) -> None:
        assert script, "a FakeAdmission needs at least one decision"
        self.script: list[Decision] = list(script)
        self.asked: list[AdmitRequest] = []
        self.left: list[AdmitRequest] = []  # requests whose client hung up while queued
        self.answering = True  # what ready() and probe() say
        self.started = False
        self.stopped = False
        self._leases = itertools.count()

    async def admit(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool]:
        self.asked.append(request)
        decision = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(decision, AdmissionUnavailable):
            raise decision
        if isinstance(decision, Queued):
            if await _client_left_first(decision.release, client_gone):
                self.left.append(request)
                refused = Refusal.CANCELLED
                return self._reply(request, refused), True
            decision = decision.then
        return self._reply(request, decision), False

    def _reply(self, request: AdmitRequest, decision: Target | Refusal) -> AdmitReply:
        if isinstance(decision, Refusal):
            return AdmitReply(
                id=request.id,
                status=ReplyStatus.REFUSED,
                refusal=decision,
                message=f"Refused by the test: {decision.value}.",
                retry_after=1,
            )
        now = time.time()
        lease = LeaseRecord(
            lease_id=f"fake-{next(self._leases)}",
            provider=decision.provider,
            model=request.model,
            kind=LeaseKind.TEMPORARY,
            unreserved=False,
            shard=request.shard,
            edge=request.edge,
            granted_at=now,
            renewed_at=now,
            session=request.session,
            endpoint=decision.endpoint,
        )
        return AdmitReply(id=request.id, status=ReplyStatus.ADMITTED, target=decision, lease=lease)

    def ready(self) -> bool:
        return self.answering

    async def probe(self) -> bool:
        return self.answering

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


async def _client_left_first(
    release: asyncio.Event, client_gone: Callable[[], Awaitable[object]] | None
) -> bool:
    released = asyncio.ensure_future(release.wait())
    waits: set[asyncio.Future[Any]] = {released}
    if client_gone is not None:
        waits.add(asyncio.ensure_future(client_gone()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return not (released.done() and not released.cancelled())


class FakeHold:
    """`llmgw.contracts.LeaseHold` of a `FakeLeases`."""

    def __init__(self, record: LeaseRecord) -> None:
        self.record = record
        self.lost = False
        self.cut_short = False
        self.ended = False
        self.on_lost: Callable[[], object] | None = None  # its result is ignored

    def cut(self) -> None:
        if self.lost or self.ended:
            return
        self.cut_short = True
        if self.on_lost is not None:
            self.on_lost()

    def lose(self) -> None:
        """What the real store does when the owner says so or renewals stop."""
        if self.lost or self.ended:
            return
        self.lost = True
        if self.on_lost is not None:
            self.on_lost()


class FakeLeases:
    """`llmgw.contracts.LeaseStore` in memory: holds until ended, lost only when a test says."""

    def __init__(self) -> None:
        self.held: dict[str, FakeHold] = {}
        self.ended: list[FakeHold] = []

    def hold(self, lease: LeaseRecord) -> FakeHold:
        hold = self.held[lease.lease_id] = FakeHold(lease)
        return hold

    def end(self, hold: FakeHold) -> None:
        if hold.ended:
            return
        hold.ended = True
        self.held.pop(hold.record.lease_id, None)
        self.ended.append(hold)

    def expired(self, hold: FakeHold) -> bool:
        return hold.lost

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class RecordingReporter:
    """`llmgw.contracts.RequestReporter` that keeps what it was given."""

    def __init__(self) -> None:
        self.ended: list[RequestEnded] = []

    def report(self, message: RequestEnded) -> None:
        self.ended.append(message)

    async def drain(self, timeout: float = 5.0) -> None:
        pass


def target(provider: str, endpoint: str, url: str, upstream_model: str) -> Target:
    """Where a fake admits a request (`provider_kind` managed)."""
    return Target(
        provider=provider,
        provider_kind="managed",
        endpoint=endpoint,
        url=url,
        upstream_model=upstream_model,
    )
