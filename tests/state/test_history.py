"""History recorders: every write in order, the same shape from NATS and from memory."""

from __future__ import annotations

import contextlib

import pytest
from nats.aio.client import Client as NatsClient

from llmgw.state import (
    CasConflict,
    HistoryIncomplete,
    HistoryRecorder,
    KVEntry,
    KVStore,
    MemoryHistory,
    MemoryKV,
    NatsKV,
    open_routing_bucket,
)


async def _script(store: KVStore) -> None:
    """Writes, refused writes and deletes; the history must show exactly the applied ones."""
    pin = await store.create("pin.m.s", b"p1")
    slot = await store.create("lease.p.m.0", b"free")
    slot = await store.update("lease.p.m.0", b"taken", slot)
    with contextlib.suppress(CasConflict):
        await store.update("lease.p.m.0", b"stale", slot - 1)
    with contextlib.suppress(CasConflict):
        await store.create("pin.m.s", b"dup")
    await store.update("lease.p.m.0", b"free", slot)
    await store.delete("pin.m.s", pin)
    await store.create("pin.m.s", b"p2")


def _shape(entries: list[KVEntry]) -> list[tuple[str, bytes, bool]]:
    return [(e.key, e.value, e.deleted) for e in entries]


async def test_recorder_and_memory_history_agree_on_the_same_script(
    nats_client: NatsClient, routing_bucket: NatsKV
) -> None:
    async with HistoryRecorder(nats_client.jetstream(), routing_bucket.bucket) as recorder:
        await _script(routing_bucket)
        recorded = await recorder.sync()
    memory = MemoryKV()
    await _script(memory)
    expected = await MemoryHistory(memory).sync()

    assert (
        _shape(recorded)
        == _shape(expected)
        == [
            ("pin.m.s", b"p1", False),
            ("lease.p.m.0", b"free", False),
            ("lease.p.m.0", b"taken", False),
            ("lease.p.m.0", b"free", False),
            ("pin.m.s", b"", True),
            ("pin.m.s", b"p2", False),
        ]
    )
    assert [e.revision for e in recorded] == list(range(1, 7))
    assert all(e.timestamp > 0 for e in recorded)
    assert recorder.gaps == []


async def test_recorder_started_late_on_a_history_1_bucket_reports_what_it_missed(
    nats_client: NatsClient, routing_bucket: NatsKV
) -> None:
    revision = await routing_bucket.create("lease.p.m.0", b"a")
    revision = await routing_bucket.update("lease.p.m.0", b"b", revision)  # supersedes rev 1
    await routing_bucket.create("pin.m.s", b"c")
    async with HistoryRecorder(nats_client.jetstream(), routing_bucket.bucket) as recorder:
        with pytest.raises(HistoryIncomplete, match="missing revisions: 1"):
            await recorder.sync()
        assert recorder.gaps == [(1, 1)]
        kept = await recorder.sync(allow_gaps=True)
    assert [(e.revision, e.value) for e in kept] == [(2, b"b"), (3, b"c")]


async def test_recorder_keeps_every_revision_of_a_deeper_bucket_even_when_started_late(
    nats_client: NatsClient, unique_id: str
) -> None:
    js = nats_client.jetstream()
    name = f"routing_{unique_id}"
    store = await open_routing_bucket(js, name, history=8)
    try:
        revision = await store.create("lease.p.m.0", b"a")
        await store.update("lease.p.m.0", b"b", revision)
        async with HistoryRecorder(js, name) as recorder:
            assert [e.value for e in await recorder.sync()] == [b"a", b"b"]
    finally:
        await js.delete_key_value(name)


async def test_revisions_the_consumer_skipped_are_read_back_from_the_stream(
    nats_client: NatsClient, unique_id: str
) -> None:
    """An ordered consumer made again on another server after its own died skips what it had
    not delivered: `sync` reads those revisions from the stream (which keeps them: a history
    of 8), in their place."""
    js = nats_client.jetstream()
    name = f"routing_{unique_id}"
    store = await open_routing_bucket(js, name, history=8)
    recorder = HistoryRecorder(js, name)
    record = recorder._record

    async def skipping(msg) -> None:  # type: ignore[no-untyped-def]
        if msg.metadata.sequence.stream not in (2, 3, 5):
            await record(msg)

    recorder._record = skipping  # type: ignore[method-assign]
    try:
        async with recorder:
            await _script(store)
            recorded = await recorder.sync()
    finally:
        await js.delete_key_value(name)
    assert [e.revision for e in recorded] == list(range(1, 7)) and recorder.gaps == []
    memory = MemoryKV()
    await _script(memory)
    assert _shape(recorded) == _shape(await MemoryHistory(memory).sync())
