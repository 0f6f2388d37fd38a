"""Reaper fixtures: a config on the test's NATS server and its own bucket, extra connections,
and the log of routing events (helpers: reaper_helpers.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError
from reaper_helpers import Connect, EventLog, config_data

from llmgw.config import Config, config_from_dict


@pytest_asyncio.fixture
async def bucket(nats_client: NatsClient, unique_id: str) -> AsyncIterator[str]:
    """A bucket name unique to the test; the bucket (if anything created it) is deleted after."""
    name = f"routing_{unique_id}"
    yield name
    with contextlib.suppress(NotFoundError):
        await nats_client.jetstream().delete_key_value(name)


@pytest.fixture
def config(nats_url: str, bucket: str) -> Config:
    """config/local.yaml on the test server, lease timeout 1s, pin inactivity 2s, reaper 100ms."""
    return config_from_dict(config_data(nats_url, bucket), env={})


@pytest_asyncio.fixture
async def connect(nats_url: str) -> AsyncIterator[Connect]:
    """Factory of extra NATS connections (one per simulated process), closed after the test."""
    clients: list[NatsClient] = []

    async def open_one() -> NatsClient:
        client = await nats.connect(nats_url, connect_timeout=2, allow_reconnect=False)
        clients.append(client)
        return client

    yield open_one
    for client in clients:
        if not client.is_closed:
            await client.close()


@pytest_asyncio.fixture
async def event_log(connect: Connect) -> EventLog:
    """Every routing event published during the test, collected from `llmgw.v1.events.>`."""
    return await EventLog(await connect()).start()
