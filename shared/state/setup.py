"""Opening the buckets a service uses, from the config (one place, used by every service)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.load import LOAD_BUCKET_HISTORY, LOAD_BUCKET_STORAGE
from llmgw.state.nats_kv import NatsKV, open_routing_bucket
from llmgw.state.store import RoutingStore

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config


async def open_routing_store(nc: NATS, config: Config) -> RoutingStore:
    """The routing bucket (created on first use) as a typed store."""
    pinning = config.pinning
    kv = await open_routing_bucket(
        nc.jetstream(),
        pinning.bucket,
        storage=pinning.storage,
        replicas=config.replicas_of(pinning.bucket),
        history=pinning.history,
    )
    return RoutingStore(kv)


async def open_load_bucket(nc: NATS, config: Config) -> NatsKV:
    """The load bucket the scraper writes and admission follows (created on first use)."""
    return await open_routing_bucket(
        nc.jetstream(),
        config.router.load_bucket,
        storage=LOAD_BUCKET_STORAGE,
        history=LOAD_BUCKET_HISTORY,
        replicas=config.replicas_of(config.router.load_bucket),
    )


async def open_events_stream(nc: NATS, config: Config) -> bool:
    """The events stream over `llmgw.v1.events.>` (created or updated; never fails a start)."""
    from llmgw.event_stream import ensure_events_stream

    return await ensure_events_stream(nc.jetstream(), config)
