"""Self-registered endpoints that stopped heartbeating: drained, then removed (in the reaper).

Every `interval` the janitor reads the fleet and, for each endpoint that registered itself
with a heartbeat TTL (`llmgw register`, `POST /admin/register`), applies
`llmgw.core.fleet.heartbeat_verdict`: silent for its TTL, it is drained (no new work; what
runs on it ends); silent for twice its TTL, drained and with no lease left at any admission
instance, it is removed. Each change is one CAS on the record as read, so a heartbeat that
lands meanwhile wins. Several reapers may run: their changes are the same and CAS keeps one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from llmgw.core.fleet import EndpointState, HeartbeatVerdict, heartbeat_verdict
from llmgw.fleet import FleetRecord
from llmgw.state.fleet import FleetBucket
from llmgw.state.kv import CasConflict

__all__ = ["HeartbeatJanitor"]

log = logging.getLogger("llmgw.fleet")


class HeartbeatJanitor:
    def __init__(
        self,
        bucket: FleetBucket,
        leases: Callable[[], Awaitable[dict[str, int] | None]],
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bucket = bucket
        self._leases = leases
        self.interval = interval
        self._clock = clock
        self.drained = 0
        self.removed = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except Exception:  # NATS trouble: try again next time
                log.warning("heartbeat sweep failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await stop.wait()

    async def sweep(self) -> None:
        fleet = await self.bucket.fleet()
        registered = [
            r for r in fleet.records.values() if r.heartbeat_ttl is not None and r.heartbeat_at
        ]
        if not registered:
            return
        leases = await self._leases()
        now = self._clock()
        for record in registered:
            assert record.heartbeat_ttl is not None and record.heartbeat_at is not None
            held = None if leases is None else leases.get(record.id, 0)
            verdict = heartbeat_verdict(
                record.state, record.heartbeat_at, record.heartbeat_ttl, now, held
            )
            with contextlib.suppress(CasConflict, LookupError):  # it changed meanwhile
                if verdict is HeartbeatVerdict.DRAIN:
                    await self.bucket.change(record.id, _draining_if(record))
                    self.drained += 1
                    log.info("endpoint %s stopped heartbeating: draining it", record.id)
                elif verdict is HeartbeatVerdict.REMOVE:
                    await self.bucket.remove(record.id, expected=record)
                    self.removed += 1
                    log.info("endpoint %s drained and silent: removed", record.id)


def _draining_if(expected: FleetRecord) -> Callable[[FleetRecord], FleetRecord]:
    """The change to draining, refused (CasConflict) if a heartbeat landed since the read."""

    def change(record: FleetRecord) -> FleetRecord:
        if record.heartbeat_at != expected.heartbeat_at:
            raise CasConflict(record.id, None, "heartbeat since")
        return record.model_copy(update={"state": EndpointState.DRAINING})

    return change
