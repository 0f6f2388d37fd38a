"""Routing events: every change of a pin or a lease made by admission or the reaper, on NATS.

Subjects (one vocabulary with KV keys and metrics; docs/events.md is the reference):

    llmgw.v1.events.<noun>.<verb>.<provider>

    pin.created       admission wrote a new pin (with its first lease)
    pin.moved         admission moved a pin to another provider (repin)
    pin.expired       the reaper deleted a pin idle for pin_inactivity_timeout
    lease.expired     the reaper freed the slot of a lease not renewed within lease_timeout
    lease.unlisted    the reaper took an ended lease off its pin (after an expiry, or a repair)
    pin_slot.freed    the reaper freed a pin slot (of an expired pin, or an orphan: repair)
    pin.abandoned     the reaper deleted a pending pin its creator never activated (repair)

The provider is the last token so that one provider's events can be followed alone
(`llmgw.v1.events.*.*.iris`); providers are safe key tokens, so they are safe subject tokens.

Guarantees: core NATS publish, at most once, no replay, no acknowledgement. An event is sent
only by the instance whose compare-and-swap made the change (the routing-state primitives return
only changes whose write succeeded), so a change is never announced twice, even with several
reapers; it is lost if that instance dies or NATS drops it. `revision` is the KV revision of the
write, which orders the events of one key (and, per bucket, of all keys).

Publishing never raises on the hot path: failures are logged once per outage and counted.
"""

from __future__ import annotations

import enum
import functools
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from llmgw.core.leases import Lease, Pin, RandomSource, ReaperAction, ReaperActionKind, new_token

__all__ = [
    "ALL_EVENTS_SUBJECT",
    "EVENTS_SUBJECT_PREFIX",
    "Event",
    "EventName",
    "EventPublisher",
    "EventTransport",
    "LeaseExpired",
    "LeaseUnlisted",
    "PinAbandoned",
    "PinCreated",
    "PinExpired",
    "PinMoved",
    "PinSlotFreed",
    "ReaperCause",
    "RoutingEvent",
    "event_subject",
    "parse_event",
    "pin_created_event",
    "pin_moved_event",
    "reaper_action_event",
]

_log = logging.getLogger(__name__)

EVENTS_SUBJECT_PREFIX = "llmgw.v1.events"
ALL_EVENTS_SUBJECT = f"{EVENTS_SUBJECT_PREFIX}.>"


class EventName(enum.StrEnum):
    """`<noun>.<verb>`: the event's subject tokens after the prefix, and its `event` field."""

    PIN_CREATED = "pin.created"
    PIN_MOVED = "pin.moved"
    PIN_EXPIRED = "pin.expired"
    LEASE_EXPIRED = "lease.expired"
    LEASE_UNLISTED = "lease.unlisted"
    PIN_SLOT_FREED = "pin_slot.freed"
    PIN_ABANDONED = "pin.abandoned"


class ReaperCause(enum.StrEnum):
    """Why the reaper made a change: ordinary expiry, or repair of an interrupted operation."""

    EXPIRY = "expiry"
    REPAIR = "repair"


def event_subject(event: EventName | str, provider: str) -> str:
    return f"{EVENTS_SUBJECT_PREFIX}.{event}.{provider}"


class RoutingEvent(BaseModel):
    """Fields every event has. `key` and `revision` name the KV write that made the change.

    Receivers ignore fields they do not know (new optional fields do not bump `v`) and must
    reject a `v` they do not know.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    event: EventName
    id: str  # unique per event (16 hex digits)
    at: float  # unix seconds, by the publishing instance's clock
    instance: str  # the instance whose write made the change
    provider: str
    model: str
    session: str | None = None  # the session's hashed id, never client text
    pin_id: str | None = None
    lease_id: str | None = None
    key: str
    revision: int

    @property
    def subject(self) -> str:
        return event_subject(self.event, self.provider)

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=False).encode()


class PinCreated(RoutingEvent):
    event: Literal[EventName.PIN_CREATED] = EventName.PIN_CREATED
    session: str
    pin_id: str
    pin_slot: int | None = None  # None for a provider without limits
    # lease_id: the pin's first lease (None when the caller did not say)


class PinMoved(RoutingEvent):
    event: Literal[EventName.PIN_MOVED] = EventName.PIN_MOVED
    session: str
    pin_id: str  # the new pin's id (a moved pin gets a new id)
    pin_slot: int | None = None
    from_provider: str
    from_pin_id: str


class PinExpired(RoutingEvent):
    event: Literal[EventName.PIN_EXPIRED] = EventName.PIN_EXPIRED
    session: str
    pin_id: str


class LeaseExpired(RoutingEvent):
    # session/pin_id are None for temporary leases (requests not tied to a pin)
    event: Literal[EventName.LEASE_EXPIRED] = EventName.LEASE_EXPIRED
    lease_id: str


class LeaseUnlisted(RoutingEvent):
    event: Literal[EventName.LEASE_UNLISTED] = EventName.LEASE_UNLISTED
    session: str
    pin_id: str
    lease_id: str
    cause: ReaperCause


class PinSlotFreed(RoutingEvent):
    event: Literal[EventName.PIN_SLOT_FREED] = EventName.PIN_SLOT_FREED
    cause: ReaperCause


class PinAbandoned(RoutingEvent):
    """A pending pin (written first when a pin is created or moved) whose creator died or
    stalled before activating it; the session has no pin until its next request pins it."""

    event: Literal[EventName.PIN_ABANDONED] = EventName.PIN_ABANDONED
    session: str
    pin_id: str


Event = Annotated[
    PinCreated | PinMoved | PinExpired | LeaseExpired | LeaseUnlisted | PinSlotFreed | PinAbandoned,
    Field(discriminator="event"),
]


@functools.cache
def _event_adapter() -> TypeAdapter[Event]:
    return TypeAdapter(Event)


def parse_event(raw: bytes | str) -> Event:
    """The typed event in a message payload; pydantic.ValidationError if it is not one."""
    return _event_adapter().validate_json(raw)


# ---------------------------------------------------------------------------------------------
# Building events (pure: the caller supplies id, time and instance)


def pin_created_event(
    pin: Pin, *, lease: Lease | None, event_id: str, at: float, instance: str
) -> PinCreated:
    """The event of `pin` (as returned by an ADMITTED new-pin admission) having been written."""
    return PinCreated(
        id=event_id,
        at=at,
        instance=instance,
        provider=pin.provider,
        model=pin.model,
        session=pin.session,
        pin_id=pin.id,
        pin_slot=pin.pin_slot,
        lease_id=None if lease is None else lease.lease_id,
        key=pin.key,
        revision=pin.revision,
    )


def pin_moved_event(
    from_pin: Pin, pin: Pin, *, lease: Lease | None, event_id: str, at: float, instance: str
) -> PinMoved:
    """The event of `from_pin` having been replaced by `pin` (a successful repin)."""
    return PinMoved(
        id=event_id,
        at=at,
        instance=instance,
        provider=pin.provider,
        model=pin.model,
        session=pin.session,
        pin_id=pin.id,
        pin_slot=pin.pin_slot,
        lease_id=None if lease is None else lease.lease_id,
        key=pin.key,
        revision=pin.revision,
        from_provider=from_pin.provider,
        from_pin_id=from_pin.id,
    )


def reaper_action_event(
    action: ReaperAction, *, cause: ReaperCause, event_id: str, at: float, instance: str
) -> RoutingEvent:
    """The event announcing one change a reaper primitive made.

    `cause` says which primitive returned it (expiry or repair); an orphan pin slot and an
    abandoned pin are always repairs. ValueError for an action kind this vocabulary does not know.
    """
    common = {
        "id": event_id,
        "at": at,
        "instance": instance,
        "provider": action.provider,
        "model": action.model,
        "session": action.session,
        "pin_id": action.pin_id,
        "lease_id": action.lease_id,
        "key": action.key,
        "revision": action.revision,
    }
    kind = action.kind
    if kind == ReaperActionKind.LEASE_EXPIRED:
        return LeaseExpired(**common)
    if kind == ReaperActionKind.LEASE_UNLISTED:
        return LeaseUnlisted(**common, cause=cause)
    if kind == ReaperActionKind.PIN_EXPIRED:
        return PinExpired(**common)
    if kind == ReaperActionKind.PIN_SLOT_FREED:
        return PinSlotFreed(**common, cause=cause)
    if kind == ReaperActionKind.ORPHAN_PIN_SLOT_FREED:
        return PinSlotFreed(**common, cause=ReaperCause.REPAIR)
    if kind == ReaperActionKind.ABANDONED_PIN_DELETED:
        return PinAbandoned(**common)
    raise ValueError(f"reaper action kind {kind!r} has no event")


# ---------------------------------------------------------------------------------------------
# Publishing


class EventTransport(Protocol):
    """What the publisher needs from a NATS client (`nats.aio.client.Client` satisfies it)."""

    async def publish(self, subject: str, payload: bytes = b"") -> None: ...


class EventPublisher:
    """Sends routing events with core NATS publish: no ack awaited, never raises.

    `instance` identifies the publishing process in every event it builds. `clock` stamps
    `at`; `rng` makes event ids (seed it independently per instance, or leave the default).
    Counters: `published`, `failures` (events built or sent unsuccessfully: logged, dropped).
    """

    def __init__(
        self,
        nc: EventTransport,
        instance: str,
        *,
        clock: Callable[[], float] = time.time,
        rng: RandomSource | None = None,
    ) -> None:
        self._nc = nc
        self.instance = instance
        self._clock = clock
        self._rng: RandomSource = rng if rng is not None else random.Random()
        self.published = 0
        self.failures = 0
        self._failing = False  # log one warning per outage, not one per event
        self._unknown_kinds: set[str] = set()

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

    async def publish_pin_created(self, pin: Pin, lease: Lease | None = None) -> bool:
        return await self.publish(
            pin_created_event(
                pin,
                lease=lease,
                event_id=new_token(self._rng),
                at=self._clock(),
                instance=self.instance,
            )
        )

    async def publish_pin_moved(self, from_pin: Pin, pin: Pin, lease: Lease | None = None) -> bool:
        return await self.publish(
            pin_moved_event(
                from_pin,
                pin,
                lease=lease,
                event_id=new_token(self._rng),
                at=self._clock(),
                instance=self.instance,
            )
        )

    async def publish_reaper_actions(
        self, actions: Iterable[ReaperAction], cause: ReaperCause
    ) -> int:
        """Publish one event per action, in order; the number sent."""
        sent = 0
        for action in actions:
            try:
                event = reaper_action_event(
                    action,
                    cause=cause,
                    event_id=new_token(self._rng),
                    at=self._clock(),
                    instance=self.instance,
                )
            except ValueError:
                self.failures += 1
                if action.kind not in self._unknown_kinds:
                    self._unknown_kinds.add(action.kind)
                    _log.error(
                        "reaper action kind %r has no event; such changes go unannounced",
                        action.kind,
                    )
                continue
            sent += await self.publish(event)
        return sent

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if not self._failing:
            self._failing = True
            _log.warning("%s: %s (further failures are only counted until one succeeds)", what, exc)
