"""Routing events: pin changes, lease expiries, shard and member changes, and the scraper's
endpoint and pool reports, on NATS (docs/events.md is the reference).

Subjects (one vocabulary with KV keys and metrics): ``llmgw.v1.events.<noun>.<verb>.<token>``.
`EVENT_KINDS` is the one table of kinds: each one's payload model, the services that publish it
and the payload field that is its subject's last token; tests/events/test_events_doc.py holds
docs/events.md to it (kinds, publishers, tokens, every field, the version).

Versions: every payload carries `v` (2). It changes only with a change a receiver written for the
previous version could misread: a field or kind removed or renamed, a field's type or meaning
changed. A new optional field or a new kind keeps it. `parse_event` ignores unknown fields and
raises on an unknown `v` or kind: receivers skip those.

Guarantees: core NATS publish, no acknowledgement awaited; the events stream
(`llmgw.event_stream`, ``events.*`` settings) keeps them for a late subscriber to replay. A
routing event is sent only by the instance whose decision or compare-and-swap made the change,
so it is never announced twice. Publishing never raises on the hot path: failures are logged
once per outage and counted. Every payload on `llmgw.v1.events.>` parses with `parse_event`.
"""

from __future__ import annotations

import enum
import functools
import logging
import operator
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Final, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.load import EndpointReport, PoolReport

__all__ = [
    "ALL_EVENTS_SUBJECT",
    "EVENTS_SUBJECT_PREFIX",
    "EVENT_KINDS",
    "EndpointEvent",
    "Event",
    "EventKind",
    "EventName",
    "EventPublisher",
    "EventTransport",
    "LeaseExpired",
    "MemberEvent",
    "PinEvent",
    "PinMoved",
    "PoolMeasured",
    "Publisher",
    "QuotaReclaimed",
    "RoutingEvent",
    "ShardEvent",
    "event_id",
    "event_subject",
    "parse_event",
]

_log = logging.getLogger(__name__)

EVENTS_SUBJECT_PREFIX = "llmgw.v1.events"
ALL_EVENTS_SUBJECT = f"{EVENTS_SUBJECT_PREFIX}.>"


class EventName(enum.StrEnum):
    """`<noun>.<verb>`: the event's subject tokens after the prefix, and its `event` field."""

    PIN_CREATED = "pin.created"
    PIN_MOVED = "pin.moved"
    PIN_EVICTED = "pin.evicted"
    PIN_EXPIRED = "pin.expired"
    LEASE_EXPIRED = "lease.expired"
    SHARD_CLAIMED = "shard.claimed"
    SHARD_HANDED = "shard.handed"
    MEMBER_JOINED = "member.joined"
    MEMBER_LEFT = "member.left"
    MEMBER_EXPIRED = "member.expired"
    QUOTA_RECLAIMED = "quota.reclaimed"
    ENDPOINT_SCRAPED = "endpoint.scraped"
    ENDPOINT_HEALTHY = "endpoint.healthy"
    ENDPOINT_UNHEALTHY = "endpoint.unhealthy"
    POOL_MEASURED = "pool.measured"


def event_subject(event: EventName | str, token: str) -> str:
    return f"{EVENTS_SUBJECT_PREFIX}.{event}.{token}"


def event_id(rng: random.Random | None = None) -> str:
    """A fresh event id: 16 hex digits."""
    return f"{(rng or random).getrandbits(64):016x}"


class RoutingEvent(BaseModel):
    """Fields every event has. Receivers ignore fields they do not know (new optional fields
    and new kinds do not bump `v`) and must reject a `v` they do not know."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[2] = 2
    event: EventName
    id: str  # unique per event (16 hex digits)
    at: float  # unix seconds, by the publishing instance's clock
    instance: str  # the instance that made the change

    @property
    def subject_token(self) -> str:
        """The subject's last token: the value of the kind's `token` field (`EVENT_KINDS`)."""
        token: str = operator.attrgetter(EVENT_KINDS[self.event].token)(self)
        return token

    @property
    def subject(self) -> str:
        return event_subject(self.event, self.subject_token)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class PinEvent(RoutingEvent):
    """A pin was created, evicted or expired (`session` is its hashed id, never client text)."""

    event: Literal[EventName.PIN_CREATED, EventName.PIN_EVICTED, EventName.PIN_EXPIRED]
    provider: str
    model: str
    session: str
    pin_id: str
    shard: int
    parent: str | None = None  # a sub-agent's: its parent session (hashed as `session`)


class PinMoved(RoutingEvent):
    event: Literal[EventName.PIN_MOVED] = EventName.PIN_MOVED
    provider: str  # where it is now
    model: str
    session: str
    pin_id: str  # the moved pin's new id
    shard: int
    from_provider: str
    from_pin_id: str
    reason: str  # degraded | unsupported | return_home


class LeaseExpired(RoutingEvent):
    event: Literal[EventName.LEASE_EXPIRED] = EventName.LEASE_EXPIRED
    provider: str
    model: str
    lease_id: str
    edge: str
    shard: int
    session: str | None = None
    pin_id: str | None = None


class ShardEvent(RoutingEvent):
    """`shard.claimed`: `owner` took `shards` from `previous` (gone); `shard.handed`: the
    publisher handed them to `owner`."""

    event: Literal[EventName.SHARD_CLAIMED, EventName.SHARD_HANDED]
    owner: str
    shards: tuple[int, ...]
    previous: str | None = None
    leases: int = 0  # leases that moved with them (adopted from edges, or handed over)
    pins: int = 0


class MemberEvent(RoutingEvent):
    event: Literal[EventName.MEMBER_JOINED, EventName.MEMBER_LEFT, EventName.MEMBER_EXPIRED]
    member: str


class QuotaReclaimed(RoutingEvent):
    event: Literal[EventName.QUOTA_RECLAIMED] = EventName.QUOTA_RECLAIMED
    provider: str
    model: str
    member: str  # the dead instance whose quota was dropped
    leases: int
    unreserved: int
    pins: int


class EndpointEvent(RoutingEvent):
    """The scraper's report of one endpoint (`llmgw.load.EndpointReport`): every round
    (`endpoint.scraped`), and when its health verdict changes (`endpoint.healthy` /
    `endpoint.unhealthy`, also a scraper's first verdict: a repeat is a no-op)."""

    event: Literal[
        EventName.ENDPOINT_SCRAPED, EventName.ENDPOINT_HEALTHY, EventName.ENDPOINT_UNHEALTHY
    ]
    report: EndpointReport


class PoolMeasured(RoutingEvent):
    """The scraper's report of one (provider, pool) after a round (`llmgw.load.PoolReport`)."""

    event: Literal[EventName.POOL_MEASURED] = EventName.POOL_MEASURED
    report: PoolReport


Event = Annotated[
    PinEvent
    | PinMoved
    | LeaseExpired
    | ShardEvent
    | MemberEvent
    | QuotaReclaimed
    | EndpointEvent
    | PoolMeasured,
    Field(discriminator="event"),
]


class Publisher(enum.StrEnum):
    """The service that sends a kind of event. An admission instance runs in `llmgw admission`
    or, with ``admission.colocated``, in an edge's process."""

    ADMISSION = "admission"
    REAPER = "reaper"
    SCRAPER = "scraper"


@dataclass(frozen=True, slots=True)
class EventKind:
    """One kind of event: its payload model, who publishes it, and the payload field whose value
    is its subject's last token (dotted for a field of a nested report)."""

    model: type[RoutingEvent]
    publishers: tuple[Publisher, ...]
    token: str


_ADMISSION = (Publisher.ADMISSION,)
_SCRAPER = (Publisher.SCRAPER,)
_ADMISSION_OR_REAPER = (Publisher.ADMISSION, Publisher.REAPER)

# Every kind there is: docs/events.md is checked against this table and the models (the kinds,
# their publishers and tokens, every field and the version), so a kind or a field added here
# without its documentation fails a test.
EVENT_KINDS: Final[Mapping[EventName, EventKind]] = MappingProxyType(
    {
        EventName.PIN_CREATED: EventKind(PinEvent, _ADMISSION, "provider"),
        EventName.PIN_MOVED: EventKind(PinMoved, _ADMISSION, "provider"),
        EventName.PIN_EVICTED: EventKind(PinEvent, _ADMISSION, "provider"),
        EventName.PIN_EXPIRED: EventKind(PinEvent, _ADMISSION, "provider"),
        EventName.LEASE_EXPIRED: EventKind(LeaseExpired, _ADMISSION, "provider"),
        EventName.SHARD_CLAIMED: EventKind(ShardEvent, _ADMISSION, "owner"),
        EventName.SHARD_HANDED: EventKind(ShardEvent, _ADMISSION, "owner"),
        EventName.MEMBER_JOINED: EventKind(MemberEvent, _ADMISSION, "member"),
        EventName.MEMBER_LEFT: EventKind(MemberEvent, _ADMISSION, "member"),
        # The reaper, or the successor of an exited process (`llmgw up`, a stable instance name).
        EventName.MEMBER_EXPIRED: EventKind(MemberEvent, _ADMISSION_OR_REAPER, "member"),
        # The adopter of the dead instance's shards, or the reaper after `quota_grace`.
        EventName.QUOTA_RECLAIMED: EventKind(QuotaReclaimed, _ADMISSION_OR_REAPER, "provider"),
        EventName.ENDPOINT_SCRAPED: EventKind(EndpointEvent, _SCRAPER, "report.provider"),
        EventName.ENDPOINT_HEALTHY: EventKind(EndpointEvent, _SCRAPER, "report.provider"),
        EventName.ENDPOINT_UNHEALTHY: EventKind(EndpointEvent, _SCRAPER, "report.provider"),
        EventName.POOL_MEASURED: EventKind(PoolMeasured, _SCRAPER, "report.provider"),
    }
)


@functools.cache
def _event_adapter() -> TypeAdapter[Event]:
    return TypeAdapter(Event)


def parse_event(raw: bytes | str) -> Event:
    """The typed event in a message payload; pydantic.ValidationError if it is not one."""
    return _event_adapter().validate_json(raw)


class EventTransport(Protocol):
    """What the publisher needs from a NATS client (`nats.aio.client.Client` satisfies it)."""

    async def publish(self, subject: str, payload: bytes = b"") -> None: ...


class EventPublisher:
    """Sends routing events with core NATS publish: no ack awaited, never raises.

    `emit` builds an event of `kind` with the common fields (a fresh id, `clock()`, this
    instance) and sends it in the background; `publish` sends a built one and awaits the hand-off.
    Counters: `published`, `failures` (events not handed to the client: logged, dropped).
    """

    def __init__(
        self,
        nc: EventTransport,
        instance: str,
        *,
        clock: Clock | TimeSource = SYSTEM,
        rng: random.Random | None = None,
    ) -> None:
        self._nc = nc
        self.instance = instance
        self._clock = wall_of(clock)
        self._rng = rng if rng is not None else random.Random()
        self.published = 0
        self.failures = 0
        self._failing = False  # log one warning per outage, not one per event
        # Events emitted and not yet handed to the client, oldest first: one task publishes
        # what an event-loop turn emitted (`_flush`), not a task per event.
        self._outbox: list[RoutingEvent] = []
        self._flushing: object | None = None

    def build(self, kind: type[RoutingEvent], **fields: object) -> RoutingEvent:
        return kind(
            id=event_id(self._rng),
            at=self._clock(),
            instance=self.instance,
            **fields,  # type: ignore[arg-type]
        )

    def emit(self, kind: type[RoutingEvent], **fields: object) -> None:
        """Build and send an event without waiting (the hot path): the events emitted in one
        event-loop turn are published in order by one task, at the next turn."""
        import asyncio

        try:
            event = self.build(kind, **fields)
        except Exception as exc:  # a bug in an announcement must not fail the change
            self._failed(f"cannot build a {kind.__name__} event", exc)
            return
        self._outbox.append(event)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                for event in batch:
                    await self.publish(event)
        finally:
            self._flushing = None

    async def publish(self, event: RoutingEvent) -> bool:
        """Send `event`; True if handed to the client, False (logged, counted) if not."""
        try:
            await self._nc.publish(event.subject, event.to_bytes())
        except Exception as exc:  # never let an announcement fail the change it announces
            self._failed(f"cannot publish {event.event} event on {event.subject}", exc)
            return False
        self.published += 1
        if self._failing:
            self._failing = False
            _log.info("publishing events again")
        return True

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if not self._failing:
            self._failing = True
            _log.warning("%s: %s (further failures are only counted until one succeeds)", what, exc)
