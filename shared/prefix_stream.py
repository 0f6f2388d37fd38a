"""The prefix stream: what each endpoint's prefix cache holds, for every admission instance.

Admission instances publish the prompts they place (`PrefixSent`), the scraper what engines'
KV cache events say they hold (`PrefixHeld`); both on `llmgw.v1.prefix.<stream>.>`, kept in one
JetStream stream (`Config.prefix_stream`) for `prefix.max_age` and at most `prefix.max_bytes`, so an
instance that starts reads the recent past and builds the same index as the others. Whoever
starts first creates the stream; a stream that exists with other limits is updated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from llmgw.state.streams import ensure_stream
from llmgw.wire import prefix_subjects

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

    from llmgw.config.schema import Config

__all__ = ["ensure_prefix_stream", "prefix_stream_config"]


def prefix_stream_config(config: Config) -> StreamConfig:
    prefix = config.prefix
    return StreamConfig(
        name=config.prefix_stream,
        description="llmgw prefix caches: placements and KV cache events",
        subjects=[prefix_subjects(config.prefix_stream)],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=prefix.max_age,
        max_bytes=prefix.max_bytes,
        storage=StorageType.FILE,
        num_replicas=config.replicas_of(config.prefix_stream),
    )


async def ensure_prefix_stream(js: JetStreamContext, config: Config) -> bool:
    """Create or update the prefix stream; True when it exists as configured afterwards (False:
    the index is then built from live messages only)."""
    return await ensure_stream(
        js, prefix_stream_config(config), "prefix caches are known from live messages only"
    )
