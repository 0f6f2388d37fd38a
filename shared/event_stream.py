"""The events stream: JetStream keeps what is published on `llmgw.v1.events.>` for replay.

Publishers do not change: an event is still one core NATS publish (no acknowledgement awaited on
any hot path); the stream captures it on the server. A subscriber that starts late reads the
stream from a time (`--since`) or from its start, then follows live (`llmgw events`).

`ensure_events_stream(js, config)` is called by admission, the reaper and the scraper at start:
it creates the stream (``events.*`` settings, `Config.replicas_of(events.stream)` replicas) or
brings an existing one's retention to the config. It never fails a service's start: a server
without JetStream, or another stream already capturing the subjects, is logged once and the
events stay live-only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from llmgw.events import ALL_EVENTS_SUBJECT
from llmgw.state.streams import ensure_stream

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

    from llmgw.config.schema import Config

__all__ = ["StoredEvent", "ensure_events_stream", "events_stream_config", "read_events"]


def events_stream_config(config: Config) -> StreamConfig:
    events = config.events
    return StreamConfig(
        name=events.stream,
        description="llmgw events (docs/events.md)",
        subjects=[ALL_EVENTS_SUBJECT],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=events.max_age,
        max_bytes=events.max_bytes,
        storage=StorageType.FILE if events.storage == "file" else StorageType.MEMORY,
        num_replicas=config.replicas_of(events.stream),
    )


async def ensure_events_stream(js: JetStreamContext, config: Config) -> bool:
    """Create or update the events stream; True when it exists as configured afterwards."""
    if not config.events.enabled:
        return False
    return await ensure_stream(js, events_stream_config(config), "events are published live only")


@dataclass(frozen=True, slots=True)
class StoredEvent:
    subject: str
    data: bytes
    sequence: int
    at: datetime | None
    pending: int  # stored events after this one at the time it was delivered


async def read_events(
    js: JetStreamContext,
    stream: str,
    subject: str = ALL_EVENTS_SUBJECT,
    *,
    since: datetime | None = None,
    follow: bool = False,
    idle: float = 1.0,
) -> AsyncIterator[StoredEvent]:
    """The stored events on `subject` (from `since`, else from the first kept), in stream order;
    with `follow`, then every new one until cancelled. An ephemeral consumer, no acks.

    Without `follow` it ends once it has delivered what was stored when it started (pending 0),
    or after `idle` seconds without a message (nothing stored matches).
    """
    policy = DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME
    consumer = ConsumerConfig(
        deliver_policy=policy,
        opt_start_time=since.astimezone(UTC) if since is not None else None,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe(subject, stream=stream, config=consumer)
    try:
        while True:
            try:
                messages = await sub.fetch(256, timeout=idle)
            except TimeoutError:
                if follow:
                    continue
                return
            for msg in messages:
                meta = msg.metadata
                yield StoredEvent(
                    subject=msg.subject,
                    data=msg.data,
                    sequence=meta.sequence.stream,
                    at=meta.timestamp,
                    pending=meta.num_pending,
                )
                if not follow and meta.num_pending == 0:
                    return
    finally:
        await sub.unsubscribe()
