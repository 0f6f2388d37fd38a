"""A local mirror fed by one KV watch, kept alive: the shape every bucket follower shares.

A subclass implements `_watch` (list, apply, set `ready`, then apply each watched change); this
base runs it in one task, starts it bounded (a reader knows the bucket's state before it
serves, or goes on and gets it later), and restarts it after a failure (a closed connection, a
deleted bucket) a second later. `stop` ends the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from llmgw.tasks import cancel_and_wait

__all__ = ["WatchFollower"]


class WatchFollower:
    what = "bucket"  # named in the log lines
    log = logging.getLogger("llmgw.state")

    def __init__(self) -> None:
        self.ready = asyncio.Event()  # the initial replay is in
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout: float = 5.0) -> None:
        self._task = asyncio.create_task(self._follow(), name=f"{self.what}-mirror")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.ready.wait()
        if not self.ready.is_set():
            self.log.warning(
                "the %s bucket did not answer within %.0fs; it arrives later", self.what, timeout
            )

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _follow(self) -> None:
        while True:
            try:
                await self._watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a closed connection, a deleted bucket: retry
                self.log.warning("%s watch failed (%s); retrying", self.what, type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _watch(self) -> None:
        raise NotImplementedError
