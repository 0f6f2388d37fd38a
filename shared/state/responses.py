"""The response store: every response the gateway served with ``store: true``, by id.

One JetStream KV bucket (`responses.bucket`) whose entries expire `responses.retention` after
they were written (the bucket's max age), one entry per response (`llmgw.core.responses.
StoredResponse`: owner digest, root of its chain, previous response, this turn's input items,
the response object, and every earlier response of the chain by id, so `chain` sends the reads
of a whole chain at once). Any `KVStore` serves (`MemoryKV` in tests of the HTTP layer).

Writes leave the client's critical path: `save` starts the write (one KV put) and returns.

Reads see every write, wherever it was made (read-your-writes across edges):

- each edge keeps the records it wrote and read lately (`RecentResponses`, up to
  `responses.cache_bytes`): a chain continued on the edge that served its last turn is read
  from memory, with no KV read at all. Records never change; a delete removes the record from
  every edge's memory (`llmgw.v1.responses.deleted`, and all of it when the edge's NATS
  connection was re-established: deletes may have been missed meanwhile);
- a record whose write is still in flight is found at once on its own edge, which waits for
  that write to land (at most ``nats.request_timeout``; a write that failed is not found);
- an edge that finds an id neither in memory nor in the bucket asks the edge that wrote it:
  every id starts with its writer's token (`llmgw.core.responses.writer_of`, random per edge
  process), and each edge answers on ``llmgw.v1.responses.ask.<token>`` with the record once
  its write has landed (or nothing: not one of its responses). So a client that gets a response
  from one edge and names it at once on another finds it. The wait is bounded: an edge gone
  since has no subscription (NATS answers "no responders" at once), a silent one times out
  after ``nats.request_timeout``; either way the bucket is read once more, then the id is
  unknown (404).

A record larger than the server's largest message (`max_value_bytes`; nats-server's
``max_payload``, 1 MiB unless configured) is not stored: the response was served, its chain
ends there (the next turn naming it gets 404). `on_result` hears how each write went:
``stored``, ``too_large`` or ``failed`` (the edge counts them: llmgw_edge_responses_stored_total).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.responses import RESPONSE_ID_PATTERN, WRITER_DIGITS, StoredResponse, writer_of
from llmgw.wire import RESPONSES_ASK_PREFIX, RESPONSES_DELETED_SUBJECT

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from llmgw.config.schema import Config
    from llmgw.state.kv import KVStore

__all__ = ["RecentResponses", "ResponseStore", "open_response_store"]

log = logging.getLogger("llmgw.responses")

_RECORD_OVERHEAD = 1024  # room for the message's subject and headers within max_payload


class RecentResponses:
    """The records an edge wrote or read lately, least recently used out first once their
    encoded sizes pass `max_bytes` (0: keeps nothing). Pure: no I/O, no clock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def put(self, stored: StoredResponse, size: int) -> None:
        if size > self.max_bytes:
            return
        self.drop(stored.id)
        self._entries[stored.id] = (stored, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, oldest) = self._entries.popitem(last=False)
            self.bytes -= oldest

    def drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry[1]

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


class ResponseStore:
    """Stored responses over a KVStore (see the module docstring). Without `connect`, the
    store is this process's alone (no other edge to ask or to tell)."""

    def __init__(
        self,
        kv: KVStore,
        *,
        max_value_bytes: int = 1024 * 1024,
        cache_bytes: int = 64 * 1024 * 1024,
        retention: float = 30 * 24 * 3600.0,
        wait: float = 1.0,
        writer: str | None = None,
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.kv = kv
        self.max_value_bytes = max_value_bytes - _RECORD_OVERHEAD
        self.recent = RecentResponses(cache_bytes)
        self.retention = retention
        self.wait = wait  # bounds a write, and a read's wait for one
        self.writer = writer or f"{random.getrandbits(4 * WRITER_DIGITS):0{WRITER_DIGITS}x}"
        self.clock = wall_of(clock)
        self.on_result: Callable[[str], None] = lambda result: None
        # Writes in flight by id: each future says whether its write landed.
        self.pending: dict[str, asyncio.Future[bool]] = {}
        self._writes: set[asyncio.Task[None]] = set()
        self._answers: set[asyncio.Task[None]] = set()
        self._nc: NATS | None = None
        self._subs: list[Any] = []
        self._reconnects = 0
        self._acks: str | None = None  # the subject prefix of this store's write acks
        self._key_subject = ""
        self._acked: dict[str, asyncio.Future[bytes]] = {}
        self._ack_seq = 0

    # -- writes ---------------------------------------------------------------------------

    def save(self, stored: StoredResponse, response_json: bytes | None = None) -> None:
        """Write `stored` in the background (readable here at once). `response_json`: its
        response object, already encoded (the client's body)."""
        value = stored.encode(response_json)
        if len(value) > self.max_value_bytes:
            self.on_result("too_large")
            log.warning(
                "response %s not stored: %d bytes exceed the store's %d",
                stored.id,
                len(value),
                self.max_value_bytes,
            )
            return
        landed = asyncio.get_running_loop().create_future()
        self.pending[stored.id] = landed
        self.recent.put(stored, len(value))
        task = asyncio.ensure_future(self._write(stored.id, value, landed))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, response_id: str, value: bytes, landed: asyncio.Future[bool]) -> None:
        ok = False
        try:
            async with asyncio.timeout(self.wait):
                await self._put(response_id, value)
            ok = True
        except Exception as exc:  # the response was served; only its chain is lost
            self.on_result("failed")
            log.warning("response %s not stored: %r", response_id, exc)
            self.recent.drop(response_id)
        else:
            self.on_result("stored")
        finally:
            self.pending.pop(response_id, None)
            if not landed.done():
                landed.set_result(ok)

    async def _put(self, response_id: str, value: bytes) -> None:
        """The KV put: on NATS, a publish on the key's subject whose ack comes back on this
        store's own subscription (JetStream's publish call adds a request's bookkeeping and
        parses the ack into objects: about twice the edge's CPU per write)."""
        if self._nc is None or self._acks is None:
            await self.kv.put(response_id, value)
            return
        self._ack_seq += 1
        token = str(self._ack_seq)
        acked: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._acked[token] = acked
        try:
            await self._nc.publish(self._key_subject + response_id, value, reply=self._acks + token)
            answer = await acked
        finally:
            self._acked.pop(token, None)
        if not answer or b'"error"' in answer:  # empty: no stream answered (no responders)
            raise RuntimeError(f"the bucket refused the write: {answer[:200]!r}")

    async def _on_ack(self, msg: Msg) -> None:
        acked = self._acked.get(msg.subject.rpartition(".")[2])
        if acked is not None and not acked.done():
            acked.set_result(msg.data)

    async def _landed(self, response_id: str) -> bool:
        """False when `response_id`'s write (in flight here) did not land within `wait`."""
        landed = self.pending.get(response_id)
        if landed is None:
            return True
        try:
            return await asyncio.wait_for(asyncio.shield(landed), self.wait)
        except TimeoutError:
            return False

    # -- reads ----------------------------------------------------------------------------

    def _remembered(self, response_id: str) -> StoredResponse | None:
        if self._nc is not None and self._nc.stats["reconnects"] != self._reconnects:
            # Deletes told while this edge was away from NATS are lost: forget them all.
            self._reconnects = self._nc.stats["reconnects"]
            self.recent.clear()
        stored = self.recent.get(response_id)
        if stored is not None and stored.created_at + self.retention < self.clock():
            self.recent.drop(response_id)  # the bucket has let it expire
            return None
        return stored

    def _held(self, response_id: str) -> StoredResponse | None:
        """The record from memory if its write (made here) is not in flight."""
        return None if response_id in self.pending else self._remembered(response_id)

    async def get(self, response_id: str, *, remembered: bool = True) -> StoredResponse | None:
        """The stored response, or None (unknown, expired, deleted, or not an id of ours).
        `remembered=False` reads the bucket even when this edge holds the record."""
        if not RESPONSE_ID_PATTERN.match(response_id) or not await self._landed(response_id):
            return None
        if remembered and (stored := self._remembered(response_id)) is not None:
            return stored
        found = await self._read(response_id)
        if found is None and writer_of(response_id) != self.writer and self._nc is not None:
            found = await self._ask(response_id)
            if found is None:  # its write may have landed since the first read
                found = await self._read(response_id)
        if found is None:
            return None
        stored, size = found
        self.recent.put(stored, size)
        return stored

    async def _read(self, response_id: str) -> tuple[StoredResponse, int] | None:
        """The bucket's record (raises TimeoutError after `wait`: the bucket is unreachable)."""
        async with asyncio.timeout(self.wait):
            entry = await self.kv.get(response_id)
        return None if entry is None else _decoded(response_id, entry.value)

    @property
    def read_bound(self) -> float:
        """The longest a `get` takes: its write in flight here, a read, an ask, a read."""
        return 4 * self.wait

    def held_chain(self, response_id: str) -> list[StoredResponse] | None:
        """The chain ending with `response_id` (oldest first) if this edge holds all of it, its
        writes landed: no read, no wait. None: ask `get` and `chain`."""
        head = self._held(response_id) if RESPONSE_ID_PATTERN.match(response_id) else None
        if head is None or not head.ancestors or head.previous != head.ancestors[-1]:
            return None if head is None or head.previous is not None else [head]
        found = [self._held(rid) for rid in head.ancestors]
        chain = [stored for stored in found if stored is not None]
        if len(chain) < len(found):
            return None
        chain.append(head)
        return chain if _linked(chain) else None

    async def chain(self, head: StoredResponse, limit: int = 10_000) -> list[StoredResponse] | None:
        """Every response of `head`'s chain, oldest first, or None when one is missing. The
        reads of a record that names its ancestors go out at once (one round trip's wait)."""
        if head.ancestors and head.previous == head.ancestors[-1]:
            found = [self._held(rid) for rid in head.ancestors]
            missing = [i for i, stored in enumerate(found) if stored is None]
            if missing:
                read = await asyncio.gather(*(self.get(head.ancestors[i]) for i in missing))
                for i, stored in zip(missing, read, strict=True):
                    found[i] = stored
            earlier = [stored for stored in found if stored is not None]
            linked = len(earlier) == len(found) and _linked(earlier)
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
        """Delete a stored response (here, in the bucket, and in every edge's memory); False
        when there was none."""
        if not RESPONSE_ID_PATTERN.match(response_id):
            return False
        await self._landed(response_id)  # a write in flight: delete what it wrote
        self.recent.drop(response_id)
        entry = await self.kv.get(response_id)
        if entry is None:
            return False
        await self.kv.delete(response_id, entry.revision)
        if self._nc is not None:
            await self._nc.publish(RESPONSES_DELETED_SUBJECT, response_id.encode())
        return True

    # -- the other edges ------------------------------------------------------------------

    async def connect(self, nc: NATS) -> None:
        """Answer the other edges' asks for the responses written here, ask theirs, and hear
        their deletes."""
        self._nc = nc
        self._reconnects = nc.stats["reconnects"]
        self._subs = [
            await nc.subscribe(RESPONSES_ASK_PREFIX + self.writer, cb=self._on_ask),
            await nc.subscribe(RESPONSES_DELETED_SUBJECT, cb=self._on_deleted),
        ]
        bucket = getattr(self.kv, "bucket", None)  # a JetStream bucket (NatsKV): lean writes
        if bucket is not None:
            self._acks = nc.new_inbox() + "."
            self._key_subject = f"$KV.{bucket}."
            self._subs.append(await nc.subscribe(self._acks + "*", cb=self._on_ack))
        await nc.flush()

    async def _ask(self, response_id: str) -> tuple[StoredResponse, int] | None:
        assert self._nc is not None
        try:
            reply = await self._nc.request(
                RESPONSES_ASK_PREFIX + writer_of(response_id),
                response_id.encode(),
                timeout=self.wait,
            )
        except Exception as exc:  # no responders (its edge is gone), or a timeout
            log.debug("response %s: its writer did not answer: %r", response_id, exc)
            return None
        return _decoded(response_id, reply.data) if reply.data else None

    async def _on_ask(self, msg: Msg) -> None:
        task = asyncio.ensure_future(self._answer(msg))  # answers do not wait on one another
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    async def _answer(self, msg: Msg) -> None:
        """The record once its write has landed, from memory; else nothing (the asker reads
        the bucket again)."""
        response_id = msg.data.decode(errors="replace")
        stored = None
        if RESPONSE_ID_PATTERN.match(response_id) and await self._landed(response_id):
            stored = self._remembered(response_id)
        with contextlib.suppress(Exception):  # the asker may be gone: it reads the bucket
            await msg.respond(stored.encode() if stored is not None else b"")

    async def _on_deleted(self, msg: Msg) -> None:
        self.recent.drop(msg.data.decode(errors="replace"))

    async def close(self) -> None:
        """Wait for the writes in flight (and the answers they hold up), then stop answering."""
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        if self._answers:
            await asyncio.gather(*list(self._answers), return_exceptions=True)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []


def _linked(chain: list[StoredResponse]) -> bool:
    """Whether each response of `chain` names the one before it (the first: none)."""
    return all(
        stored.previous == (chain[i - 1].id if i else None) for i, stored in enumerate(chain)
    )


def _decoded(response_id: str, raw: bytes) -> tuple[StoredResponse, int] | None:
    """The record `raw` holds if it is `response_id`'s, with its size."""
    try:
        stored = StoredResponse.decode(raw)
    except (ValueError, KeyError, TypeError):
        log.warning("stored response %s does not decode; treated as missing", response_id)
        return None
    return (stored, len(raw)) if stored.id == response_id else None


async def open_response_store(
    nc: NATS, config: Config, clock: Clock | TimeSource = SYSTEM
) -> ResponseStore:
    """The response bucket (file storage, created on first use with `responses.retention` as its
    max age; an existing bucket keeps its own, with a warning when it differs), answering and
    asking the other edges on `nc`."""
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
    store = ResponseStore(
        kv,
        max_value_bytes=getattr(nc, "max_payload", None) or 1024 * 1024,
        cache_bytes=settings.cache_bytes,
        retention=settings.retention,
        wait=config.nats.request_timeout,
        clock=clock,
    )
    await store.connect(nc)
    return store
