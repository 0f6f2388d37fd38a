"""Self-registered endpoints that stopped heartbeating: drained, then removed (in the reaper).

Every `interval` the janitor reads the fleet and, for each endpoint that registered itself
with a heartbeat TTL (`llmgw register`, `POST /admin/register`), applies
`llmgw.core.fleet.heartbeat_verdict`: silent for its TTL, it is drained (no new work; what
runs on it ends); silent for twice its TTL, drained and with no lease left at any admission
instance, it is removed.

Silence is measured on the janitor's own monotonic clock: the time since it saw the record's
heartbeat change (a new ``heartbeat_at``, or any new write of the record but its own drain and
the model follower's: what the engine serves, written by the reaper, says nothing of whether
its registrant is alive), never the registrant's ``heartbeat_at`` against this host's wall clock, so the hosts' clocks
need not agree (`llmgw.core.fleet.heard`). A record it sees for the first time (a new
registration, or every one after the reaper restarted) counts as heard then: a registration
that died while no reaper ran is drained a TTL after the reaper is back.

Each change is one CAS on the record as read, so a heartbeat that lands meanwhile wins.
Several reapers may run: their changes are the same and CAS keeps one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of
from llmgw.core.fleet import EndpointState, HeartbeatVerdict, heard, heartbeat_verdict
from llmgw.fleet import FleetRecord
from llmgw.state.fleet import FleetBucket
from llmgw.state.kv import CasConflict

__all__ = ["HeartbeatJanitor", "heartbeat_token"]

log = logging.getLogger("llmgw.fleet")

# What the model follower writes (`llmgw.services.fleet.served`), and when a record was written.
_NOT_HEARD: dict[str, Any] = {
    "changed_at": True,
    "adapters": True,
    "unserved": True,
    "endpoint": {"models", "upstream_model"},
}


def heartbeat_token(record: FleetRecord) -> Hashable:
    """What changes with a heartbeat, or with any write of the record but the model
    follower's (its models, their upstream names and adapters, and its drain when the engine
    serves none of them: an `unserved` record counts as the active one it was)."""
    if record.unserved:
        record = record.model_copy(update={"state": EndpointState.ACTIVE})
    return record.model_dump_json(exclude=_NOT_HEARD)


class HeartbeatJanitor:
    """`clock`: this process's monotonic clock (seconds); only its differences are used."""

    def __init__(
        self,
        bucket: FleetBucket,
        leases: Callable[[], Awaitable[dict[str, int] | None]],
        *,
        interval: float = 1.0,
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.bucket = bucket
        self._leases = leases
        self.interval = interval
        self._clock = monotonic_of(clock)
        # endpoint id -> (its heartbeat as last seen, when this janitor first saw it)
        self._heard: dict[str, tuple[Hashable, float]] = {}
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

    def silent_for(self, endpoint_id: str) -> float | None:
        """Seconds since this janitor last heard `endpoint_id`'s heartbeat (None: not seen)."""
        seen = self._heard.get(endpoint_id)
        return None if seen is None else self._clock() - seen[1]

    async def sweep(self) -> None:
        entries = await self.bucket.revisions()
        registered = {i: e for i, e in entries.items() if e[0].heartbeat_ttl is not None}
        now = self._clock()
        tokens = {i: heartbeat_token(r) for i, (r, _) in registered.items()}
        self._heard = heard(self._heard, tokens, now)
        if not registered:
            return
        # Only a removal needs the leases (asking the admission instances takes their answer
        # window): a sweep with nothing to remove keeps to its interval.
        removable = any(
            heartbeat_verdict(r.state, now - self._heard[i][1], r.heartbeat_ttl, 0)
            is HeartbeatVerdict.REMOVE
            for i, (r, _) in registered.items()
            if r.heartbeat_ttl is not None
        )
        leases = await self._leases() if removable else None
        for endpoint_id, (record, revision) in registered.items():
            assert record.heartbeat_ttl is not None
            held = None if leases is None else leases.get(endpoint_id, 0)
            heard_at = self._heard[endpoint_id][1]
            verdict = heartbeat_verdict(record.state, now - heard_at, record.heartbeat_ttl, held)
            with contextlib.suppress(CasConflict, LookupError):  # it changed meanwhile
                if verdict is HeartbeatVerdict.DRAIN:
                    draining = record.model_copy(update={"state": EndpointState.DRAINING})
                    await self.bucket.replace(draining, revision)
                    # Its own write is no heartbeat: the silence goes on counting.
                    self._heard[endpoint_id] = (heartbeat_token(draining), heard_at)
                    self.drained += 1
                    log.info("endpoint %s stopped heartbeating: draining it", endpoint_id)
                elif verdict is HeartbeatVerdict.REMOVE:
                    await self.bucket.remove(endpoint_id, expected=record)
                    self._heard.pop(endpoint_id, None)
                    self.removed += 1
                    log.info("endpoint %s drained and silent: removed", endpoint_id)
