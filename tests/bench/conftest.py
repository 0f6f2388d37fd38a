"""Fixtures for the bench: engine simulators served on loopback, in this loop or in a thread.

`engine` serves in the test's own event loop (for tests that call the bench's coroutines);
`threaded_engine` serves on a thread with its own loop, for tests that run the `llmgw bench`
command in-process (it runs its own event loop on the test's thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from bench_helpers import MODEL, Engine, StartEngine
from inproc import stop_servers

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, start_server


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[StartEngine]:
    """`await engine(params, wrap=None)` -> an `Engine` on a free loopback port."""
    servers: list[RunningServer] = []

    async def _start(params: EngineParams, *, wrap: Any = None) -> Engine:
        app = create_engine_app(params, [MODEL])
        server = await start_server(wrap(app) if wrap is not None else app)
        servers.append(server)
        return Engine(url=server.url, app=app)

    try:
        yield _start
    finally:
        await stop_servers(servers)


class ThreadedEngine:
    """An engine simulator running on its own thread and event loop."""

    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="sim-engine", daemon=True)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        server = await start_server(create_engine_app(self.params, [MODEL]))
        self.url = server.url
        self._ready.set()
        await self._stopped.wait()
        await server.stop()

    def start(self) -> ThreadedEngine:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the engine simulator did not start")
        return self

    def stop(self) -> None:
        assert self._stopped is not None
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)

    def post(self, path: str, body: dict[str, Any]) -> None:
        httpx.post(self.url + path, json=body, timeout=5).raise_for_status()

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=5)


@pytest.fixture
def threaded_engine() -> Iterator[Any]:
    """`threaded_engine(params)` -> a started `ThreadedEngine`, stopped after the test."""
    engines: list[ThreadedEngine] = []

    def _start(params: EngineParams) -> ThreadedEngine:
        started = ThreadedEngine(params).start()
        engines.append(started)
        return started

    try:
        yield _start
    finally:
        for started in engines:
            started.stop()
