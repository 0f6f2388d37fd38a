"""Routing-state fixtures: a KVStore of each implementation, and a fresh routing bucket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient

from llmgw.state import KVStore, MemoryKV, NatsKV, open_routing_bucket


async def _yield_to_other_tasks(op_name: str, key: str) -> None:
    # A network store suspends on every call; without this MemoryKV tasks would never interleave.
    await asyncio.sleep(0)


@pytest_asyncio.fixture
async def routing_bucket(nats_client: NatsClient, unique_id: str) -> AsyncIterator[NatsKV]:
    """A fresh routing bucket (the product's shape: history 1), deleted after the test."""
    js = nats_client.jetstream()
    name = f"routing_{unique_id}"
    store = await open_routing_bucket(js, name)
    try:
        yield store
    finally:
        await js.delete_key_value(name)


@pytest.fixture(params=["memory", "nats"])
def kv_store(request: pytest.FixtureRequest) -> KVStore:
    """The same contract, once per implementation (NATS: a real server, never a mock)."""
    if request.param == "memory":
        return MemoryKV(before_op=_yield_to_other_tasks)
    return request.getfixturevalue("routing_bucket")
