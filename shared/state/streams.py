"""A JetStream stream a service needs, created or brought to its configured limits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nats.js.errors import APIError, NotFoundError

if TYPE_CHECKING:
    from nats.js.api import StreamConfig
    from nats.js.client import JetStreamContext

__all__ = ["ensure_stream"]

_log = logging.getLogger(__name__)

INSUFFICIENT_RESOURCES = 10047  # JetStream's err_code: the server cannot reserve what is asked


def _why(exc: Exception, wanted: StreamConfig) -> str:
    """What went wrong, with what to do when the server cannot reserve the stream's size."""
    if isinstance(exc, APIError) and exc.err_code == INSUFFICIENT_RESOURCES and wanted.max_bytes:
        return (
            f"{exc}; NATS reserves a file stream's whole max_bytes "
            f"({wanted.max_bytes // 2**20} MiB) when it creates it, from what the server may "
            "store (by default 75% of the disk space free when it started): set a smaller "
            "max_bytes, free disk space, or raise the server's jetstream max_file_store"
        )
    return str(exc)


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
        _log.warning(
            "stream %s not available (%s): %s", wanted.name, _why(exc, wanted), unavailable
        )
        return False
