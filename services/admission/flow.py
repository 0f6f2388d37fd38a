"""Flow control inside one admission instance: queues, the dispatch tick and gossip with peers.

The decisions are `llmgw.core.flow`'s; this adapter owns the asyncio side:

- `admit` gates an arriving request. Granted at once when nobody of its pool waits ahead of it
  and the pool is within its band's ceiling (work conservation: an unsaturated pool costs one
  synchronous check, no tick, no wait); otherwise it waits in this instance's queue until the
  tick grants it, overflows it, or it expires (queue_ttl) or is cancelled;
- the tick runs every ``admission.interval``: expires, then dispatches each pool's queues by
  `plan_dispatch`;
- every grant reserves its endpoint on the `LoadBoard` at once (so the next check sees it) and
  is announced to the other instances (ADMISSION_GRANTS_SUBJECT), batched per event-loop turn;
- this instance's waiting counts go to the others on ADMISSION_FLOW_SUBJECT when they change
  (at most once per tick) and every second while non-empty; theirs feed `plan_dispatch`'s
  ``remote`` and the arrival check, so a band waiting in another instance is not overtaken.

Semantics across instances (docs/architecture.md, "Flow control"): all instances work against
one shared saturation (the same scraper reports, everybody's grants); together they grant at
most a pool's headroom plus one request per other instance with waiters in the band per
dispatch round; strict priority holds across instances as far as gossip has arrived (< 1 ms on
one NATS server); an instance that dies takes its queue with it (its clients' NATS requests time
out and the edge answers 503 admission_unavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmgw.core.flow import BandPolicy, FlowQueues, GateDecision, Waiter, gate, plan_dispatch
from llmgw.wire import (
    ADMISSION_CANCEL_SUBJECT,
    ADMISSION_FLOW_SUBJECT,
    ADMISSION_GRANTS_SUBJECT,
    AdmitCancel,
    FlowGrants,
    FlowState,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.services.admission.loadboard import LoadBoard
    from llmgw.services.admission.metrics import AdmissionMetrics

log = logging.getLogger("llmgw.admission.flow")

STATE_HEARTBEAT = 1.0  # seconds between FlowState messages while anything waits
STATE_FORGET_AFTER = 3.0  # a peer's state older than this is dropped (the peer is gone)
CANCEL_MEMORY = 5.0  # seconds a cancel for a request not (yet) queued here is remembered


def band_policies(config: Config) -> list[BandPolicy]:
    bands = [
        BandPolicy(b.name, b.priority, b.saturation_ceiling, b.overflow)
        for b in config.admission.bands
    ]
    return sorted(bands, key=lambda b: -b.priority)


@dataclass(frozen=True, slots=True)
class Admission:
    """Flow control's answer: the decision and, for a grant, the endpoint reserved for it."""

    decision: GateDecision
    endpoint: str | None = None
    reserved_at: float | None = None
    waited: float = 0.0


@dataclass(slots=True)
class _Ticket:
    future: asyncio.Future[Admission]
    can_overflow: bool


class FlowControl:
    """One instance's flow control; `start` subscribes and starts the tick, `stop` ends both."""

    def __init__(
        self,
        config: Config,
        board: LoadBoard,
        nc: NATS,
        instance: str,
        metrics: AdmissionMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        admission = config.admission
        self.bands = band_policies(config)
        self._band = {b.name: b for b in self.bands}
        self.scope = config.pinning.bucket
        self.default_band = admission.default_band
        self.queues = FlowQueues(self.bands, admission.queue_capacity_per_band, admission.queue_ttl)
        self.interval = admission.interval
        self._board = board
        self._nc = nc
        self.instance = instance
        self._metrics = metrics
        self._clock = clock
        self._peers: dict[str, FlowState] = {}
        self._cancelled: dict[str, float] = {}
        self._unsent_grants: list[tuple[str, float]] = []
        self._published: dict[str, dict[str, int]] = {}
        self._published_at = 0.0
        self._subs: list[Subscription] = []
        self._tick_task: asyncio.Task[None] | None = None
        self._publishing: set[asyncio.Future[None]] = set()
        self.ticks = 0  # dispatch rounds run so far
        for band in self.bands:  # every band's series exists from the start, at 0
            metrics.queue_depth.labels(band.name).set(0)

    # ---- the request path -------------------------------------------------------------------

    def band(self, name: str | None) -> BandPolicy | None:
        return self._band.get(name or self.default_band)

    def _remote_waiting(self, model: str, now: float) -> dict[str, int]:
        totals: dict[str, int] = {}
        for state in self._peers.values():
            if now - state.at > STATE_FORGET_AFTER:
                continue
            for band, count in state.waiting.get(model, {}).items():
                totals[band] = totals.get(band, 0) + count
        return totals

    def _ahead(self, model: str, band: BandPolicy, now: float) -> int:
        local = self.queues.waiting(model)
        remote = self._remote_waiting(model, now) if self._peers else {}
        return sum(
            local.get(b.name, 0) + remote.get(b.name, 0)
            for b in self.bands
            if b.priority >= band.priority
        )

    def reserve(self, model: str, now: float) -> Admission:
        """A grant: reserve the least saturated endpoint of the model's pool (if it has one)."""
        pool = self._board.pool(model, now)
        endpoint = pool.least_saturated() if pool is not None else None
        if endpoint is None:
            return Admission(GateDecision.GRANTED)
        self.reserve_endpoint(endpoint, now)
        return Admission(GateDecision.GRANTED, endpoint, now)

    def reserve_endpoint(self, endpoint: str, now: float) -> None:
        """Count a grant against `endpoint` here and, by gossip, in every other instance."""
        self._board.record_grant(endpoint, now)
        self._announce_grant(endpoint, now)

    async def admit(
        self, request_id: str, model: str, band: BandPolicy, tenant: str, *, can_overflow: bool
    ) -> Admission:
        now = self._clock()
        if self._cancelled.pop(request_id, None) is not None:
            return Admission(GateDecision.CANCELLED)
        pool = self._board.pool(model, now)
        decision = gate(band, pool, self._ahead(model, band, now))
        if decision is GateDecision.OVERFLOW and not can_overflow:
            decision = GateDecision.QUEUED
        if decision is GateDecision.GRANTED:
            return self.reserve(model, now)
        if decision is GateDecision.OVERFLOW:
            return Admission(GateDecision.OVERFLOW)
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        waiter = Waiter(request_id, model, band.name, tenant, now, _Ticket(future, can_overflow))
        if not self.queues.offer(waiter):
            return Admission(GateDecision.QUEUE_FULL)
        self._metrics.queue_depth.labels(band.name).inc()
        try:
            return await future
        finally:
            if not future.done():  # the NATS handler was cancelled (service stopping)
                self._leave(waiter)

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request; its `admit` returns CANCELLED. False if not queued here."""
        waiter = self.queues.cancel(request_id)
        if waiter is None:
            self._cancelled[request_id] = self._clock()
            return False
        self._resolve(waiter, Admission(GateDecision.CANCELLED), self._clock())
        return True

    def _leave(self, waiter: Waiter) -> None:
        if self.queues.cancel(waiter.request_id) is not None:
            self._metrics.queue_depth.labels(waiter.band).dec()

    def _resolve(self, waiter: Waiter, admission: Admission, now: float) -> None:
        """Answer a waiter that has already left the queue."""
        self._metrics.queue_depth.labels(waiter.band).dec()
        waited = max(0.0, now - waiter.enqueued_at)
        self._metrics.queue_wait.labels(waiter.band, admission.decision.value).observe(waited)
        ticket: _Ticket = waiter.token
        if not ticket.future.done():
            ticket.future.set_result(
                Admission(admission.decision, admission.endpoint, admission.reserved_at, waited)
            )
        elif admission.endpoint is not None and admission.reserved_at is not None:
            self._board.forget_grant(admission.endpoint, admission.reserved_at)

    # ---- the dispatch tick ------------------------------------------------------------------

    def tick(self) -> int:
        """One dispatch round; returns how many waiters it answered."""
        now = self._clock()
        answered = 0
        for waiter in self.queues.expire(now):
            self._resolve(waiter, Admission(GateDecision.EXPIRED), now)
            answered += 1
        for model in self.queues.models():
            answered += self._dispatch(model, now)
        self._publish_state(now)
        if len(self._cancelled) > 1000 or (self._cancelled and answered == 0):
            self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < CANCEL_MEMORY}
        return answered

    def _dispatch(self, model: str, now: float) -> int:
        local = self.queues.waiting(model)
        remote = self._remote_waiting(model, now) if self._peers else {}
        pool = self._board.pool(model, now)
        quota = plan_dispatch(self.bands, pool, local, remote)
        answered = 0
        for band_name, count in quota.items():
            for _ in range(count):
                waiter = self.queues.take(model, band_name)
                if waiter is None:
                    break
                self._resolve(waiter, self.reserve(model, now), now)
                answered += 1
        # Overflow bands held back by saturation leave for an unlimited provider.
        pool = self._board.pool(model, now)
        if pool is None:
            return answered
        saturation = pool.saturation()
        for band in self.bands:
            if band.overflow and saturation > band.ceiling and local.get(band.name):
                answered += self._overflow(model, band.name, now)
        return answered

    def _overflow(self, model: str, band: str, now: float) -> int:
        leaving = self.queues.take_matching(model, band, lambda w: w.token.can_overflow)
        for waiter in leaving:
            self._resolve(waiter, Admission(GateDecision.OVERFLOW), now)
        return len(leaving)

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                self.tick()
                self.ticks += 1
            except Exception:
                log.exception("flow-control tick failed")
            self._metrics.tick_duration.observe(time.perf_counter() - started)
            await asyncio.sleep(self.interval)

    # ---- gossip -----------------------------------------------------------------------------

    def _announce_grant(self, endpoint: str, at: float) -> None:
        if not self._unsent_grants:
            asyncio.get_running_loop().call_soon(self._flush_grants)
        self._unsent_grants.append((endpoint, at))

    def _flush_grants(self) -> None:
        grants, self._unsent_grants = self._unsent_grants, []
        if grants and self._nc.is_connected:
            message = FlowGrants(instance=self.instance, scope=self.scope, grants=grants)
            self._spawn(self._publish(ADMISSION_GRANTS_SUBJECT, message.model_dump_json()))

    def _publish_state(self, now: float) -> None:
        waiting = {model: self.queues.waiting(model) for model in self.queues.models()}
        changed = waiting != self._published
        heartbeat = bool(waiting) and now - self._published_at >= STATE_HEARTBEAT
        if not (changed or heartbeat) or not self._nc.is_connected:
            return
        self._published, self._published_at = waiting, now
        message = FlowState(instance=self.instance, scope=self.scope, at=now, waiting=waiting)
        self._spawn(self._publish(ADMISSION_FLOW_SUBJECT, message.model_dump_json()))

    def _spawn(self, publishing: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(publishing)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, subject: str, payload: str) -> None:
        try:
            await self._nc.publish(subject, payload.encode())
        except Exception as exc:  # gossip is best effort; the next one follows shortly
            log.debug("flow gossip not sent: %s", exc)

    async def _on_flow(self, msg: Msg) -> None:
        try:
            state = FlowState.model_validate_json(msg.data)
        except ValidationError:
            return
        if state.instance != self.instance and state.scope == self.scope:
            if state.waiting:
                self._peers[state.instance] = state
            else:
                self._peers.pop(state.instance, None)

    async def _on_grants(self, msg: Msg) -> None:
        try:
            grants = FlowGrants.model_validate_json(msg.data)
        except ValidationError:
            return
        if grants.instance != self.instance and grants.scope == self.scope:
            for endpoint, at in grants.grants:
                self._board.record_grant(endpoint, at)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = AdmitCancel.model_validate_json(msg.data)
        except ValidationError:
            return
        if self.cancel(cancel.request_id):
            self._metrics.cancellations.inc()

    # ---- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        for subject, handler in (
            (ADMISSION_FLOW_SUBJECT, self._on_flow),
            (ADMISSION_GRANTS_SUBJECT, self._on_grants),
            (ADMISSION_CANCEL_SUBJECT, self._on_cancel),
        ):
            self._subs.append(await self._nc.subscribe(subject, cb=handler))
        self._tick_task = asyncio.create_task(self._run(), name="flow-tick")

    async def stop(self) -> None:
        """Stop dispatching; requests still queued are answered EXPIRED (the edge's 503)."""
        now = self._clock()
        for waiter in self.queues.expire(float("inf")):
            self._resolve(waiter, Admission(GateDecision.EXPIRED), now)
        self._publish_state(now)  # an empty state: peers forget this instance at once
        if self._publishing:
            await asyncio.wait(list(self._publishing), timeout=1)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
            self._tick_task = None
