"""Writing a shard owner's pins to the routing bucket, off the request path.

The owner's ledger is the authority on its shards' pins; the bucket holds a durable copy for the
next owner (after a handover or a crash). So a request never waits for a pin write: creating,
moving, refreshing and removing a pin are queued here, and writes to one key run one after
another in the order they were asked for (each needs the revision the previous one produced);
writes to different keys run concurrently. The last value asked for is what the key ends with.

A write that conflicts (the key is not at the revision this writer knows) can only mean the
stored copy is stale (a previous owner's late write, a lost acknowledgement): the owner reads
the key and writes its own value over it. A write that fails for another reason (NATS
unreachable, the bucket's stream electing a leader) leaves the key's revision unknown and is
tried again every second (the newest value then; the next write reads first), for up to a
minute. What a crash loses is only durability: the session re-pins, a prefix-cache miss.

A new pin's first write waits until its session comes back (`defer`, then `used_again`): most
conversations that open and never return (one-shot requests, a Responses chain of one turn) are
evicted or expire with no write and no delete at all. A pin still unwritten after a refresh
period (`pinning.pin_inactivity_timeout` / 4) is written by the next refresh round
(`write_deferred`), and so are a shard's before it is released without a handover (`flush`);
a handover carries them in its message like every pin (the receiver defers them again).
Until then a crash loses such a pin: the session's next request pins again, placed by the
prefix index where its prefix is.

A shard this instance drops without a handover (its key names another owner, or the instance is
lost: `abandon`) belongs to someone else from then on: its writes still queued, stalled or due
for a retry are not made (a write waiting for a stalled connection would otherwise read the
next owner's copy on its conflict and write over it). Only a call already on the wire lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

from llmgw.core.keys import PinValue, pin_shard_prefix
from llmgw.state.kv import CasConflict

if TYPE_CHECKING:
    from llmgw.core.ledger import Ledger, PinRecord
    from llmgw.state.store import RoutingStore

log = logging.getLogger("llmgw.admission.pins")

_UNKNOWN = -1  # the key's revision is unknown: read before writing
_RETRY_EVERY = 1.0
_RETRIES = 60


def stored_value(pin: PinRecord) -> PinValue:
    return PinValue(
        pin.pin_id,
        pin.provider,
        pin.model,
        pin.session,
        pin.created_at,
        pin.since,
        pin.last_used,
        pin.parent,
    )


class PinWriter:
    def __init__(self, store: RoutingStore, ledger: Ledger) -> None:
        self.store = store
        self.ledger = ledger
        self._revision: dict[str, int] = {}  # key -> revision of our last write (0: none)
        self._last: dict[str, asyncio.Future[None]] = {}
        self.failures = 0
        self.overwrites = 0
        self.on_failure: Callable[[str, Exception], None] | None = None
        # Bumped by `abandon`: a write runs only while its shard's and the writer's epochs are
        # the ones it was asked under.
        self._epoch = 0
        self._shard_epoch: dict[int, int] = {}
        self.abandoned = 0  # writes not made because their shard was dropped
        # New pins whose first write waits for their session's next request (key -> since when,
        # oldest first), and how many left with none.
        self._deferred: dict[str, tuple[float, tuple[str, str]]] = {}
        self.never_written = 0

    def known(self, key: str, revision: int) -> None:
        """A pin loaded from the bucket (adoption): its current revision."""
        self._revision[key] = revision

    # ---- deferred first writes --------------------------------------------------------------

    def defer(self, pin: PinRecord, now: float) -> None:
        """A new pin (or one handed here that was never written): written once its session
        comes back (`used_again`), by a refresh round (`write_deferred`) or a release
        (`flush`), whichever comes first; removed before that, it costs no write at all."""
        self._deferred.pop(pin.key, None)  # oldest first: a key deferred again goes last
        self._deferred[pin.key] = (now, (pin.model, pin.session))

    def used_again(self, pin: PinRecord) -> None:
        """The pin's session sent another request: a deferred first write is made now."""
        if pin.key in self._deferred:
            self.put(pin)

    def write_deferred(self, older_than: float) -> int:
        """Write the deferred pins deferred before `older_than` that the ledger still holds
        (one refresh round's share); how many were written."""
        written = 0
        while self._deferred:
            key, (since, session) = next(iter(self._deferred.items()))
            if since >= older_than:
                break
            del self._deferred[key]
            pin = self.ledger.pins.get(session)
            if pin is not None and pin.key == key:
                self.put(pin)
                written += 1
        return written

    def flush(self, pins: Iterable[PinRecord]) -> None:
        """Write those of `pins` whose first write is deferred (a shard about to leave this
        ledger for the bucket only)."""
        for pin in pins:
            self.used_again(pin)

    def deferred(self) -> int:
        return len(self._deferred)

    def forget(self, key: str) -> None:
        self._revision.pop(key, None)

    def pending(self) -> int:
        return sum(1 for f in self._last.values() if not f.done())

    def abandon(self, shard: int | None = None) -> None:
        """The shard (every shard: None, the instance is lost) is no longer this instance's:
        its writes not made yet never are, and its keys' revisions are forgotten."""
        if shard is None:
            self._epoch += 1
            self._revision.clear()
            self._deferred.clear()
        else:
            self._shard_epoch[shard] = self._shard_epoch.get(shard, 0) + 1
            prefix = pin_shard_prefix(shard)
            for key in [k for k in self._revision if k.startswith(prefix)]:
                del self._revision[key]
            for key in [k for k in self._deferred if k.startswith(prefix)]:
                del self._deferred[key]

    def _ticket(self, shard: int) -> tuple[int, int, int]:
        return (shard, self._epoch, self._shard_epoch.get(shard, 0))

    def _valid(self, ticket: tuple[int, int, int]) -> bool:
        return ticket == self._ticket(ticket[0])

    # ---- what the owner asks for ------------------------------------------------------------

    def put(self, pin: PinRecord) -> None:
        """Store the pin's current value (a move, a refresh, a deferred first write)."""
        self._deferred.pop(pin.key, None)
        ticket = self._ticket(pin.shard)
        self._chain(
            pin.key, ticket, self._put(pin.key, stored_value(pin), ticket), self._again(pin, False)
        )

    def delete(self, pin: PinRecord) -> None:
        if self._deferred.pop(pin.key, None) is not None and pin.key not in self._last:
            self.never_written += 1  # never written (nor queued): nothing to delete
            return
        ticket = self._ticket(pin.shard)
        self._chain(pin.key, ticket, self._delete(pin.key, ticket), self._again(pin, True))

    def _again(self, pin: PinRecord, deleting: bool, attempt: int = 1) -> Callable[[], None]:
        """What to do after a failed write: try once more a second later, with what the
        ledger holds then (a later write for the key supersedes this one)."""

        ticket = self._ticket(pin.shard)

        def retry() -> None:
            if attempt > _RETRIES or pin.key in self._last or not self._valid(ticket):
                return  # gave up, a newer write for the key is queued, or the shard is gone
            current = self.ledger.pins.get((pin.model, pin.session))
            if deleting and current is None:
                self._chain(
                    pin.key,
                    ticket,
                    self._delete(pin.key, ticket),
                    self._again(pin, True, attempt + 1),
                )
            elif not deleting and current is not None and current.key == pin.key:
                self._chain(
                    pin.key,
                    ticket,
                    self._put(pin.key, stored_value(current), ticket),
                    self._again(current, False, attempt + 1),
                )

        def later() -> None:
            asyncio.get_running_loop().call_later(_RETRY_EVERY, retry)

        return later

    async def drain(self, keys: list[str] | None = None, timeout: float = 5.0) -> None:
        """Wait for queued writes (of `keys`, or all) to land, at most `timeout` seconds."""
        waiting = [f for k, f in self._last.items() if keys is None or k in keys]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

    # ---- the writes -------------------------------------------------------------------------

    def _chain(
        self,
        key: str,
        ticket: tuple[int, int, int],
        write: Coroutine[Any, Any, None],
        on_failure: Callable[[], None],
    ) -> None:
        previous = self._last.get(key)

        async def run() -> None:
            if previous is not None and not previous.done():
                with contextlib.suppress(Exception):
                    await asyncio.shield(previous)
            if not self._valid(ticket):
                write.close()
                self.abandoned += 1
                return
            try:
                await write
            except _Abandoned:
                self.abandoned += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._valid(ticket):
                    self.abandoned += 1
                    return
                self.failures += 1
                self._revision[key] = _UNKNOWN
                log.warning("pin %s not written (trying again): %s", key, exc)
                if self.on_failure is not None:
                    self.on_failure(key, exc)
                on_failure()

        future = asyncio.ensure_future(run())
        self._last[key] = future
        future.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: str, future: asyncio.Future[None]) -> None:
        if self._last.get(key) is future:
            del self._last[key]

    def _still(self, ticket: tuple[int, int, int]) -> None:
        """Before each call to the bucket: stop if the shard was dropped meanwhile."""
        if not self._valid(ticket):
            raise _Abandoned

    async def _current(self, key: str, ticket: tuple[int, int, int]) -> int:
        """The revision to write at: ours, or (unknown) what the key holds now (0: absent)."""
        revision = self._revision.get(key, 0)
        if revision != _UNKNOWN:
            return revision
        stored = await self.store.get_pin(key)
        self._still(ticket)
        return 0 if stored is None else stored.revision

    async def _put(self, key: str, value: PinValue, ticket: tuple[int, int, int]) -> None:
        revision = await self._current(key, ticket)
        try:
            if revision == 0:
                written = await self.store.create_pin(key, value)
            else:
                written = await self.store.update_pin(key, value, revision)
        except CasConflict:
            self._still(ticket)  # the next owner's copy, maybe: never written over
            self.overwrites += 1
            stored = await self.store.get_pin(key)
            self._still(ticket)
            if stored is None:
                written = await self.store.create_pin(key, value)
            else:
                written = await self.store.update_pin(key, value, stored.revision)
        self._still(ticket)
        self._revision[key] = written
        pin = self.ledger.pins.get((value.model, value.session))
        if pin is not None and pin.key == key and pin.pin_id == value.pin_id:
            pin.revision = written
            pin.stored_refreshed_at = max(pin.stored_refreshed_at, value.refreshed_at)

    async def _delete(self, key: str, ticket: tuple[int, int, int]) -> None:
        revision = await self._current(key, ticket)
        if revision == 0:
            self._revision.pop(key, None)
            return
        try:
            await self.store.delete_pin(key, revision)
        except CasConflict:
            self._still(ticket)
            stored = await self.store.get_pin(key)
            self._still(ticket)
            if stored is not None:
                await self.store.delete_pin(key, stored.revision)
        self._revision.pop(key, None)


class _Abandoned(Exception):
    """The write's shard was dropped while it waited on the bucket: it stops there."""
