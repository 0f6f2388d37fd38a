"""Fixtures for simulator HTTP tests: serve an app on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest_asyncio
from inproc import stop_servers
from sim_helpers import Serve

from llmgw.serving import RunningServer, start_server


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    """`await serve(app)` -> an httpx client bound to the app running on uvicorn."""
    servers: list[RunningServer] = []
    clients: list[httpx.AsyncClient] = []

    async def _serve(app: object) -> httpx.AsyncClient:
        server = await start_server(app)
        servers.append(server)
        client = httpx.AsyncClient(base_url=server.url, timeout=10)
        clients.append(client)
        return client

    try:
        yield _serve
    finally:
        for client in clients:
            await client.aclose()
        await stop_servers(servers)
