"""A JetStream stream a service needs, created or brought to its configured limits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError

if TYPE_CHECKING:
    from nats.js.api import StreamConfig
    from nats.js.client import JetStreamContext

__all__ = ["ensure_stream"]

_log = logging.getLogger(__name__)


async def ensure_stream(js: JetStreamContext, wanted: StreamConfig, unavailable: str) -> bool:
    """Create `wanted`, or update it when it exists with other limits (age, size, replicas);
    True when it exists as configured afterwards. Never raises: a stream that cannot be had is
    logged with `unavailable` (what the service does without it) and False returned, so it
    never fails a start. Every service that needs it calls this: whoever starts first creates
    it."""
    try:
        try:
            info = await js.stream_info(wanted.name)  # type: ignore[arg-type]
        except NotFoundError:
            await js.add_stream(wanted)
            return True
        have = info.config
        if (have.max_age, have.max_bytes, have.num_replicas) != (
            wanted.max_age,
            wanted.max_bytes,
            wanted.num_replicas,
        ):
            await js.update_stream(wanted)
        return True
    except Exception as exc:
        _log.warning("stream %s not available (%s): %s", wanted.name, exc, unavailable)
        return False
