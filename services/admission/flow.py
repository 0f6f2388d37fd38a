"""Flow control inside one admission instance: queues, the dispatch tick and gossip with peers.

Flow control answers *when*; placement (`llmgw.core.placement`) answers *where*. The decisions
are `llmgw.core.flow`'s; this adapter owns the asyncio side:

- `check` gates an arriving request: GRANTED when nobody of its pool waits ahead of it and the
  pool is within its band's ceiling (work conservation: an unsaturated pool costs one
  synchronous check, no tick, no wait), OVERFLOW when the pool is above the ceiling of a band
  that overflows, QUEUE_FULL, or a future that the tick resolves;
- the tick runs every ``admission.interval`` while a request waits here (with nothing queued it
  runs once a second, `IDLE_TICK`, and a request queued wakes it at once): expires, then
  dispatches each pool's queues by
  `plan_dispatch`. Between two ticks, room coming back (`room_freed`: a lease ended here, a
  peer's request ended) dispatches at once (`release`, once per event-loop turn however many
  ended in it): a queued request waits for a batch slot, not for the next tick; Each dispatched waiter is handed to ``dispatch`` *synchronously, inside the
  tick*: the service places it and counts it on its endpoint before the next waiter is
  considered, so the tick never grants on a load that does not include its own grants. The
  waiter's future then carries whatever ``dispatch`` returned, unless that was `Held`: only
  quota kept it off our engines and its band waits rather than overflows, so it goes back to
  the head of its queue, and that model's held bands wait until `room_freed` (or
  `HOLD_RECHECK`) before the tick lets any go again (`hold` does the same for a request that
  was not in the queue: it arrived, or waited for a loan);
- a queued request's future resolves to a `QueueResult`: `Dispatched` (the reply the service
  placed it with), `Borrowing` (placement waits for a loan of quota first), `Expired`,
  `Cancelled` or `Moved` (its shard went to another instance, or this instance fenced itself:
  its edge asks the owner; the tick hands such a waiter back instead of placing it);
- this instance's waiting counts go to the others on ADMISSION_FLOW_SUBJECT when they change
  (at most once per tick) and every second while non-empty; theirs feed `plan_dispatch`'s
  ``remote`` and the arrival check, so a band waiting in another instance is not overtaken.

Semantics across instances (docs/architecture.md, "Flow control"): all instances work against
one shared load (the same scraper reports, every instance's live leases by `FlowLoad` gossip);
together they grant at most a pool's headroom plus one request per other instance with waiters
in the band per dispatch round; strict priority holds across instances as far as gossip has
arrived (< 1 ms on one NATS server); an instance that dies takes its queue with it (its clients
get 503 admission_unavailable: nothing is leaked, a waiting request holds no lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import ValidationError

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.flow import BandPolicy, FlowQueues, GateDecision, Waiter, gate, plan_dispatch
from llmgw.tasks import cancel_and_wait
from llmgw.wire import ADMISSION_CANCEL_SUBJECT, ADMISSION_FLOW_SUBJECT, AdmitCancel, FlowState

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.services.admission.loadboard import LoadBoard
    from llmgw.services.admission.metrics import AdmissionMetrics
    from llmgw.wire import AdmitReply

log = logging.getLogger("llmgw.admission.flow")

STATE_HEARTBEAT = 1.0  # seconds between FlowState messages while anything waits
STATE_FORGET_AFTER = 3.0  # a peer's state older than this is dropped (the peer is gone)
CANCEL_MEMORY = 5.0  # seconds a cancel for a request not (yet) queued here is remembered
# Seconds a model's held bands (`Held`) wait at most for news that room may have come back
# (`room_freed`: a lease ended here, a peer's request ended) before the tick tries them again.
HOLD_RECHECK = 0.1
IDLE_TICK = 1.0  # seconds between ticks while nothing waits here (housekeeping only)

L = TypeVar("L")


@dataclass(frozen=True, slots=True)
class Dispatched:
    """The tick let it go and the service placed it: `reply` is its answer (a grant or a
    refusal)."""

    reply: AdmitReply
    label: ClassVar[str] = "granted"


@dataclass(frozen=True, slots=True)
class Borrowing(Generic[L]):
    """The tick let it go, but placement waits for a loan of quota first (the service's
    `loan`: what to borrow, then it places the request)."""

    loan: L
    label: ClassVar[str] = "granted"


@dataclass(frozen=True, slots=True)
class Held:
    """The tick let it go, but only quota kept it off our engines and its band waits rather
    than overflows (the service's placement would have sent it to a third party): it goes back
    to the head of its queue. Never a future's result."""

    label: ClassVar[str] = "held"


HELD = Held()


@dataclass(frozen=True, slots=True)
class Expired:
    """It waited ``queue_ttl`` (or flow control stopped, or dispatching it failed)."""

    label: ClassVar[str] = "expired"


@dataclass(frozen=True, slots=True)
class Cancelled:
    """Its client went away while it waited."""

    label: ClassVar[str] = "cancelled"


@dataclass(frozen=True, slots=True)
class Moved:
    """Its shard went to another instance while it waited, or this instance fenced itself: its
    edge asks the owner."""

    label: ClassVar[str] = "dropped"


EXPIRED, CANCELLED, MOVED = Expired(), Cancelled(), Moved()
# What a queued request's future resolves to: closed, one case per way a wait ends.
QueueResult = Dispatched | Borrowing[Any] | Expired | Cancelled | Moved
# Places a waiter the tick let go, synchronously inside the tick (or hands it back, `Moved`:
# this instance no longer decides its shard).
Dispatch = Callable[[Waiter, GateDecision], Dispatched | Borrowing[Any] | Held | Moved]


def band_policies(config: Config) -> list[BandPolicy]:
    bands = [
        BandPolicy(b.name, b.priority, b.saturation_ceiling, b.overflow, b.batch_headroom)
        for b in config.admission.bands
    ]
    return sorted(bands, key=lambda b: -b.priority)


@dataclass(slots=True)
class Ticket:
    """A queued request's handle: the future its handler awaits, and the service's context."""

    future: asyncio.Future[QueueResult]
    can_overflow: bool
    context: Any


class FlowControl:
    """One instance's flow control; `start` subscribes and starts the tick, `stop` ends both."""

    def __init__(
        self,
        config: Config,
        board: LoadBoard,
        nc: NATS,
        instance: str,
        metrics: AdmissionMetrics,
        dispatch: Dispatch,
        *,
        clock: Clock | TimeSource = SYSTEM,
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
        self._dispatch = dispatch
        self._clock = wall_of(clock)
        self._peers: dict[str, FlowState] = {}
        self._cancelled: dict[str, float] = {}
        # model -> when a waiter of it was last put back (`Held`): its held bands wait for
        # `room_freed` or HOLD_RECHECK before the tick lets any of them go again.
        self._held: dict[str, float] = {}
        self._published: dict[str, dict[str, int]] = {}
        self._published_at = 0.0
        self._subs: list[Subscription] = []
        self._tick_task: asyncio.Task[None] | None = None
        self._idle: asyncio.Future[None] | None = None  # the tick's wait while nothing waits
        self._room: asyncio.Future[None] | None = None  # its wait between ticks (`room_freed`)
        self._publishing: set[asyncio.Future[None]] = set()
        self.ticks = 0  # dispatch rounds run so far by the tick
        self.releases = 0  # dispatch rounds run so far because room came back (`release`)
        for band in self.bands:  # every band's series exists from the start, at 0
            metrics.queue_depth.labels(band.name).set(0)

    def reconfigure(self, config: Config) -> int:
        """Run on `config`'s band table, default band, queue capacity and TTL (an applied
        config), between two ticks: queued requests of a kept band keep their places; those of a removed band are
        answered `Moved`, so their edges ask again and get what any request of a band that
        does not exist gets (refused, unknown band). Returns how many were answered."""
        self.bands = band_policies(config)
        self._band = {b.name: b for b in self.bands}
        self.default_band = config.admission.default_band
        self.queues.resize(config.admission.queue_capacity_per_band, config.admission.queue_ttl)
        now = self._clock()
        gone = self.queues.reband(self.bands)
        for waiter in gone:
            self._resolve(waiter, MOVED, now, decision="dropped")
        for band in self.bands:
            self._metrics.queue_depth.labels(band.name).set(self.queues.depth(band.name))
        return len(gone)

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
        if not local and not remote:  # nobody waits for the model (most requests)
            return 0
        return sum(
            local.get(b.name, 0) + remote.get(b.name, 0)
            for b in self.bands
            if b.priority >= band.priority
        )

    def check(
        self,
        request_id: str,
        model: str,
        band: BandPolicy,
        tenant: str,
        *,
        can_overflow: bool,
        context: Any = None,
    ) -> GateDecision | asyncio.Future[QueueResult]:
        """GRANTED / OVERFLOW (place it now), QUEUE_FULL or CANCELLED (refuse it), or the future
        of its place in the queue (resolved by the tick with ``dispatch``'s result, or with
        `Expired`, `Cancelled` or `Moved`)."""
        now = self._clock()
        if self._cancelled.pop(request_id, None) is not None:
            return GateDecision.CANCELLED
        pool = self._board.pool(model, now)
        decision = gate(band, pool, self._ahead(model, band, now))
        if decision is GateDecision.OVERFLOW and not can_overflow:
            decision = GateDecision.QUEUED
        if decision is not GateDecision.QUEUED:
            return decision
        future: asyncio.Future[QueueResult] = asyncio.get_running_loop().create_future()
        waiter = Waiter(
            request_id, model, band.name, tenant, now, Ticket(future, can_overflow, context)
        )
        if not self.queues.offer(waiter):
            return GateDecision.QUEUE_FULL
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)  # the tick runs at once, then every interval
        self._metrics.queue_depth.labels(band.name).inc()
        future.add_done_callback(functools.partial(self._abandoned, waiter=waiter))
        return future

    def _abandoned(self, future: asyncio.Future[QueueResult], waiter: Waiter) -> None:
        """The handler awaiting this future was cancelled (the service is stopping)."""
        if future.cancelled() and self.queues.cancel(waiter.request_id) is not None:
            self._metrics.queue_depth.labels(waiter.band).dec()

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request; its future gets `Cancelled`. False if not queued here."""
        waiter = self.queues.cancel(request_id)
        if waiter is None:
            self._cancelled[request_id] = self._clock()
            return False
        self._resolve(waiter, CANCELLED, self._clock())
        return True

    def hold(
        self,
        request_id: str,
        model: str,
        band: str,
        tenant: str,
        enqueued_at: float,
        context: Any,
    ) -> asyncio.Future[QueueResult]:
        """Queue again, at the head of its queue, a request that left it (or never waited) and
        that only quota keeps off our engines (`Held`); it expires `queue_ttl` after
        `enqueued_at`, when it first arrived. The future resolves as a queued request's does."""
        now = self._clock()
        future: asyncio.Future[QueueResult] = asyncio.get_running_loop().create_future()
        waiter = Waiter(
            request_id, model, band, tenant, enqueued_at, Ticket(future, False, context)
        )
        self._metrics.queue_depth.labels(band).inc()
        if self._cancelled.pop(request_id, None) is not None:  # its client left meanwhile
            self._resolve(waiter, CANCELLED, now)
            return future
        self._put_back(waiter, now)
        future.add_done_callback(functools.partial(self._abandoned, waiter=waiter))
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        return future

    def _put_back(self, waiter: Waiter, now: float) -> None:
        """`waiter` to the head of its queue, its model's held bands waiting for news of room."""
        self.queues.offer(waiter, first=True)
        self._held[waiter.model] = now

    def room_freed(self) -> None:
        """Room may have come back (a lease ended here, a peer's request ended): held bands
        may be tried again, and the queues are dispatched at once (`release`) rather than at
        the next tick."""
        if self._held:
            self._held.clear()
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    def drop(self, wanted: Callable[[Any], bool], result: QueueResult = MOVED) -> int:
        """Answer every queued request whose context `wanted` accepts with `result` (`Moved`:
        their shard moved away, they ask its new owner)."""
        now = self._clock()
        dropped = 0
        for model in self.queues.models():
            for band in self.bands:
                for waiter in self.queues.take_matching(
                    model, band.name, lambda w: wanted(w.token.context)
                ):
                    self._resolve(waiter, result, now, decision="dropped")
                    dropped += 1
        return dropped

    def _resolve(
        self, waiter: Waiter, result: QueueResult, now: float, decision: str | None = None
    ) -> None:
        """Answer a waiter that has already left the queue."""
        self._metrics.queue_depth.labels(waiter.band).dec()
        waited = max(0.0, now - waiter.enqueued_at)
        label = decision or result.label
        self._metrics.queue_wait.labels(waiter.band, label).observe(waited)
        ticket: Ticket = waiter.token
        if not ticket.future.done():
            ticket.future.set_result(result)

    # ---- the dispatch tick ------------------------------------------------------------------

    def tick(self) -> int:
        """One dispatch round; returns how many waiters it answered."""
        now = self._clock()
        answered = 0
        for waiter in self.queues.expire(now):
            self._resolve(waiter, EXPIRED, now)
            answered += 1
        for model in self.queues.models():
            answered += self._dispatch_pool(model, now)
        self._publish_state(now)
        if len(self._cancelled) > 1000 or (self._cancelled and answered == 0):
            self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < CANCEL_MEMORY}
        return answered

    def release(self) -> int:
        """Dispatch the queues now (room came back between two ticks); expiry and gossip stay
        with the tick. Returns how many waiters it answered."""
        now = self._clock()
        return sum(self._dispatch_pool(model, now) for model in self.queues.models())

    def _run_dispatch(self, waiter: Waiter, decision: GateDecision, now: float) -> bool:
        """Let `waiter` go with `decision`; False if it came back to the head of its queue
        (`Held`)."""
        result: QueueResult | Held
        try:
            result = self._dispatch(waiter, decision)
        except Exception:
            log.exception("dispatching request %s failed", waiter.request_id)
            result = EXPIRED
        if isinstance(result, Held):
            self._put_back(waiter, now)
            return False
        label = None if isinstance(result, Moved) else decision.value  # handed back: "dropped"
        self._resolve(waiter, result, now, decision=label)
        return True

    def _dispatch_pool(self, model: str, now: float) -> int:
        local = self.queues.waiting(model)
        held_at = self._held.get(model)
        if held_at is not None:
            if now - held_at < HOLD_RECHECK:  # no news of room yet: overflow bands only
                local = {b: n for b, n in local.items() if self._band[b].overflow}
            else:
                del self._held[model]
        remote = self._remote_waiting(model, now) if self._peers else {}
        pool = self._board.pool(model, now)
        quota = plan_dispatch(self.bands, pool, local, remote)
        answered = 0
        for band_name, count in quota.items():
            for _ in range(count):
                waiter = self.queues.take(model, band_name)
                if waiter is None:
                    break
                if not self._run_dispatch(waiter, GateDecision.GRANTED, now):
                    break  # the band's next waiters would be held too
                answered += 1
        # Overflow bands held back (saturation above the ceiling, or no room for one more once
        # the grants above were made) leave for an unlimited provider: they do not wait. Those
        # that may not overflow (their overflow budget is used up) stay for our engines.
        pool = self._board.pool(model, now)
        if pool is None:
            return answered
        for band in self.bands:
            if band.overflow and local.get(band.name) and pool.full_for(band):
                leaving = self.queues.take_matching(
                    model, band.name, lambda w: w.token.can_overflow
                )
                for waiter in leaving:
                    self._run_dispatch(waiter, GateDecision.OVERFLOW, now)
                answered += len(leaving)
        return answered

    async def _run(self) -> None:
        while self._tick_task is not None:
            started = time.perf_counter()
            try:
                self.tick()
                self.ticks += 1
            except Exception:
                log.exception("flow-control tick failed")
            self._metrics.tick_duration.observe(time.perf_counter() - started)
            if len(self.queues):
                await self._between_ticks()
            else:
                await self._idle_wait()

    async def _between_ticks(self) -> None:
        """``interval`` until the next tick, releasing the queues whenever room comes back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.interval
        while len(self.queues) and (remaining := deadline - loop.time()) > 0:
            self._room = room = loop.create_future()
            timer = loop.call_later(remaining, _wake, room)
            try:
                await room
            finally:
                timer.cancel()
                self._room = None
            if len(self.queues) and loop.time() < deadline:
                try:
                    self.release()
                    self.releases += 1
                except Exception:
                    log.exception("flow-control release failed")

    async def _idle_wait(self) -> None:
        """Until a request is queued here, or `IDLE_TICK` (expiring cancels, gossip)."""
        loop = asyncio.get_running_loop()
        self._idle = idle = loop.create_future()
        timer = loop.call_later(IDLE_TICK, _wake, idle)
        try:
            await idle
        finally:
            timer.cancel()
            self._idle = None

    # ---- gossip -----------------------------------------------------------------------------

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

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = AdmitCancel.model_validate_json(msg.data)
        except ValidationError:
            return
        if self.cancel(cancel.id):
            self._metrics.cancellations.inc()

    # ---- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        for subject, handler in (
            (ADMISSION_FLOW_SUBJECT, self._on_flow),
            (ADMISSION_CANCEL_SUBJECT, self._on_cancel),
        ):
            self._subs.append(await self._nc.subscribe(subject, cb=handler))
        self._tick_task = asyncio.create_task(self._run(), name="flow-tick")

    async def stop(self) -> None:
        """Stop dispatching; requests still queued are answered EXPIRED (the edge's 503)."""
        now = self._clock()
        for waiter in self.queues.expire(float("inf")):
            self._resolve(waiter, EXPIRED, now)
        self._publish_state(now)  # an empty state: peers forget this instance at once
        if self._publishing:
            await asyncio.wait(list(self._publishing), timeout=1)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._tick_task is not None:
            task, self._tick_task = self._tick_task, None
            await cancel_and_wait([task])


def _wake(idle: asyncio.Future[None]) -> None:
    if not idle.done():
        idle.set_result(None)
