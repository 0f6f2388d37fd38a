"""Ports: the narrow interfaces the services depend on, next to their consumers in one place.

A service takes these, not a raw NATS client or a concrete store, so each has a test double and
a second implementation where the design needs one (the admission client has a NATS one, an
outage one and a colocated one). Each contract is stated in its docstring: what a call promises, what it may raise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from llmgw.clock import Clock  # wall and monotonic time, one object (llmgw.clock)

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
    whether the client left meanwhile, or raises AdmissionUnavailable (nothing else). While the
    request is queued it awaits `client_gone()`, which completes when the client hangs up: the
    request is then cancelled in admission and `admit` still returns the answer (a grant that
    raced the cancel carries a lease the caller must end at once).

    `ready()` says whether decisions can be had now (the edge's readiness); `probe()` asks
    whether an admission instance answers (the composition root waits for one before its ready
    line). Neither raises. `start` before the first `admit`, `stop` after the last.
    """

    async def admit(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool]: ...

    def ready(self) -> bool: ...

    async def probe(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class LeaseHold(Protocol):
    """One request's lease while it runs at the edge.

    `on_lost`, set by the request, is called once when the lease is lost or cut: it ends the
    request's wait or upstream call. `cut()` is the drain deadline's: the request ends as
    shutting down (`cut_short`) and still releases its lease; a lost lease is never released.
    """

    @property
    def record(self) -> LeaseRecord: ...

    @property
    def lost(self) -> bool:
        """The owner said it does not hold it, or it could not be renewed for lease_timeout."""
        ...

    @property
    def cut_short(self) -> bool: ...

    on_lost: Callable[[], object] | None  # its result is ignored

    def cut(self) -> None: ...


HoldT = TypeVar("HoldT", bound=LeaseHold)


@runtime_checkable
class LeaseStore(Protocol[HoldT]):
    """The edge's leases: `hold` from the admission reply on; `end` exactly once (the release
    travels in the request's RequestEnded); renewals run in the background (from `start` to
    `stop`), batched per shard. `end` and `expired` take the holds this store made (`HoldT`).

    `held` maps the lease ids of the holds not yet ended to them (readiness counts them, the
    drain deadline cuts them). `expired(hold)` is checked before any other outcome: True once
    the hold is lost, or was not confirmed for lease_timeout (it is then lost). None raises.
    """

    @property
    def held(self) -> Mapping[str, HoldT]: ...

    def hold(self, lease: LeaseRecord) -> HoldT: ...

    def end(self, hold: HoldT) -> None: ...

    def expired(self, hold: HoldT) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class RequestReporter(Protocol):
    """Publishes one RequestEnded per upstream attempt, off the request path, never raising.
    `drain` waits up to `timeout` seconds for what is queued to be handed over (at stop)."""

    def report(self, message: RequestEnded) -> None: ...

    async def drain(self, timeout: float = ...) -> None: ...


@runtime_checkable
class EventSink(Protocol):
    """Sends routing events (at most once, never raising on the hot path)."""

    async def publish(self, event: RoutingEvent) -> bool: ...
