"""The response store on a real JetStream KV bucket (llmgw.state.responses)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from llmgw.config import config_from_dict
from llmgw.core.responses import StoredResponse
from llmgw.state.memory_kv import MemoryKV
from llmgw.state.responses import ResponseStore, open_response_store


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
        assert await store.get(second.id) == second  # before its write landed
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
    await kv.delete(ancestors[1].id, (await kv.get(ancestors[1].id)).revision)
    assert await store.chain(head) is None  # a hole anywhere ends the chain


def _with_ancestors(stored: StoredResponse, ancestors: list[StoredResponse]) -> StoredResponse:
    return dataclasses.replace(stored, ancestors=tuple(a.id for a in ancestors))
