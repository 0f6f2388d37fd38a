"""The routing bucket, typed: members, shard owners, quota books and pins (layout 2).

A thin adapter over the `KVStore` port (JetStream KV in production, `MemoryKV` in tests); the
layout and codecs are `llmgw.core.keys` and `llmgw.core.quota`. Every write is a compare-and-swap
(create-if-absent, update or delete at a revision); `CasConflict` is the one expected failure,
and each method states what it means. Reads are hints: decisions that matter are CAS.

Who writes what (docs/adr/0002-admission-at-memory-speed.md):

- a member key: only its instance (join, heartbeat, leave), and the reaper once it is long dead;
- a shard key: its owner (hand over, release), or a live instance claiming it from a dead or
  absent owner;
- a quota book: each instance changes its own entry; an adopter moves a dead instance's counts
  to itself; the reaper drops a long-dead instance's entry;
- a pin: the owner of its shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from llmgw.core.keys import (
    LAYOUT_KEY,
    MEMBER_PREFIX,
    QUOTA_PREFIX,
    SHARD_PREFIX,
    LayoutValue,
    MemberValue,
    PinValue,
    ShardValue,
    ValueFormatError,
    member_key,
    pin_shard_prefix,
    quota_key,
    shard_key,
)
from llmgw.core.quota import QuotaBook, QuotaError
from llmgw.state.kv import CasConflict, KVEntry, KVStore

__all__ = ["LayoutMismatch", "RoutingStore", "Stored"]


class LayoutMismatch(RuntimeError):
    """The bucket was laid out for another shard count (or layout version) than the config."""


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stored(Generic[T]):
    """A decoded value with the revision a CAS must name."""

    value: T
    revision: int


class RoutingStore:
    """Typed operations on the routing bucket (see the module docstring)."""

    def __init__(self, kv: KVStore) -> None:
        self.kv = kv

    # ---- layout -----------------------------------------------------------------------------

    async def ensure_layout(self, shards: int) -> None:
        """Record the shard count on first use; LayoutMismatch if the bucket has another."""
        wanted = LayoutValue(shards)
        try:
            await self.kv.create(LAYOUT_KEY, wanted.to_json())
            return
        except CasConflict:
            pass
        entry = await self.kv.get(LAYOUT_KEY)
        if entry is None:  # deleted in between: try once more
            await self.kv.create(LAYOUT_KEY, wanted.to_json())
            return
        try:
            found = LayoutValue.from_json(entry.value)
        except ValueFormatError as exc:
            raise LayoutMismatch(
                f"the routing bucket holds another layout ({exc}); use a new bucket "
                "(pinning.bucket) or delete this one"
            ) from None
        if found.shards != shards:
            raise LayoutMismatch(
                f"the routing bucket is laid out for {found.shards} shards, the config says "
                f"admission.shards={shards}; every service of a gateway must use the same value"
            )

    # ---- members ----------------------------------------------------------------------------

    async def join(self, member: MemberValue) -> int:
        """Create this instance's member key; CasConflict if the id is taken."""
        return await self.kv.create(member_key(member.instance), member.to_json())

    async def renew_member(self, member: MemberValue, revision: int) -> int | None:
        """Heartbeat; None when the key is no longer at `revision` (declared dead: re-join)."""
        try:
            return await self.kv.update(member_key(member.instance), member.to_json(), revision)
        except CasConflict:
            return None

    async def leave(self, instance: str, revision: int, joined_at: float) -> None:
        """Delete this instance's member key. `revision` is the last one its heartbeat saw
        written; a renewal cancelled in flight may have landed after it (written, but its answer
        never read), so on a conflict the key is read again and deleted at its revision if it is
        still this incarnation's (same `joined_at`). Left behind, it would make the peers keep
        a share of every quota for an instance that is gone until its TTL runs out."""
        key = member_key(instance)
        try:
            await self.kv.delete(key, revision)
            return
        except CasConflict:
            pass
        entry = await self.kv.get(key)
        if entry is None:
            return
        try:
            found = MemberValue.from_json(entry.value)
        except ValueFormatError:
            return
        if found.joined_at == joined_at:
            with contextlib.suppress(CasConflict):
                await self.kv.delete(key, entry.revision)

    async def members(self) -> list[Stored[MemberValue]]:
        return _decoded(await self.kv.list(MEMBER_PREFIX), MemberValue.from_json)

    async def remove_member(self, instance: str, revision: int) -> bool:
        """The reaper: delete a dead member's key at the revision it read."""
        try:
            await self.kv.delete(member_key(instance), revision)
        except CasConflict:
            return False
        return True

    # ---- shards -----------------------------------------------------------------------------

    async def shard_owners(self) -> dict[int, Stored[ShardValue]]:
        owners = {}
        for entry in await self.kv.list(SHARD_PREFIX):
            try:
                shard = int(entry.key[len(SHARD_PREFIX) :])
                owners[shard] = Stored(ShardValue.from_json(entry.value), entry.revision)
            except (ValueError, ValueFormatError):
                continue
        return owners

    async def shard(self, shard: int) -> Stored[ShardValue] | None:
        entry = await self.kv.get(shard_key(shard))
        if entry is None:
            return None
        try:
            return Stored(ShardValue.from_json(entry.value), entry.revision)
        except ValueFormatError:
            return None

    async def set_shard(self, shard: int, value: ShardValue, revision: int | None) -> int | None:
        """Write the shard's owner from `revision` (None: the key must not exist); None if the
        shard changed meanwhile (somebody else claimed or handed it)."""
        try:
            if revision is None:
                return await self.kv.create(shard_key(shard), value.to_json())
            return await self.kv.update(shard_key(shard), value.to_json(), revision)
        except CasConflict:
            return None

    # ---- quotas -----------------------------------------------------------------------------

    async def quota_book(self, provider: str, model: str) -> Stored[QuotaBook]:
        """The pair's book (an empty one at revision 0 when none was written yet)."""
        entry = await self.kv.get(quota_key(provider, model))
        if entry is None:
            return Stored(QuotaBook(provider, model), 0)
        return Stored(QuotaBook.from_json(entry.value), entry.revision)

    async def write_quota_book(self, book: QuotaBook, revision: int) -> int | None:
        """CAS the book from `revision` (0: create); None on a conflict (re-read, recompute)."""
        key = quota_key(book.provider, book.model)
        try:
            if revision == 0:
                return await self.kv.create(key, book.to_json())
            return await self.kv.update(key, book.to_json(), revision)
        except CasConflict:
            return None

    # ---- pins -------------------------------------------------------------------------------

    async def create_pin(self, key: str, pin: PinValue) -> int:
        """CasConflict when the key holds a pin already."""
        return await self.kv.create(key, pin.to_json())

    async def update_pin(self, key: str, pin: PinValue, revision: int) -> int:
        return await self.kv.update(key, pin.to_json(), revision)

    async def delete_pin(self, key: str, revision: int) -> int:
        return await self.kv.delete(key, revision)

    async def get_pin(self, key: str) -> Stored[PinValue] | None:
        entry = await self.kv.get(key)
        if entry is None:
            return None
        return Stored(PinValue.from_json(entry.value), entry.revision)

    async def shard_pins(self, shard: int) -> list[tuple[str, Stored[PinValue]]]:
        """Every pin of a shard (a filtered read: other shards' pins are not transferred)."""
        result = []
        for entry in await self.kv.list(pin_shard_prefix(shard)):
            try:
                result.append((entry.key, Stored(PinValue.from_json(entry.value), entry.revision)))
            except ValueFormatError:
                continue
        return result

    async def all_pins(self) -> list[tuple[str, Stored[PinValue]]]:
        result = []
        for entry in await self.kv.list("pin."):
            try:
                result.append((entry.key, Stored(PinValue.from_json(entry.value), entry.revision)))
            except ValueFormatError:
                continue
        return result

    async def quota_books(self) -> list[Stored[QuotaBook]]:
        books = []
        for entry in await self.kv.list(QUOTA_PREFIX):
            try:
                books.append(Stored(QuotaBook.from_json(entry.value), entry.revision))
            except QuotaError:
                continue
        return books

    def watch(self, prefix: str) -> AsyncGenerator[KVEntry, None]:
        return self.kv.watch(prefix)


def _decoded(entries: Sequence[KVEntry], decode: Any) -> list[Stored[Any]]:
    result = []
    for entry in entries:
        try:
            result.append(Stored(decode(entry.value), entry.revision))
        except ValueFormatError:
            continue
    return result
