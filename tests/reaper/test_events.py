"""Routing events: subjects, schema round trips, the action -> event table, and a publisher
that never raises (checked against a real server and a really closed connection)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from reaper_helpers import IRIS, MODEL, Connect, EventLog, session_id

from llmgw.core.leasekeys import PinValue, model_key, pin_key
from llmgw.core.leases import Pin, ReaperAction, ReaperActionKind
from llmgw.events import (
    ALL_EVENTS_SUBJECT,
    EventName,
    EventPublisher,
    LeaseExpired,
    LeaseUnlisted,
    PinAbandoned,
    PinCreated,
    PinExpired,
    PinMoved,
    PinSlotFreed,
    ReaperCause,
    event_subject,
    parse_event,
    reaper_action_event,
)

K = ReaperActionKind
SESSION = session_id(1)
PIN_KEY = pin_key(model_key(MODEL), SESSION)


def _action(kind: ReaperActionKind, lease_id: str | None = "00000000000000aa") -> ReaperAction:
    return ReaperAction(kind, PIN_KEY, 17, IRIS, MODEL, SESSION, "00000000000000bb", lease_id)


def _pin(provider: str, pin_id: str, revision: int) -> Pin:
    value = PinValue(
        pin_id,
        provider,
        MODEL,
        SESSION,
        3 if provider == IRIS else None,
        {"00000000000000cc": "lease.x.y.1"},
        5.0,
    )
    return Pin(PIN_KEY, revision, value)


@pytest.mark.parametrize(
    ("kind", "cause", "expected_type", "expected_cause"),
    [
        (K.LEASE_EXPIRED, ReaperCause.EXPIRY, LeaseExpired, None),
        (K.LEASE_UNLISTED, ReaperCause.EXPIRY, LeaseUnlisted, ReaperCause.EXPIRY),
        (K.LEASE_UNLISTED, ReaperCause.REPAIR, LeaseUnlisted, ReaperCause.REPAIR),
        (K.PIN_EXPIRED, ReaperCause.EXPIRY, PinExpired, None),
        (K.PIN_SLOT_FREED, ReaperCause.EXPIRY, PinSlotFreed, ReaperCause.EXPIRY),
        (K.ORPHAN_PIN_SLOT_FREED, ReaperCause.REPAIR, PinSlotFreed, ReaperCause.REPAIR),
        (K.ORPHAN_PIN_SLOT_FREED, ReaperCause.EXPIRY, PinSlotFreed, ReaperCause.REPAIR),
        (K.ABANDONED_PIN_DELETED, ReaperCause.REPAIR, PinAbandoned, None),
    ],
    ids=lambda v: str(getattr(v, "__name__", v)),
)
def test_each_reaper_action_becomes_one_event_that_round_trips(
    kind: ReaperActionKind, cause: ReaperCause, expected_type: type, expected_cause: object
) -> None:
    event = reaper_action_event(
        _action(kind), cause=cause, event_id="e1", at=9.5, instance="reaper-1"
    )
    assert type(event) is expected_type
    assert getattr(event, "cause", None) == expected_cause
    assert (event.key, event.revision, event.provider, event.model) == (PIN_KEY, 17, IRIS, MODEL)
    assert event.subject == f"llmgw.v1.events.{event.event}.{IRIS}"
    assert parse_event(event.to_bytes()) == event


def test_every_reaper_action_kind_has_an_event() -> None:
    for kind in ReaperActionKind:
        reaper_action_event(
            _action(kind), cause=ReaperCause.REPAIR, event_id="e", at=0.0, instance="r"
        )


def test_subjects_put_the_provider_last_for_filtering() -> None:
    assert event_subject(EventName.PIN_SLOT_FREED, "iris") == "llmgw.v1.events.pin_slot.freed.iris"
    assert ALL_EVENTS_SUBJECT == "llmgw.v1.events.>"
    assert {name.value.count(".") for name in EventName} == {1}  # always <noun>.<verb>


@pytest.mark.parametrize(
    "payload",
    [
        b"{}",
        b'{"v": 2, "event": "pin.expired"}',
        b'{"v": 1, "event": "pin.exploded", "id": "x"}',
        b"not json",
    ],
)
def test_parse_rejects_unknown_versions_events_and_garbage(payload: bytes) -> None:
    with pytest.raises(ValidationError):
        parse_event(payload)


def test_receivers_ignore_fields_added_later() -> None:
    event = reaper_action_event(
        _action(K.LEASE_EXPIRED), cause=ReaperCause.EXPIRY, event_id="e1", at=1.0, instance="r"
    )
    data = json.loads(event.to_bytes())
    data["added_in_a_later_release"] = True
    assert parse_event(json.dumps(data)) == event


async def test_pin_created_and_moved_reach_subscribers(
    connect: Connect, event_log: EventLog
) -> None:
    nc = await connect()
    publisher = EventPublisher(nc, "admission-1")
    old, new = _pin(IRIS, "000000000000000a", 11), _pin("tensorx", "000000000000000b", 12)
    assert await publisher.publish_pin_created(old)
    assert await publisher.publish_pin_moved(old, new)
    created, moved = await event_log.sync(nc)

    assert isinstance(created, PinCreated) and isinstance(moved, PinMoved)
    assert (created.session, created.pin_id, created.pin_slot, created.revision) == (
        SESSION,
        "000000000000000a",
        3,
        11,
    )
    assert (moved.provider, moved.from_provider, moved.from_pin_id, moved.pin_id) == (
        "tensorx",
        IRIS,
        "000000000000000a",
        "000000000000000b",
    )
    assert created.id != moved.id and created.instance == moved.instance == "admission-1"
    assert publisher.published == 2 and publisher.failures == 0


async def test_publishing_on_a_closed_connection_is_counted_not_raised(connect: Connect) -> None:
    nc = await connect()
    await nc.close()
    publisher = EventPublisher(nc, "reaper-1")
    sent = await publisher.publish_reaper_actions(
        [_action(K.LEASE_EXPIRED), _action(K.PIN_EXPIRED)], ReaperCause.EXPIRY
    )
    assert sent == 0
    assert (publisher.published, publisher.failures) == (0, 2)
