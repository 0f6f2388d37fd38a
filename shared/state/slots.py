"""A watch-fed, in-process mirror of slot keys: which slots are taken, at which revision, by whom.

The mirror is a hint, never the truth. It exists so that taking a slot is one CAS from the
revision the mirror believes current, instead of a read per attempt or blind attempts over
indices; a stale entry only costs one CAS conflict (the caller then refreshes that key). Nothing
is decided from the mirror alone except "no slot looks free": a stale mirror can therefore turn
away a request that a slot freed a moment ago could have taken (under-admission, the safe
direction), never over-admit.

One `SlotFamily` per slot prefix (`pslot.<provider>.<mk>.` or `lease.<provider>.<mk>.`). Writes
are applied only if newer than what the family already holds for that index, so the watch, the
initial listing and the owner's own successful writes (`note`) can arrive in any order.

Ownership: one mirror per RoutingState, on one event loop. `start()` lists every family (so the
mirror is complete when it returns) and then keeps one watch task per family; `close()` stops
them. A failed watch is restarted after a short pause; until then the mirror only ages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable

from llmgw.state.kv import KVEntry, KVStore

__all__ = ["SlotFamily", "SlotMirror"]

_log = logging.getLogger(__name__)
_WATCH_RETRY_PAUSE = 0.5  # seconds between attempts to re-open a failed watch


class SlotFamily:
    """The mirrored slots under one prefix: indices [0, size).

    `owner_field` names the value field identifying the holder ("pin_id" for pin slots,
    "lease_id" for lease slots). Indices never written are free at revision 0 (take by create).
    """

    __slots__ = ("_owners", "_revisions", "owner_field", "prefix", "size", "taken")

    def __init__(self, prefix: str, size: int, owner_field: str) -> None:
        self.prefix = prefix
        self.size = size
        self.owner_field = owner_field
        self.taken: set[int] = set()
        self._revisions: dict[int, int] = {}
        self._owners: dict[int, str | None] = {}

    def key(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def revision(self, index: int) -> int:
        """Revision of the last write the mirror saw for `index`; 0 if none (or deleted)."""
        return self._revisions.get(index, 0)

    def owner(self, index: int) -> str | None:
        """The holder id of a slot the mirror believes taken, else None."""
        return self._owners.get(index) if index in self.taken else None

    def note(self, index: int, revision: int, owner: str | None, *, taken: bool) -> None:
        """Record a write to `index` if it is newer than the one held (idempotent)."""
        if revision <= self._revisions.get(index, 0) and revision != 0:
            return
        if revision == 0:  # a delete: the key is gone, the next take is a create
            self._revisions.pop(index, None)
        else:
            self._revisions[index] = revision
        if taken:
            self.taken.add(index)
            self._owners[index] = owner
        else:
            self.taken.discard(index)
            self._owners.pop(index, None)

    def observe(self, index: int, entry: KVEntry) -> None:
        if entry.deleted:
            if entry.revision > self._revisions.get(index, 0):
                self.note(index, 0, None, taken=False)
            return
        taken, owner = _slot_state(entry.value, self.owner_field)
        self.note(index, entry.revision, owner, taken=taken)


def _slot_state(raw: bytes, owner_field: str) -> tuple[bool, str | None]:
    """(taken, owner) from a slot value; an unreadable value counts as taken (the safe side)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return True, None
    if not isinstance(obj, dict):
        return True, None
    if obj.get("state") == "free":
        return False, None
    owner = obj.get(owner_field)
    return True, owner if isinstance(owner, str) else None


class SlotMirror:
    """Slot families of one KV bucket, kept current by watches (see the module docstring)."""

    def __init__(self, kv: KVStore) -> None:
        self._kv = kv
        self._families: dict[str, SlotFamily] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._revision_waiters: list[tuple[str, int, asyncio.Future[None]]] = []

    def add_family(self, prefix: str, size: int, owner_field: str) -> SlotFamily:
        if prefix in self._families:
            return self._families[prefix]
        family = SlotFamily(prefix, size, owner_field)
        self._families[prefix] = family
        return family

    def family(self, prefix: str) -> SlotFamily | None:
        return self._families.get(prefix)

    @property
    def families(self) -> Iterable[SlotFamily]:
        return self._families.values()

    def note(
        self, family: SlotFamily, index: int, revision: int, owner: str | None, *, taken: bool
    ) -> None:
        """Record a write this instance made itself (it need not wait for the watch)."""
        family.note(index, revision, owner, taken=taken)
        if self._revision_waiters:
            self._wake(family.key(index), revision)

    def observe(self, entry: KVEntry) -> None:
        """Apply one write seen by a read, a listing or a watch."""
        prefix, _, last = entry.key.rpartition(".")
        family = self._families.get(prefix + ".")
        if family is None or not last.isdigit():
            return  # not a mirrored slot (e.g. a per-lease record of a pair without limits)
        family.observe(int(last), entry)
        if self._revision_waiters:
            self._wake(entry.key, entry.revision)

    async def start(self) -> None:
        """List every family (complete on return), then follow each with a watch."""
        for family in list(self._families.values()):
            for entry in await self._kv.list(family.prefix):
                self.observe(entry)
        for family in self._families.values():
            self._tasks.append(
                asyncio.create_task(
                    self._follow(family.prefix), name=f"slot-mirror {family.prefix}"
                )
            )

    async def close(self) -> None:
        """Stop following. Cancels until each watch task is done: a cancellation that lands
        inside the NATS client's own timeout handling can be swallowed (Python 3.11), so one
        cancel is not always enough."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.5)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()

    async def _follow(self, prefix: str) -> None:
        while True:
            try:
                watch = self._kv.watch(prefix)
                try:
                    async for entry in watch:
                        self.observe(entry)
                finally:
                    aclose = getattr(watch, "aclose", None)
                    if aclose is not None:
                        await aclose()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watch died (connection lost...): the mirror ages meanwhile
                _log.warning("slot watch on %s failed; retrying", prefix, exc_info=True)
            await asyncio.sleep(_WATCH_RETRY_PAUSE)

    async def wait_until_seen(self, key: str, revision: int) -> None:
        """Return once the mirror has applied a write to `key` at `revision` or later.

        For callers (and tests) that must not act on a mirror older than a write they know of.
        Bound it with `asyncio.timeout`.
        """
        if self._seen(key, revision):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (key, revision, future)
        self._revision_waiters.append(waiter)
        try:
            await future
        finally:
            self._revision_waiters.remove(waiter)

    def _seen(self, key: str, revision: int) -> bool:
        prefix, _, last = key.rpartition(".")
        family = self._families.get(prefix + ".")
        if family is None or not last.isdigit():
            raise ValueError(f"{key!r} is not a mirrored slot key")
        return family.revision(int(last)) >= revision

    def _wake(self, key: str, revision: int) -> None:
        for waiter_key, wanted, future in self._revision_waiters:
            if waiter_key == key and revision >= wanted and not future.done():
                future.set_result(None)
