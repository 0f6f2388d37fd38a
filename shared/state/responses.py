"""The response store: every response the gateway served with ``store: true``, by id.

One JetStream KV bucket (`responses.bucket`) whose entries expire `responses.retention` after
they were written (the bucket's max age), one entry per response (`llmgw.core.responses.
StoredResponse`: owner digest, root of its chain, previous response, this turn's input items,
the response object, and every earlier response of the chain by id, so `chain` sends the reads
of a whole chain at once). Any `KVStore` serves (`MemoryKV` in tests of the HTTP layer).

Writes leave the client's critical path: `save` starts the write and returns; until it has
landed, this process answers `get` for that id from memory (`pending`), so a client that sends
the next turn at once to the same edge finds its response. Another edge may miss a response
whose write is still in flight (the window is one KV write, well under a millisecond on a
local server); it then answers 404 as for any unknown id. `close` waits for writes in flight.

A record larger than the server's largest message (`max_value_bytes`; nats-server's
``max_payload``, 1 MiB unless configured) is not stored: the response was served, its chain
ends there (the next turn naming it gets 404). `on_result` hears how each write went:
``stored``, ``too_large`` or ``failed`` (the edge counts them: llmgw_edge_responses_stored_total).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.core.responses import RESPONSE_ID_PATTERN, StoredResponse

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config
    from llmgw.state.kv import KVStore

__all__ = ["ResponseStore", "open_response_store"]

log = logging.getLogger("llmgw.responses")

_RECORD_OVERHEAD = 1024  # room for the message's subject and headers within max_payload


class ResponseStore:
    """Stored responses over a KVStore (see the module docstring)."""

    def __init__(self, kv: KVStore, *, max_value_bytes: int = 1024 * 1024) -> None:
        self.kv = kv
        self.max_value_bytes = max_value_bytes - _RECORD_OVERHEAD
        self.pending: dict[str, StoredResponse] = {}
        self.on_result: Callable[[str], None] = lambda result: None
        self._writes: set[asyncio.Task[None]] = set()

    def save(self, stored: StoredResponse) -> None:
        """Write `stored` in the background (readable here at once)."""
        value = stored.encode()
        if len(value) > self.max_value_bytes:
            self.on_result("too_large")
            log.warning(
                "response %s not stored: %d bytes exceed the store's %d",
                stored.id,
                len(value),
                self.max_value_bytes,
            )
            return
        self.pending[stored.id] = stored
        task = asyncio.ensure_future(self._write(stored.id, value))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, response_id: str, value: bytes) -> None:
        try:
            await self.kv.put(response_id, value)
        except Exception as exc:  # the response was served; only its chain is lost
            self.on_result("failed")
            log.warning("response %s not stored: %s", response_id, exc)
        else:
            self.on_result("stored")
        finally:
            self.pending.pop(response_id, None)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (unknown, expired, deleted, or not an id of ours)."""
        if not RESPONSE_ID_PATTERN.match(response_id):
            return None
        pending = self.pending.get(response_id)
        if pending is not None:
            return pending
        entry = await self.kv.get(response_id)
        if entry is None:
            return None
        try:
            return StoredResponse.decode(entry.value)
        except (ValueError, KeyError, TypeError):
            log.warning("stored response %s does not decode; treated as missing", response_id)
            return None

    async def chain(self, head: StoredResponse, limit: int = 10_000) -> list[StoredResponse] | None:
        """Every response of `head`'s chain, oldest first, or None when one is missing. The
        reads of a record that names its ancestors go out at once (one round trip's wait)."""
        if head.ancestors and head.previous == head.ancestors[-1]:
            found = await asyncio.gather(*(self.get(rid) for rid in head.ancestors))
            earlier = [stored for stored in found if stored is not None]
            linked = len(earlier) == len(found) and all(
                stored.previous == (earlier[i - 1].id if i else None)
                for i, stored in enumerate(earlier)
            )
            return [*earlier, head] if linked else None
        chain = [head]
        while chain[-1].previous is not None and len(chain) < limit:
            before = await self.get(chain[-1].previous)
            if before is None:
                return None
            chain.append(before)
        chain.reverse()
        return chain

    async def delete(self, response_id: str) -> bool:
        """Delete a stored response; False when there was none."""
        pending = self.pending.get(response_id)
        if pending is not None:  # wait for its write, then delete what it wrote
            for task in list(self._writes):
                await asyncio.shield(task)
        entry = await self.kv.get(response_id) if RESPONSE_ID_PATTERN.match(response_id) else None
        if entry is None:
            return False
        await self.kv.delete(response_id, entry.revision)
        return True

    async def close(self) -> None:
        """Wait for the writes in flight."""
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)


async def open_response_store(nc: NATS, config: Config) -> ResponseStore:
    """The response bucket (file storage, created on first use with `responses.retention` as its
    max age; an existing bucket keeps its own, with a warning when it differs)."""
    from llmgw.state.nats_kv import open_routing_bucket

    settings = config.responses
    js = nc.jetstream()
    kv = await open_routing_bucket(
        js,
        settings.bucket,
        replicas=config.replicas_of(settings.bucket),
        max_age=settings.retention,
    )
    info = await js.stream_info(kv.stream)
    if abs((info.config.max_age or 0) - settings.retention) > 1:
        log.warning(
            "the response bucket %s keeps entries %.0fs, not responses.retention (%.0fs); "
            "change its max age with `nats kv` or delete the bucket",
            settings.bucket,
            info.config.max_age or 0,
            settings.retention,
        )
    return ResponseStore(kv, max_value_bytes=getattr(nc, "max_payload", None) or 1024 * 1024)
