"""Endpoint health as the admission service sees it (a port with two adapters).

`HealthBoard` is the in-memory view the decision reads; `HealthProber` keeps
it current by polling managed endpoints' GET /health. The scraper service
replaces the prober later; tests flip the board directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import httpx

log = logging.getLogger("llmgw.admission.health")


class HealthBoard:
    """Which endpoints are healthy. Unknown endpoints count as healthy.

    `version` increases on every change so readers can cache derived views.
    """

    def __init__(self) -> None:
        self._unhealthy: set[str] = set()
        self.version = 0
        self._listeners: list[Callable[[], None]] = []

    def is_healthy(self, endpoint_id: str) -> bool:
        return endpoint_id not in self._unhealthy

    def set_healthy(self, endpoint_id: str, healthy: bool) -> None:
        changed = (endpoint_id in self._unhealthy) == healthy
        if not changed:
            return
        if healthy:
            self._unhealthy.discard(endpoint_id)
        else:
            self._unhealthy.add(endpoint_id)
        self.version += 1
        for listener in self._listeners:
            listener()

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)


class HealthProber:
    """Polls GET {url}/health of each endpoint every `interval` seconds."""

    def __init__(
        self,
        board: HealthBoard,
        endpoints: Iterable[tuple[str, str]],
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self._board = board
        self._endpoints = list(endpoints)
        self._interval = interval
        self._timeout = timeout
        self._task: asyncio.Task[None] | None = None

    async def _probe(self, client: httpx.AsyncClient, endpoint_id: str, url: str) -> None:
        try:
            response = await client.get(url.rstrip("/") + "/health")
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if self._board.is_healthy(endpoint_id) != healthy:
            log.warning("endpoint %s is now %s", endpoint_id, "healthy" if healthy else "unhealthy")
        self._board.set_healthy(endpoint_id, healthy)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self._timeout) as client:
            while True:
                await asyncio.gather(*(self._probe(client, i, u) for i, u in self._endpoints))
                await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._endpoints:
            self._task = asyncio.create_task(self._run(), name="health-prober")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
