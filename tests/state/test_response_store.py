"""The response store on a real JetStream KV bucket (llmgw.state.responses)."""

from __future__ import annotations

import asyncio
import dataclasses

import nats
import pytest
from timing import eventually

from llmgw.config import config_from_dict
from llmgw.core.responses import StoredResponse
from llmgw.nats_embedded import EmbeddedNats
from llmgw.serving import free_port
from llmgw.state.memory_kv import MemoryKV
from llmgw.state.responses import RecentResponses, ResponseStore, open_response_store


def _stored(number: int, previous: str | None = None, text: str = "hi") -> StoredResponse:
    rid = f"resp_{number:032x}"
    return StoredResponse(
        id=rid,
        owner="owner",
        root=f"resp_{1:032x}",
        previous=previous,
        input=({"type": "message", "role": "user", "content": text},),
        response={"id": rid, "output": []},
        created_at=1.0,
    )


@pytest.fixture
def config(nats_url: str, unique_id: str):
    return config_from_dict(
        {
            "nats": {"url": nats_url},
            "responses": {"bucket": f"responses_{unique_id}", "retention": "90m"},
            "models": [{"name": "m"}],
            "providers": [{"id": "p", "kind": "unlimited", "models": [{"name": "m"}]}],
            "endpoints": [
                {"id": "e", "url": "http://127.0.0.1:1", "provider": "p", "models": ["m"]}
            ],
        },
        source="<test>",
        env={},
    )


async def test_a_saved_response_is_readable_at_once_then_from_the_bucket(nats_client, config):
    store = await open_response_store(nats_client, config)
    results: list[str] = []
    store.on_result = results.append
    try:
        first, second = _stored(1), _stored(2, previous=_stored(1).id)
        store.save(first)
        store.save(second)
        assert await store.get(second.id) == second  # here: once its write in flight landed
        await store.close()
        assert store.pending == {} and results == ["stored", "stored"]
        again = await open_response_store(nats_client, config)  # another edge
        assert await again.get(second.id) == second
        assert await again.chain(second) == [first, second]
        assert await again.delete(first.id) is True
        assert await again.get(first.id) is None
        assert await again.chain(second) is None  # a chain with a hole is no chain
        assert await again.delete(first.id) is False
        info = await nats_client.jetstream().stream_info(f"KV_{config.responses.bucket}")
        assert info.config.max_age == 90 * 60  # entries expire after responses.retention
    finally:
        await nats_client.jetstream().delete_key_value(config.responses.bucket)


async def test_a_record_over_the_largest_message_is_not_stored(nats_client, config):
    store = await open_response_store(nats_client, config)
    results: list[str] = []
    store.on_result = results.append
    try:
        assert store.max_value_bytes < nats_client.max_payload
        big = _stored(3, text="x" * nats_client.max_payload)
        store.save(big)
        await store.close()
        assert results == ["too_large"]
        assert await store.get(big.id) is None
    finally:
        await nats_client.jetstream().delete_key_value(config.responses.bucket)


async def test_ids_that_are_not_ours_are_unknown_without_a_read():
    class NoReads:
        async def get(self, key: str) -> None:
            raise AssertionError(f"read {key}")

    store = ResponseStore(NoReads())  # type: ignore[arg-type]
    assert await store.get("resp_../../x") is None
    assert await store.get("msg_" + "0" * 32) is None


async def test_a_chain_that_names_its_ancestors_is_read_at_once():
    """Every read of the chain is in flight at the same time: each waits until all are."""
    ancestors = [_stored(n, previous=_stored(n - 1).id if n > 1 else None) for n in range(1, 5)]
    head = _with_ancestors(_stored(5, previous=ancestors[-1].id), ancestors)
    all_in_flight = asyncio.Event()
    in_flight = 0

    async def before_op(op: str, key: str) -> None:
        nonlocal in_flight
        if op == "get":
            in_flight += 1
            if in_flight == len(ancestors):
                all_in_flight.set()
            await asyncio.wait_for(all_in_flight.wait(), timeout=2)

    kv = MemoryKV()
    store = ResponseStore(kv)
    for stored in ancestors:
        await kv.put(stored.id, stored.encode())
    kv.before_op = before_op
    assert await store.chain(head) == [*ancestors, head]
    kv.before_op = None
    assert await store.delete(ancestors[1].id) is True
    assert await store.chain(head) is None  # a hole anywhere ends the chain


def _with_ancestors(stored: StoredResponse, ancestors: list[StoredResponse]) -> StoredResponse:
    return dataclasses.replace(stored, ancestors=tuple(a.id for a in ancestors))


async def test_a_chain_written_here_is_read_from_memory_and_one_written_elsewhere_once():
    gets: list[str] = []

    async def before_op(op: str, key: str) -> None:
        if op == "get":
            gets.append(key)

    kv = MemoryKV(before_op=before_op)
    now = lambda: 2.0  # noqa: E731  (the records were made at 1.0, well within retention)
    here, elsewhere = ResponseStore(kv, clock=now), ResponseStore(kv, clock=now)
    records = [_stored(1)]
    for n in range(2, 5):
        records.append(_with_ancestors(_stored(n, previous=records[-1].id), records[: n - 1]))
    for stored in records:
        here.save(stored)
    await here.close()
    assert await here.get(records[-1].id) == records[-1]
    assert await here.chain(records[-1]) == records
    assert gets == []  # every record from memory
    assert here.held_chain(records[-1].id) == records  # ...without a wait
    assert elsewhere.held_chain(records[-1].id) is None  # not held there: read it
    assert await elsewhere.chain(await elsewhere.get(records[-1].id)) == records
    assert sorted(gets) == sorted(stored.id for stored in records)  # each read once...
    assert await elsewhere.chain(await elsewhere.get(records[-1].id)) == records
    assert len(gets) == len(records)  # ...then held
    assert elsewhere.held_chain(records[-1].id) == records
    late = ResponseStore(kv, clock=lambda: 1.0 + 30 * 24 * 3600.0 + 1)  # past retention
    late.recent.put(records[0], 100)
    await late.get(records[0].id)
    assert len(gets) == len(records) + 1  # memory is not trusted past the bucket's max age
    uncached = ResponseStore(kv, cache_bytes=0, clock=now)
    assert await uncached.chain(await uncached.get(records[-1].id)) == records
    assert len(gets) == 2 * len(records) + 1  # cache_bytes 0: every read goes to the bucket


async def test_a_write_that_fails_is_not_found_even_on_its_own_edge():
    gate = asyncio.Event()

    class Refusing(MemoryKV):
        async def put(self, key: str, value: bytes) -> int:
            await gate.wait()
            raise ConnectionError("refused")

    store = ResponseStore(Refusing())
    results: list[str] = []
    store.on_result = results.append
    stored = _stored(7)
    store.save(stored)
    read = asyncio.ensure_future(store.get(stored.id))  # waits for the write in flight
    await asyncio.sleep(0)
    assert not read.done()
    gate.set()
    assert await read is None and results == ["failed"]
    assert await store.get(stored.id) is None


def test_recent_responses_keep_the_most_recently_used_within_their_bytes():
    recent = RecentResponses(max_bytes=300)
    for n in range(1, 4):
        recent.put(_stored(n), 100)
    assert recent.get(_stored(1).id) == _stored(1)  # used: the second is now the oldest
    recent.put(_stored(4), 100)
    assert _stored(2).id not in recent and len(recent) == 3 and recent.bytes == 300
    recent.put(_stored(5), 301)  # larger than the whole: not kept, nothing dropped for it
    assert _stored(5).id not in recent and len(recent) == 3
    recent.drop(_stored(1).id)
    assert recent.bytes == 200 and recent.get(_stored(1).id) is None


async def test_a_write_the_bucket_refuses_is_counted_failed_and_not_found(nats_client, config):
    store = await open_response_store(nats_client, config)
    results: list[str] = []
    store.on_result = results.append
    await nats_client.jetstream().delete_key_value(config.responses.bucket)  # nothing stores
    stored = _stored(8)
    store.save(stored)
    assert await store.get(stored.id) is None  # waited for its write, which failed
    await store.close()
    assert results == ["failed"] and stored.id not in store.recent


async def test_an_edge_back_on_nats_forgets_what_it_held(tmp_path, unique_id):
    """Deletes told while it was away are lost to it: it reads the bucket again."""
    server = EmbeddedNats(port=free_port(), store_dir=tmp_path)
    await server.astart()
    nc = await nats.connect(server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    config = config_from_dict(
        {
            "nats": {"url": server.url},
            "responses": {"bucket": f"responses_{unique_id}"},
            "models": [{"name": "m"}],
            "providers": [{"id": "p", "kind": "unlimited", "models": [{"name": "m"}]}],
            "endpoints": [
                {"id": "e", "url": "http://127.0.0.1:1", "provider": "p", "models": ["m"]}
            ],
        },
        source="<test>",
        env={},
    )
    try:
        store = await open_response_store(nc, config)
        store.clock = lambda: 2.0  # the records were made at 1.0
        stored = _stored(9)
        store.save(stored)
        assert store.held_chain(stored.id) is None  # its write is in flight
        await store.close()
        assert store.held_chain(stored.id) == [stored]
        await server.arestart()
        await eventually(
            lambda: nc.is_connected and nc.stats["reconnects"] >= 1,
            10,
            "a reconnection",
            interval=0.05,
        )
        assert store.held_chain(stored.id) is None and len(store.recent) == 0
        assert await store.get(stored.id) == stored  # from the bucket, then held again
        assert store.held_chain(stored.id) == [stored]
    finally:
        await nc.close()
        await server.astop()
