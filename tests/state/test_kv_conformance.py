"""One contract, every KVStore: MemoryKV and NatsKV on a real nats-server run the same cases."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from llmgw.state import CasConflict, KVEntry, KVStore

WAIT = 5.0  # seconds; a bound on a single awaited event, never a sleep


async def _next(watch: AsyncIterator[KVEntry]) -> KVEntry:
    async with asyncio.timeout(WAIT):
        return await anext(watch)


async def test_create_stores_a_value_readable_by_get(kv_store: KVStore) -> None:
    revision = await kv_store.create("pin.a.s1", b"one")
    entry = await kv_store.get("pin.a.s1")
    assert entry is not None
    assert (entry.key, entry.value, entry.revision, entry.deleted) == (
        "pin.a.s1",
        b"one",
        revision,
        False,
    )
    assert revision > 0


async def test_create_conflicts_when_the_key_exists(kv_store: KVStore) -> None:
    revision = await kv_store.create("pin.a.s1", b"first")
    with pytest.raises(CasConflict):
        await kv_store.create("pin.a.s1", b"second")
    entry = await kv_store.get("pin.a.s1")
    assert entry is not None and (entry.value, entry.revision) == (b"first", revision)


async def test_create_succeeds_over_a_deleted_key(kv_store: KVStore) -> None:
    revision = await kv_store.create("pin.a.s1", b"first")
    deleted_at = await kv_store.delete("pin.a.s1", revision)
    recreated = await kv_store.create("pin.a.s1", b"again")
    assert revision < deleted_at < recreated
    entry = await kv_store.get("pin.a.s1")
    assert entry is not None and (entry.value, entry.revision) == (b"again", recreated)
    with pytest.raises(CasConflict):
        await kv_store.create("pin.a.s1", b"third")


async def test_update_at_the_current_revision_succeeds(kv_store: KVStore) -> None:
    first = await kv_store.create("lease.p.m.0", b"free")
    second = await kv_store.update("lease.p.m.0", b"taken", first)
    third = await kv_store.update("lease.p.m.0", b"free", second)
    assert first < second < third
    entry = await kv_store.get("lease.p.m.0")
    assert entry is not None and (entry.value, entry.revision) == (b"free", third)


async def test_update_at_a_stale_revision_conflicts_and_changes_nothing(kv_store: KVStore) -> None:
    first = await kv_store.create("lease.p.m.0", b"free")
    second = await kv_store.update("lease.p.m.0", b"taken-by-a", first)
    with pytest.raises(CasConflict) as caught:
        await kv_store.update("lease.p.m.0", b"taken-by-b", first)
    assert caught.value.key == "lease.p.m.0"
    entry = await kv_store.get("lease.p.m.0")
    assert entry is not None and (entry.value, entry.revision) == (b"taken-by-a", second)


async def test_update_of_a_missing_key_conflicts(kv_store: KVStore) -> None:
    other = await kv_store.create("lease.p.m.1", b"x")
    with pytest.raises(CasConflict):
        await kv_store.update("lease.p.m.0", b"y", other)
    assert await kv_store.get("lease.p.m.0") is None


@pytest.mark.parametrize("revision", [0, -1])
async def test_conditional_writes_reject_a_non_positive_revision(
    kv_store: KVStore, revision: int
) -> None:
    with pytest.raises(ValueError, match="revision"):
        await kv_store.update("lease.p.m.0", b"x", revision)
    with pytest.raises(ValueError, match="revision"):
        await kv_store.delete("lease.p.m.0", revision)


async def test_delete_at_the_current_revision_hides_the_key(kv_store: KVStore) -> None:
    revision = await kv_store.create("pin.a.s1", b"v")
    deleted_at = await kv_store.delete("pin.a.s1", revision)
    assert deleted_at > revision
    assert await kv_store.get("pin.a.s1") is None


async def test_delete_at_a_stale_revision_conflicts_and_keeps_the_key(kv_store: KVStore) -> None:
    first = await kv_store.create("pin.a.s1", b"v1")
    second = await kv_store.update("pin.a.s1", b"v2", first)
    with pytest.raises(CasConflict):
        await kv_store.delete("pin.a.s1", first)
    entry = await kv_store.get("pin.a.s1")
    assert entry is not None and (entry.value, entry.revision) == (b"v2", second)


async def test_delete_of_an_already_deleted_key_at_a_stale_revision_conflicts(
    kv_store: KVStore,
) -> None:
    first = await kv_store.create("pin.a.s1", b"v1")
    await kv_store.delete("pin.a.s1", first)
    with pytest.raises(CasConflict):
        await kv_store.delete("pin.a.s1", first)


async def test_get_of_a_missing_key_is_none(kv_store: KVStore) -> None:
    assert await kv_store.get("pin.a.never") is None


async def test_put_writes_unconditionally(kv_store: KVStore) -> None:
    first = await kv_store.put("lease.p.m.0", b"a")
    second = await kv_store.put("lease.p.m.0", b"b")
    assert second > first
    entry = await kv_store.get("lease.p.m.0")
    assert entry is not None and entry.value == b"b"


@pytest.mark.parametrize("key", ["", "a..b", ".a", "a.", "a b", "a.*", "a.>"])
async def test_invalid_keys_are_rejected_before_any_write(kv_store: KVStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid key"):
        await kv_store.create(key, b"x")
    with pytest.raises(ValueError, match="invalid key"):
        await kv_store.get(key)


async def test_list_returns_live_entries_under_a_prefix_in_revision_order(
    kv_store: KVStore,
) -> None:
    await kv_store.create("lease.iris.m1.0", b"a")
    r1 = await kv_store.create("lease.iris.m1.1", b"b")
    await kv_store.create("lease.irisx.m1.0", b"c")
    gone = await kv_store.create("lease.iris.m2.0", b"d")
    await kv_store.delete("lease.iris.m2.0", gone)
    await kv_store.create("pin.m1.s1", b"e")
    r1b = await kv_store.update("lease.iris.m1.1", b"b2", r1)

    listed = await kv_store.list("lease.iris.")
    assert [(e.key, e.value) for e in listed] == [
        ("lease.iris.m1.0", b"a"),
        ("lease.iris.m1.1", b"b2"),
    ]
    assert listed[1].revision == r1b
    assert [e.revision for e in listed] == sorted(e.revision for e in listed)

    assert [e.key for e in await kv_store.list("lease.iri")] == [
        "lease.iris.m1.0",
        "lease.irisx.m1.0",
        "lease.iris.m1.1",
    ]
    assert {e.key for e in await kv_store.list("")} == {
        "lease.iris.m1.0",
        "lease.iris.m1.1",
        "lease.irisx.m1.0",
        "pin.m1.s1",
    }
    assert await kv_store.list("pslot.") == []


async def test_watch_yields_current_values_then_live_changes_in_order(kv_store: KVStore) -> None:
    a = await kv_store.create("pin.m.a", b"a1")
    gone = await kv_store.create("pin.m.gone", b"x")
    await kv_store.delete("pin.m.gone", gone)
    await kv_store.create("pslot.p.m.0", b"not under the prefix")
    b = await kv_store.create("pin.m.b", b"b1")

    async with contextlib.aclosing(kv_store.watch("pin.m.")) as watch:
        initial = [await _next(watch), await _next(watch)]
        assert [(e.key, e.value, e.revision, e.deleted) for e in initial] == [
            ("pin.m.a", b"a1", a, False),
            ("pin.m.b", b"b1", b, False),
        ]

        a2 = await kv_store.update("pin.m.a", b"a2", a)
        await kv_store.put("pslot.p.m.0", b"still not under the prefix")
        c = await kv_store.create("pin.m.c", b"c1")
        b_deleted = await kv_store.delete("pin.m.b", b)

        live = [await _next(watch) for _ in range(3)]
        assert [(e.key, e.value, e.revision, e.deleted) for e in live] == [
            ("pin.m.a", b"a2", a2, False),
            ("pin.m.c", b"c1", c, False),
            ("pin.m.b", b"", b_deleted, True),
        ]


async def test_watch_on_an_empty_prefix_sees_the_first_write(kv_store: KVStore) -> None:
    async with contextlib.aclosing(kv_store.watch("pin.m.")) as watch:
        first = asyncio.ensure_future(_next(watch))
        # The watch starts when first iterated; write until it has certainly started.
        revision = 0
        while not first.done():
            revision = await kv_store.put("pin.m.a", b"x")
            await asyncio.wait({first}, timeout=0.05)
        entry = first.result()
        assert entry.key == "pin.m.a" and entry.value == b"x" and entry.revision <= revision


async def test_concurrent_cas_increments_lose_no_update(kv_store: KVStore) -> None:
    tasks, increments = 8, 25
    await kv_store.create("lease.p.m.counter", b"0")
    conflicts = 0

    async def increment_many() -> None:
        nonlocal conflicts
        for _ in range(increments):
            while True:
                entry = await kv_store.get("lease.p.m.counter")
                assert entry is not None
                try:
                    await kv_store.update(
                        "lease.p.m.counter", str(int(entry.value) + 1).encode(), entry.revision
                    )
                    break
                except CasConflict:
                    conflicts += 1

    async with asyncio.timeout(30):
        await asyncio.gather(*(increment_many() for _ in range(tasks)))
    entry = await kv_store.get("lease.p.m.counter")
    assert entry is not None and int(entry.value) == tasks * increments
    assert conflicts > 0  # the tasks really interleaved


async def test_update_at_a_tombstone_revision_recreates_the_key(kv_store: KVStore) -> None:
    revision = await kv_store.create("pin.a.s1", b"v1")
    deleted_at = await kv_store.delete("pin.a.s1", revision)
    recreated = await kv_store.update("pin.a.s1", b"v2", deleted_at)
    entry = await kv_store.get("pin.a.s1")
    assert entry is not None and (entry.value, entry.revision) == (b"v2", recreated)
