"""Ports: the narrow interfaces the services depend on, next to their consumers in one place.

A service takes these, not a raw NATS client or a concrete store, so each has a test double and
a second implementation where the design needs one (the admission client has a NATS one and an
outage one). Each contract is stated in its docstring: what a call promises, what it may raise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from llmgw.core.ledger import LeaseRecord
    from llmgw.events import RoutingEvent
    from llmgw.wire import AdmitReply, AdmitRequest, RequestEnded

__all__ = [
    "AdmissionClient",
    "AdmissionUnavailable",
    "Clock",
    "EventSink",
    "LeaseHold",
    "LeaseStore",
    "RequestReporter",
]


class Clock(Protocol):
    """Seconds; `time.time` for stamps other hosts read, `time.monotonic` for durations."""

    def __call__(self) -> float: ...


class AdmissionUnavailable(Exception):
    """No admission decision could be had: NATS is unreachable, no instance serves the shard,
    or none answered in time. `fast` says it was known at once (no waiting)."""

    def __init__(self, message: str, *, fast: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.fast = fast


@runtime_checkable
class AdmissionClient(Protocol):
    """The edge's way to ask for a decision.

    `admit` returns the ADMITTED or REFUSED reply (never QUEUED: it waits through the queue) and
    whether the client left meanwhile, or raises AdmissionUnavailable. `client_gone()` is
    awaited while the request is queued and completes when the client hangs up: the request is
    then cancelled in admission and `admit` still returns the answer (a grant that raced the
    cancel carries a lease the caller must end at once). `ready` says whether decisions can be
    had now (the edge's readiness).
    """

    async def admit(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool]: ...

    def ready(self) -> bool: ...


class LeaseHold(Protocol):
    """One request's lease while it runs at the edge."""

    @property
    def lost(self) -> bool:
        """The owner said it does not hold it, or it could not be renewed for lease_timeout."""
        ...

    on_lost: Callable[[], None] | None


@runtime_checkable
class LeaseStore(Protocol):
    """The edge's leases: `hold` from the admission reply on; `end` exactly once (the release
    travels in the request's RequestEnded); renewals run in the background, batched per shard."""

    def hold(self, lease: LeaseRecord) -> LeaseHold: ...

    def end(self, hold: LeaseHold) -> None: ...


class RequestReporter(Protocol):
    """Publishes one RequestEnded per upstream attempt, off the request path, never raising."""

    def report(self, message: RequestEnded) -> None: ...


class EventSink(Protocol):
    """Sends routing events (at most once, never raising on the hot path)."""

    async def publish(self, event: RoutingEvent) -> bool: ...
