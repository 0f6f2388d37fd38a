"""The reaper: clears what admission instances that died left in the routing bucket.

Admission instances expire their own shards' leases and idle pins (in memory: they own them).
What is left for a janitor is what a dead instance cannot clean up itself:

- **member keys** of instances that stopped renewing them more than ``3 x member_ttl`` ago
  (their shards have been claimed by then; the key itself only costs a listing);
- **quota** a dead instance still holds in a pair's book once ``quota_grace`` has passed since
  its last write and it is not a live member: the instances that adopted its shards moved what
  its leases and pins needed to themselves (`llmgw.core.quota.QuotaBook.transfer`); what is
  left belonged to requests nobody announced, so it goes back to the free pool.

Each change is one compare-and-swap from the revision read, so any number of reapers may run:
one wins, only the winner announces it. Without a reaper nothing breaks: a dead instance's
quota simply stays unavailable (under-admission, the safe direction).

Stopping: `run(stop)` checks `stop` between passes only, so a pass in progress is finished.

Time: the `clock`'s wall time (unix seconds in the product) is what expiry is judged by, against
the stamps instances write; its monotonic time measures a pass. The composition root
(`main.serve`) gives it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.core.quota import reclaimable
from llmgw.core.shards import live_members
from llmgw.events import EventPublisher, MemberEvent, QuotaReclaimed, RoutingEvent
from llmgw.services.reaper.metrics import ReaperMetrics
from llmgw.state.store import RoutingStore

if TYPE_CHECKING:
    from llmgw.contracts import Clock

__all__ = ["PassResult", "Reaper"]

_log = logging.getLogger("llmgw.reaper")
MIN_STEP_TIMEOUT = 30.0


def step_timeout(interval: float) -> float:
    """Bound on one step: a stalled NATS call must not stop the reaper forever."""
    return max(10 * interval, MIN_STEP_TIMEOUT)


@dataclass(frozen=True, slots=True)
class PassResult:
    members_removed: tuple[str, ...]
    quota_reclaimed: tuple[tuple[str, str, str], ...]  # (provider, model, instance)
    failed_steps: tuple[str, ...]


class Reaper:
    def __init__(
        self,
        store: RoutingStore,
        events: EventPublisher,
        metrics: ReaperMetrics,
        *,
        clock: Clock,
        interval: float,
        member_ttl: float,
        quota_grace: float,
    ) -> None:
        self.store = store
        self.events = events
        self.metrics = metrics
        self._clock = clock.wall
        self._timer = clock.monotonic
        self.interval = interval
        self.member_ttl = member_ttl
        self.quota_grace = quota_grace
        self.step_timeout = step_timeout(interval)
        self.passes = 0
        self._pass_done = asyncio.Condition()

    async def remove_dead_members(self, now: float) -> list[str]:
        removed = []
        for stored in await self.store.members():
            member = stored.value
            if now < member.renewed_at + 3 * self.member_ttl:
                continue
            if await self.store.remove_member(member.instance, stored.revision):
                removed.append(member.instance)
                self.metrics.count_action("member_expired")
                await self._announce(MemberEvent, event="member.expired", member=member.instance)
        return removed

    async def reclaim_quota(self, now: float) -> list[tuple[str, str, str]]:
        from llmgw.core.shards import Member

        members = [
            Member(s.value.instance, s.value.renewed_at, s.value.joined_at)
            for s in await self.store.members()
        ]
        live = live_members(members, now, self.member_ttl)
        done = []
        for stored in await self.store.quota_books():
            book = stored.value
            dead = reclaimable(book, live, now, self.quota_grace)
            if not dead:
                continue
            reduced = book
            for instance in dead:
                reduced = reduced.drop(instance)
            if await self.store.write_quota_book(reduced, stored.revision) is None:
                continue  # changed meanwhile: the next pass looks again
            for instance in dead:
                held = book.quota(instance)
                done.append((book.provider, book.model, instance))
                self.metrics.count_action("quota_reclaimed")
                await self._announce(
                    QuotaReclaimed,
                    provider=book.provider,
                    model=book.model,
                    member=instance,
                    leases=held.g,
                    unreserved=held.u,
                    pins=held.p,
                )
        return done

    async def _announce(self, kind: type[RoutingEvent], **fields: object) -> None:
        """Publish a change made; one that cannot be published (logged by the publisher) is
        counted in `llmgw_reaper_unpublished_events_total`, and the change stands."""
        if not await self.events.publish(self.events.build(kind, **fields)):
            self.metrics.unpublished_events.inc()

    async def run_pass(self) -> PassResult:
        """One pass over every step; never raises but cancellation."""
        started = self._timer()
        removed: list[str] = []
        reclaimed: list[tuple[str, str, str]] = []
        failed: list[str] = []
        for name in ("remove_dead_members", "reclaim_quota"):
            try:
                async with asyncio.timeout(self.step_timeout):
                    result = await getattr(self, name)(self._clock())
            except Exception:  # TimeoutError included: the next pass retries
                _log.warning("reaper step %s failed", name, exc_info=True)
                self.metrics.step_failures.labels(name).inc()
                failed.append(name)
                continue
            if name == "remove_dead_members":
                removed = result
            else:
                reclaimed = result
        self.metrics.pass_duration.observe(self._timer() - started)
        self.metrics.last_pass.set(self._clock())
        if removed or reclaimed:
            _log.info("reaped: %d dead members, %d quota entries", len(removed), len(reclaimed))
        async with self._pass_done:
            self.passes += 1
            self._pass_done.notify_all()
        return PassResult(tuple(removed), tuple(reclaimed), tuple(failed))

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass, `interval` apart, until `stop` is set (the current pass finishes)."""
        while not stop.is_set():
            await self.run_pass()
            try:
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            except TimeoutError:
                pass

    async def wait_for_passes(self, count: int) -> None:
        """Return once `count` passes have completed in total (bound it with asyncio.timeout)."""
        async with self._pass_done:
            await self._pass_done.wait_for(lambda: self.passes >= count)
