"""What only the in-memory store has: the interleaving hook and the full write history."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.state import CasConflict, KVEntry, MemoryKV


async def test_before_op_sees_every_operation_with_its_key_before_it_runs() -> None:
    calls: list[tuple[str, str, int]] = []
    store = MemoryKV()

    async def hook(op_name: str, key: str) -> None:
        calls.append((op_name, key, store.revision))

    store.before_op = hook
    revision = await store.create("pin.m.s", b"a")
    await store.update("pin.m.s", b"b", revision)
    await store.get("pin.m.s")
    await store.list("pin.")
    await store.put("lease.p.m.0", b"x")
    await store.delete("pin.m.s", revision + 1)
    assert calls == [
        ("create", "pin.m.s", 0),
        ("update", "pin.m.s", 1),
        ("get", "pin.m.s", 2),
        ("list", "pin.", 2),
        ("put", "lease.p.m.0", 2),
        ("delete", "pin.m.s", 3),
    ]


async def test_before_op_can_force_a_lost_cas_race_deterministically() -> None:
    """A reads, B reads and writes, then A's CAS fails: the interleaving is scripted, not hoped."""
    a_has_read = asyncio.Event()
    b_has_written = asyncio.Event()

    async def hook(op_name: str, key: str) -> None:
        task = asyncio.current_task()
        if task is not None and task.get_name() == "A" and op_name == "update":
            a_has_read.set()
            await b_has_written.wait()

    store = MemoryKV(before_op=hook)
    first = await store.create("lease.p.m.0", b"free")

    async def take(value: bytes) -> int:
        entry = await store.get("lease.p.m.0")
        assert entry is not None
        return await store.update("lease.p.m.0", value, entry.revision)

    a = asyncio.create_task(take(b"taken-by-a"), name="A")
    await a_has_read.wait()
    b_revision = await take(b"taken-by-b")
    b_has_written.set()
    with pytest.raises(CasConflict):
        await a
    entry = await store.get("lease.p.m.0")
    assert entry is not None and (entry.value, entry.revision) == (b"taken-by-b", b_revision)
    assert b_revision == first + 1


async def test_history_holds_every_applied_write_in_order_and_no_refused_one() -> None:
    ticks = iter(range(100, 200))
    store = MemoryKV(clock=lambda: float(next(ticks)))
    first = await store.create("pin.m.s", b"a")
    with pytest.raises(CasConflict):
        await store.create("pin.m.s", b"refused")
    second = await store.update("pin.m.s", b"b", first)
    with pytest.raises(CasConflict):
        await store.update("pin.m.s", b"refused", first)
    third = await store.delete("pin.m.s", second)
    assert store.history == [
        KVEntry("pin.m.s", b"a", first, False, 100.0),
        KVEntry("pin.m.s", b"b", second, False, 101.0),
        KVEntry("pin.m.s", b"", third, True, 102.0),
    ]
