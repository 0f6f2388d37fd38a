"""Scraper fixtures: a load bucket and a provider id unique to the test, simulated engines on
uvicorn, extra NATS connections, and the endpoint/pool events of the test's provider
(helpers: scraper_helpers.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats
import pytest_asyncio
from inproc import stop_servers
from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError
from scraper_helpers import Connect, EventLog, LoadGenerator, StartEngine

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server


@pytest_asyncio.fixture
async def load_bucket(nats_client: NatsClient, unique_id: str) -> AsyncIterator[str]:
    """A load bucket name unique to the test; the bucket is deleted after."""
    name = f"load_{unique_id}"
    yield name
    with contextlib.suppress(NotFoundError):
        await nats_client.jetstream().delete_key_value(name)


@pytest_asyncio.fixture
async def connect(nats_url: str) -> AsyncIterator[Connect]:
    """Factory of extra NATS connections, closed after the test."""
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
async def start_engine() -> AsyncIterator[StartEngine]:
    """Factory of simulated vLLM-like engines on loopback (EngineParams overrides as kwargs)."""
    servers: list[RunningServer] = []

    async def start(**params: object) -> RunningServer:
        server = await start_server(create_engine_app(EngineParams.zero_delay(**params), ["m1"]))
        servers.append(server)
        return server

    yield start
    await stop_servers(servers)


@pytest_asyncio.fixture
async def events(connect: Connect, unique_id: str) -> EventLog:
    """Every endpoint and pool event about the test's provider (`unique_id`)."""
    return await EventLog(await connect(), unique_id).start()


@pytest_asyncio.fixture
async def load() -> AsyncIterator[LoadGenerator]:
    """Long-running streamed requests to hold engines busy; all cancelled after the test."""
    generator = LoadGenerator()
    yield generator
    await generator.close()
