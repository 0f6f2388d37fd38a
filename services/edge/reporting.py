"""What the edge tells the rest of the gateway when an upstream attempt ends.

One `RequestEnded` per attempt on ``llmgw.v1.stats.request``: the lease's release for the shard
owner, the rate balancers' sample and the breakers' evidence for every admission instance, and
usage for anyone who reports on it. Published off the request path: messages queue here and one
background flush per event-loop turn hands them all to the NATS client (no task per request).
Best effort by design: a lost message costs one renewal interval of a lease (the owner ends it
when the edge's next lease list leaves it out) and one balancer sample.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from llmgw.wire import REQUEST_STATS_SUBJECT

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.wire import RequestEnded

log = logging.getLogger("llmgw.edge.reporting")


class NatsReporter:
    """`llmgw.contracts.RequestReporter` over core NATS publish."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._queued: list[bytes] = []
        self._flushing: asyncio.Task[None] | None = None
        self.sent = 0
        self.failures = 0

    def report(self, message: RequestEnded) -> None:
        self._queued.append(message.model_dump_json(exclude_defaults=True).encode())
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let this turn's other ends join the batch
        while self._queued:
            batch, self._queued = self._queued, []
            for payload in batch:
                try:
                    await self._nc.publish(REQUEST_STATS_SUBJECT, payload)
                    self.sent += 1
                except Exception as exc:
                    self.failures += 1
                    log.debug("request stats not published: %s", exc)

    async def drain(self, timeout: float = 5.0) -> None:
        if self._flushing is not None and not self._flushing.done():
            await asyncio.wait([self._flushing], timeout=timeout)
