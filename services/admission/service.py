"""The admission service: decides the requests of the shards it owns, in memory.

Per request (`on_request`, on ``llmgw.v1.admission.request.<shard>`` of every shard this instance
serves): flow control (`FlowControl`) says whether it may run now, waits, or overflows to an
unlimited provider; placement (`llmgw.core.placement`) picks provider, endpoint and what happens
to the session's pin, over one snapshot; the ledger (`llmgw.core.ledger`) takes the lease and
changes the pin. Decision and transition happen in one event-loop turn: atomic, with no I/O on
the way. The common path costs no KV round trip at all: pins are written to the routing bucket
in the background (`PinWriter`), and leases live only here and at the edge.

Lease ownership: a lease granted here is run and renewed by the edge from the reply on; this
instance accounts it until the edge's end message (`on_request_ended`, the broadcast
``llmgw.v1.stats.request``), the edge's complete lease list leaving it out (`on_renewal`),
``lease_timeout`` without a renewal (`expire`), or the shard moving away with it. A reply that
never reaches the edge leaves a lease nobody renews: it expires after ``lease_timeout``.

Asked again: an edge asks again for an attempt that got no answer in time (a NATS node may die
with the ask or the answer in its buffers). An attempt answered here (remembered by its id for
two request timeouts) gets the same answer again: a grant while its lease lives (nothing once
it ended), a refusal as it was; an attempt waiting in the queue here is answered QUEUED again
and its decision goes to the latest ask. So one attempt is decided once by its owner and never
holds two leases from it. A shard's answered grants move with it in a handover, so its new
owner answers an ask again of them the same way too.

Several instances: each owns some shards (`ShardKeeper`, by CAS on the shard keys) and a quota
of each pair's limits (`QuotaKeeper`); they gossip their queues (FlowState) and their live
leases per endpoint (FlowLoad), so every instance sees the same load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmgw.config.schema import Band
from llmgw.core.apikeys import KeyLimits, key_pair
from llmgw.core.breaker import BreakerBoard, BreakerSettings
from llmgw.core.context import ContextNeed, ContextWindow, need_of
from llmgw.core.flow import GateDecision, Waiter
from llmgw.core.keys import pin_key
from llmgw.core.ledger import (
    LeaseKind,
    LeaseRecord,
    Ledger,
    LedgerObserver,
    PinRecord,
    ShardState,
)
from llmgw.core.outcomes import Refusal
from llmgw.core.placement import (
    PinAction,
    Placement,
    PlacementRequest,
    Route,
    Snapshot,
    place,
)
from llmgw.core.prefix import PromptPrefix
from llmgw.core.quota import QuotaCounts
from llmgw.core.requests import Feature
from llmgw.events import EventPublisher, LeaseExpired, PinEvent, PinMoved
from llmgw.logs import request_id
from llmgw.services.admission.balancing import UPSTREAM_FAILURES, RateBoard
from llmgw.services.admission.catalog import ProviderCatalog
from llmgw.services.admission.flow import (
    HELD,
    MOVED,
    Borrowing,
    Cancelled,
    Dispatched,
    Expired,
    FlowControl,
    Held,
    Moved,
    QueueResult,
)
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import PEER_FORGET_AFTER, LoadBoard
from llmgw.services.admission.membership import Membership
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.services.admission.pins import PinWriter
from llmgw.services.admission.prefixes import PrefixBoard
from llmgw.services.admission.quotas import QuotaKeeper
from llmgw.services.admission.shards import ShardContext, ShardKeeper
from llmgw.services.admission.tracing import DecisionSpans
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    ADMISSION_HEALTH_SUBJECT,
    ADMISSION_LOAD_SUBJECT,
    ADMISSION_STATE_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitReply,
    AdmitRequest,
    ContextExceeded,
    FailedAttempt,
    FlowLoad,
    HealthReply,
    LeaseRenewal,
    LeaseRenewalReply,
    PairHolding,
    QuotaLoan,
    QuotaLoanAsk,
    ReplyStatus,
    RequestEnded,
    StateReply,
    Target,
    handover_subject,
    loan_subject,
    trusted,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.state.store import RoutingStore
    from llmgw.tracing import Tracing

log = logging.getLogger("llmgw.admission")

RETRY_AFTER_S = 1.0  # seconds a client is told to wait (Retry-After) after a retryable refusal
ANONYMOUS_TENANT = "anonymous"  # the tenant of requests that name none
_MESSAGES = {
    Refusal.QUEUE_FULL: "Too many requests are waiting in the '{band}' band; retry later.",
    Refusal.QUEUE_TIMEOUT: (
        "The request waited the longest allowed time in the '{band}' band without capacity."
    ),
    Refusal.CANCELLED: "The client went away while queued.",
    Refusal.NOT_OWNER: "This admission instance no longer decides this request's shard.",
    Refusal.MALFORMED: "malformed admission request",
}
_RETRYABLE = frozenset(
    {
        Refusal.NO_CAPACITY,
        Refusal.QUEUE_FULL,
        Refusal.QUEUE_TIMEOUT,
        Refusal.NOT_OWNER,
        Refusal.KEY_LIMIT,
    }
)
_LOAD_HEARTBEAT = 1.0
_ENDED_MEMORY_S = 5.0  # longer than a handover takes (its request times out after 2 s)
_ENDED_MEMORY_MAX = 32_768
# Refusals not repeated to an ask again: NOT_OWNER (asked again, the shard's owner decides) and
# MALFORMED (no attempt id to remember).
_ASKED_ANEW = frozenset({Refusal.NOT_OWNER, Refusal.MALFORMED})
_LOAN_ROUNDS = 2  # borrowing rounds a request may wait for, per pair
# Why a request runs on a third party when it is only our quota that is full: a new session
# (or unpinned request) no managed provider took, a pinned turn over the pair's lease limit.
_QUOTA_OFFLOADS = frozenset({"no_managed_room", "global_limit"})
_ANSWERED_MAX = 65_536  # answers remembered for asks again (they are kept 2 request timeouts)


def limits_from_config(config: Config) -> dict[tuple[str, str], Any]:
    """(provider, model) -> its limits, or None for a pair without configured limits."""
    return {(p.id, m.name): m.limits for p in config.providers for m in p.models}


def offload_reason(placement: Placement) -> str:
    """Why a request runs on an unlimited provider (the `llmgw_admission_offloads` label)."""
    if placement.reason is not None:
        return placement.reason  # overflow, session_limit, global_limit, endpoint_failed, ...
    if placement.route is Route.PINNED:
        return "pinned_there"  # its session's pin is there (and cannot return home yet)
    return "no_managed_room"  # a new pin or an unpinned request that no managed provider took


def _held_back(snapshot: Snapshot, outcome: Placement | Refusal) -> str | None:
    """The first usable managed provider ahead of where the request goes (or of every
    provider, for a refusal) that lacked room here, if any: only then could a loan of quota
    change the placement."""
    chosen = outcome.provider if isinstance(outcome, Placement) else None
    for state in snapshot.providers:
        if state.id == chosen:
            return None
        room = state.room
        if state.managed and state.usable and not (room.pinned and room.unreserved and room.pin):
            return state.id
    return None


def new_token(rng: random.Random) -> str:
    """A fresh 64-bit id (pins, leases): 16 hex digits, a safe key token."""
    return f"{rng.getrandbits(64):016x}"


@dataclass(slots=True)
class _Request:
    """One admission request being decided."""

    request: AdmitRequest
    feature: Feature
    band: Band
    reply_to: str | None
    started: float
    arrived: float = 0.0  # the service clock's time it arrived (a held request expires by it)
    borrowing: bool = False  # waiting for a loan of quota (`_Loan`), not in a queue
    grace_spent: bool = False  # its `limit_grace` ran out while it waited for room
    # It may run on a third party: its band overflows, its overflow budget is not used up, and
    # an unlimited provider serves its model (or a fallback). When not, it waits for our engines.
    can_overflow: bool = True
    prompt: PromptPrefix | None = None  # its prompt's chain, for cache-aware placement
    # What it needs of a context window (None: nothing known, it fits everywhere), and the
    # models that may serve it, in order: its own and its fallbacks, those whose window it
    # fits (`_fitting`). The first is the model whose pool and queue it waits in.
    need: ContextNeed | None = None
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Loan:
    """Placement would send the request elsewhere (a third party, a temporary fallback, a
    refusal) only because this instance's share of `pair` is used up, while the pair's limits
    have room: borrow first, then place it again. `need`: what the request will use of the
    pair (a lease, unreserved or not, and a pin if it creates one); its round borrows what its
    requests together lack of that."""

    pair: tuple[str, str]
    need: QuotaCounts
    overflow: bool = False


@dataclass(frozen=True, slots=True)
class _QuotaWait:
    """Placement would send the request to a third party, or refuse it, only because our quota
    of `pair` is used up (this instance's share, and no loan came). A request of a band that
    waits rather than overflows (a batch band, or one whose overflow budget is used up) waits
    in its queue for room (`FlowControl.hold`; `until` None), as it waits there for engine room:
    batch bands wait for our engines. One of a band that overflows waits for a lease to end
    until `until` (``admission.limit_grace`` after it arrived), then goes where placement
    sends it: a lease's end may be on its way to its owner."""

    pair: tuple[str, str]
    until: float | None = None

    @property
    def in_queue(self) -> bool:
        """It waits in its band's queue (no `until`), not for a lease end."""
        return self.until is None


class AdmissionService:
    """Owns its subscriptions, ledger and background loops; not the connection or the store."""

    def __init__(
        self,
        config: Config,
        nc: NATS,
        store: RoutingStore,
        *,
        instance: str,
        health: HealthBoard | None = None,
        load: LoadBoard | None = None,
        rates: RateBoard | None = None,
        metrics: AdmissionMetrics | None = None,
        events: EventPublisher | None = None,
        observer: LedgerObserver | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self._spans = DecisionSpans(tracing) if tracing is not None else None
        self.nc = nc
        self.store = store
        self._clock = clock
        self._rng = rng or random.Random()
        self.health = health or HealthBoard()
        self.load = load or LoadBoard(config, self.health)
        self.metrics = metrics or AdmissionMetrics()
        self.events = events or EventPublisher(nc, instance, clock=clock)
        pinning = config.pinning
        self.limits = limits_from_config(config)
        self.ledger = Ledger(
            self.limits,
            lease_timeout=pinning.lease_timeout,
            pin_inactivity_timeout=pinning.pin_inactivity_timeout,
            observer=observer,
        )
        self.ledger.on_endpoint_change = self._endpoint_changed
        self.rates = rates or RateBoard(config, rng=self._rng, clock=clock)
        self.breakers = BreakerBoard(
            BreakerSettings(
                failure_threshold=config.router.failure_threshold, cooldown=config.router.cooldown
            ),
            self._rng.random,
        )
        self.prefixes = PrefixBoard(config, self.load, instance, clock=clock)
        self.catalog = ProviderCatalog(
            config,
            self.health,
            self.load,
            self.rates,
            self.breakers,
            self.ledger,
            clock=clock,
            prefixes=self.prefixes,
        )
        self.fleet_revision = 0  # the live fleet's revision applied (services/admission/live.py)
        self.config_revision = 0  # the applied config's revision in force here (0: the file)
        admission = config.admission
        self.membership = Membership(
            store,
            instance,
            heartbeat=admission.heartbeat,
            ttl=admission.member_ttl,
            clock=clock,
            monotonic=monotonic,
        )
        self.quotas = QuotaKeeper(
            store,
            self.ledger,
            self.membership,
            self.limits,
            interval=admission.quota_interval,
            clock=clock,
        )
        self.pins = PinWriter(store, self.ledger)
        self.flow = (
            FlowControl(
                config, self.load, nc, instance, self.metrics, self._dispatch_waiter, clock=clock
            )
            if admission.enabled
            else None
        )
        self.shards = ShardKeeper(
            ShardContext(
                nc=nc,
                store=store,
                membership=self.membership,
                ledger=self.ledger,
                quotas=self.quotas,
                pins=self.pins,
                events=self.events,
                clock=clock,
                settings=admission,
                on_request=self.on_request,
                on_renewal=self.on_renewal,
                drop_queued=self._drop_queued,
                answers_for=self.answers_for,
                remember_answers=self.remember_answers,
                without_ended=self.without_ended,
            )
        )
        self._own_edge_marker: bytes | None = None  # `serve_edge`
        self._follow_models_and_bands(config)
        self._failures_seen: dict[str, float] = {}  # attempt ids the breakers already have
        # Ends of leases not held here, of shards not served here: one may be on its way here
        # in a handover that its end overtook (`without_ended`). Oldest first, bounded.
        self._ended_elsewhere: OrderedDict[str, float] = OrderedDict()
        # Attempts answered here (id -> when, the answer sent, its lease) and attempts waiting in
        # the queue here: an edge that asks again, its answer lost with a NATS node, gets the
        # same answer. An edge asks again within a request timeout of the answer it missed.
        self._answered: OrderedDict[str, tuple[float, bytes, str | None]] = OrderedDict()
        self._answered_for = 2 * config.nats.request_timeout
        self._waiting: dict[str, _Request] = {}
        self._room: asyncio.Future[None] | None = None  # `_room_freed_or`'s, while one waits
        self.answered_again = 0  # asks of an attempt granted or queued here, answered again
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        self._load_scheduled = False
        self._load_changed: set[str] = set()
        self._load_sent_at = 0.0
        self.settle = min(2.0, pinning.lease_timeout / 3)
        # A peer's loan is one request/reply and one CAS: a peer that takes longer is skipped.
        self._loan_timeout = min(0.5, config.nats.request_timeout / 4)

    @property
    def instance(self) -> str:
        return self.membership.instance

    # ---- the request path -------------------------------------------------------------------

    async def on_request(self, msg: Msg) -> None:
        try:
            request = AdmitRequest.model_validate_json(msg.data)
        except ValidationError as exc:
            request_id.set(None)  # not the previous message's (one task runs them all)
            log.warning("malformed admission request: %s", exc.errors()[:1])
            await self._respond(msg.reply, self._refusal("?", Refusal.MALFORMED))
            return
        if not await self._may_decide(request):
            await self._respond(msg.reply, self._refusal(request.id, Refusal.NOT_OWNER))
            return
        if request.id in self._waiting or request.id in self._answered:
            await self._answer_again(request.id, msg.reply)
            return
        traced = self._spans.start(msg.headers, request) if self._spans is not None else None
        try:
            reply = self.begin(request, msg.reply)
            if reply is not None:
                await self._respond(msg.reply, reply)
        finally:
            if traced is not None:
                DecisionSpans.detach(traced)

    async def admit_here(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool] | None:
        """Decide `request` in this process, for an edge that runs this instance beside it
        (``admission.colocated``): what `on_request` does for a message, without one.

        None when this instance does not serve the request's shard now (or handed it away
        while the request was queued): the caller asks the shard's owner over NATS. Else the
        ADMITTED or REFUSED reply and whether the client left while it was queued (then it was
        cancelled here; a grant that raced the cancel carries a lease the caller ends at once).
        """
        try:
            if not await self._may_decide(request):
                return None
        except Exception:  # NATS trouble: let the owner over NATS (or the outage mode) answer
            log.warning("key quota not tracked here; asking over NATS", exc_info=True)
            return None
        started = self._started(request)
        if isinstance(started, AdmitReply):
            return started, False
        context, future = started
        watcher = asyncio.ensure_future(client_gone()) if client_gone is not None else None
        left = False
        try:
            if watcher is not None:
                either: set[asyncio.Future[Any]] = {future, watcher}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if not future.done():  # the client hung up while queued
                    left = True
                    if self.flow is not None and self.flow.cancel(request.id):
                        self.metrics.cancellations.inc()
            result = await future
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
        reply = await self._outcome(context, result)
        if reply.refusal is Refusal.NOT_OWNER:  # the shard moved while it waited
            return None
        return reply, left

    async def _may_decide(self, request: AdmitRequest) -> bool:
        """Whether this instance decides `request` now: it owns the request's shard and is not
        fenced. First, once per key and instance, a share of the key's limit is taken (one book
        read and CAS); after the ownership check nothing may await until the decision (the shard
        could move meanwhile)."""
        # On this decision's log records (and its queue wait's): the id the client knows.
        request_id.set(request.request_id or request.id)
        if request.key is not None and request.key_parallel is not None:
            await self.quotas.track(key_pair(request.key), KeyLimits(request.key_parallel))
        return self.decides(request.shard)

    def decides(self, shard: int) -> bool:
        """Whether this instance decides `shard`'s requests now: it serves the shard and is not
        fenced. Asked again in the same turn as every decision (on arrival, after a loan, when
        the tick lets a queued request go): either may have changed while it waited."""
        return self.shards.serves(shard) and self.membership.can_serve()

    def _started(
        self, request: AdmitRequest
    ) -> AdmitReply | tuple[_Request, asyncio.Future[QueueResult]]:
        """`_start`, with a failure of the service itself answered as a refusal."""
        try:
            return self._start(request)
        except Exception:
            log.exception("admission failed for request %s", request.id)
            return self._refusal(request.id, Refusal.NO_CAPACITY, "The admission service failed.")

    def begin(self, request: AdmitRequest, reply_to: str | None) -> AdmitReply | None:
        """Decide now, or queue (then the answer is sent to `reply_to` later: None)."""
        started = self._started(request)
        if isinstance(started, AdmitReply):
            return started
        context, future = started
        context.reply_to = reply_to
        self._waiting[request.id] = context
        self._spawn(self._wait_in_queue(context, future))
        return None

    async def _answer_again(self, attempt: str, reply_to: str | None) -> None:
        """An edge asked again for an attempt answered or queued here (the answer or the ask may
        have been lost with a NATS node): the same answer, never a second decision or lease. A
        queued one's decision goes to the latest ask's reply subject; a grant whose lease has
        ended since is not answered (its edge had the answer)."""
        self.answered_again += 1
        context = self._waiting.get(attempt)
        if context is not None:
            context.reply_to = reply_to or context.reply_to
            await self._respond(reply_to, AdmitReply(id=attempt, status=ReplyStatus.QUEUED))
            return
        _, answer, lease = self._answered[attempt]
        if reply_to and (lease is None or lease in self.ledger.leases):
            with contextlib.suppress(Exception):
                await self.nc.publish(reply_to, answer)

    async def decide(self, request: AdmitRequest) -> AdmitReply:
        """Decide one request in this process, waiting through the queue as an edge would
        (tests and tools; edges ask over NATS)."""
        started = self._start(request)
        if isinstance(started, AdmitReply):
            return started
        context, future = started
        return await self._outcome(context, await future)

    def _start(
        self, request: AdmitRequest
    ) -> AdmitReply | tuple[_Request, asyncio.Future[QueueResult]]:
        started = time.perf_counter()
        now = self._clock()
        model = request.model
        if model not in self._models:
            return self._refusal(
                request.id, Refusal.UNKNOWN_MODEL, f"The model '{model}' does not exist."
            )
        if request.retry_of is not None:  # the failed attempt's lease goes first, atomically
            self.ledger.release(request.retry_of, now, refresh=False)
        if request.failed is not None:
            self._record_failure(request.failed, now)
        band = self._bands.get(request.band or self.config.admission.default_band)
        if band is None:
            return self._refusal(
                request.id, Refusal.UNKNOWN_BAND, f"Unknown priority band '{request.band}'."
            )
        feature = Feature(request.feature)
        need = need_of(request.prompt_tokens, request.prompt_bytes, request.max_output or 0)
        if request.exceeded is not None:  # an engine refused it for its length: more than that
            need = self._beyond(need, request.exceeded)
        models = (model, *self._fallbacks.get(model, ()))
        fitting = self._fitting(models, feature, need) if need.known else models
        if not fitting and request.max_output is None:  # an older edge: the engine judges
            need, fitting = ContextNeed(), models
        if need.known:
            if not fitting:
                return self._too_long(request, models, feature, need)
            if fitting[0] != model:
                self.metrics.child(self.metrics.window_routes, model, fitting[0]).inc()
            models = fitting
        can_overflow = (
            band.overflow
            and not request.no_overflow  # its overflow budget is used up: it waits for ours
            and any(self.catalog.can_overflow(candidate, feature) for candidate in models)
        )
        prompt = self.prefixes.prompt_of(request) if request.prefix else None
        context = _Request(
            request,
            feature,
            band,
            None,
            started,
            now,
            can_overflow=can_overflow,
            prompt=prompt,
            need=need if need.known else None,
            models=models,
        )
        model = models[0]  # the pool it waits for
        if self.flow is None:
            return self._placed(context, overflow=False)
        policy = self.flow.band(band.name)
        assert policy is not None
        decision = self.flow.check(
            request.id,
            model,
            policy,
            request.tenant or ANONYMOUS_TENANT,
            can_overflow=can_overflow,
            context=context,
        )
        if isinstance(decision, asyncio.Future):
            return context, decision
        self.metrics.child(self.metrics.flow_decisions, band.name, decision.value).inc()
        if decision is GateDecision.GRANTED:
            return self._placed(context, overflow=False)
        if decision is GateDecision.OVERFLOW:
            return self._placed(context, overflow=True)
        refusal = Refusal.CANCELLED if decision is GateDecision.CANCELLED else Refusal.QUEUE_FULL
        return self._refusal(request.id, refusal, band=band.name)

    def _fitting(
        self, models: tuple[str, ...], feature: Feature, need: ContextNeed
    ) -> tuple[str, ...]:
        """The models of `models` with an endpoint whose context window `need` fits."""
        return tuple(m for m in models if self.catalog.fits(m, feature, need))

    def _beyond(self, need: ContextNeed, exceeded: ContextExceeded) -> ContextNeed:
        """`need`, known to exceed the window of the engine that refused it: the window it
        named, else the one known for its endpoint (counted as that endpoint counts); neither:
        nothing more is known (its retry only excludes that endpoint)."""
        endpoint = self.catalog.find_endpoint(exceeded.endpoint)
        known = self.catalog.window(endpoint, exceeded.model) if endpoint is not None else None
        if exceeded.window is not None:
            hold = known.hold_output if known is not None else True
            return need.beyond(ContextWindow(exceeded.window, hold))
        return need.beyond(known) if known is not None else need

    def _too_long(
        self, request: AdmitRequest, models: tuple[str, ...], feature: Feature, need: ContextNeed
    ) -> AdmitReply:
        """The refusal of a request that fits no endpoint of its model or of its fallbacks."""
        self.metrics.child(self.metrics.window_routes, request.model, "none").inc()
        largest = max(
            (w for m in models if (w := self.catalog.largest_window(m, feature)) is not None),
            default=None,
        )
        needs = f"{'' if need.exact else 'at least '}{need.tokens()} tokens"
        where = "This model's" if len(models) == 1 else "This model's (and its fallbacks')"
        return self._refusal(
            request.id,
            Refusal.CONTEXT_LENGTH_EXCEEDED,
            f"{where} maximum context length is {largest} tokens. However, your request needs "
            f"{needs} ({need.prompt} in the prompt, {max(1, need.output)} for the output). "
            "Please reduce the length of the messages or of the output.",
        )

    def _placed(
        self, context: _Request, *, overflow: bool
    ) -> AdmitReply | tuple[_Request, asyncio.Future[QueueResult]]:
        """Place now, or (a loan of quota would keep the request on our engines) wait for the
        loan in a task and place then."""
        placed = self._place_or_borrow(context, overflow=overflow)
        if isinstance(placed, AdmitReply):
            return self._finish(context, placed)
        if isinstance(placed, _QuotaWait) and placed.in_queue:
            return context, self._hold(context)
        context.borrowing = True
        return context, asyncio.ensure_future(self._borrowed(context, placed))

    def _hold(self, context: _Request) -> asyncio.Future[QueueResult]:
        """Queue `context` at the head of its band's queue (`_QuotaWait`)."""
        assert self.flow is not None  # only requests of a band that waits are held
        request = context.request
        self.metrics.child(self.metrics.quota_holds, context.band.name).inc()
        return self.flow.hold(
            request.id,
            context.models[0] if context.models else request.model,
            context.band.name,
            request.tenant or ANONYMOUS_TENANT,
            context.arrived,
            context,
        )

    async def _borrowed(self, context: _Request, loan: _Loan | _QuotaWait) -> QueueResult:
        """`_after_loan` as a wait's result (a request that waits for a loan, not a queue)."""
        return Dispatched(await self._after_loan(context, loan))

    async def _after_loan(self, context: _Request, loan: _Loan | _QuotaWait) -> AdmitReply:
        """Borrow `loan.need`, then place the request in the turn the loan lands (placement
        decides again: the loan may have brought nothing, or others may have used it). A
        request may need a loan of each of its pairs (its API key's, then a provider's), and a
        second round of a pair when requests that did not wait took what the first brought:
        `_LOAN_ROUNDS` per pair at most. A request held for quota (`_QuotaWait`) waits in its
        queue, and borrows afresh when the tick lets it go again."""
        request = context.request
        tried: list[tuple[str, str]] = []  # one entry per round waited for, by pair
        overflow = isinstance(loan, _Loan) and loan.overflow

        def place_now() -> AdmitReply | _Loan | _QuotaWait:
            if not self.decides(request.shard):
                return self._refusal(request.id, Refusal.NOT_OWNER)
            placed = self._place(context, overflow=overflow, loans=True, tried=tried)
            return self._finish(context, placed) if isinstance(placed, AdmitReply) else placed

        result: AdmitReply | _Loan | _QuotaWait = loan
        while not isinstance(result, AdmitReply):
            if isinstance(result, _QuotaWait) and result.until is not None:  # not in_queue
                if not await self._room_freed_or(result.until):
                    context.grace_spent = True
                tried.clear()
                result = place_now()
                continue
            if isinstance(result, _QuotaWait):
                if context.borrowing:  # it waits in a queue now: its edge waits longer
                    context.borrowing = False
                    queued = AdmitReply(id=request.id, status=ReplyStatus.QUEUED)
                    await self._respond(context.reply_to, queued)
                match await self._hold(context):
                    case Dispatched(reply):
                        return reply
                    case Borrowing(again):
                        tried.clear()
                        result = again
                        continue
                    case ended:
                        return self._final(context, ended)
            tried.append(result.pair)
            try:
                result = await self.quotas.loans.borrow(result.pair, result.need, place_now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("borrowing for request %s failed", request.id, exc_info=True)
                if not self.decides(request.shard):
                    return self._refusal(request.id, Refusal.NOT_OWNER)
                return self._finish(context, self.place(context, overflow=overflow))
        return result

    async def _outcome(self, context: _Request, result: QueueResult) -> AdmitReply:
        """The answer for a request that waited (queue or loan), from what it resolved to; a
        queued request dispatched into a loan waits for the loan here."""
        if isinstance(result, Borrowing):
            result = Dispatched(await self._after_loan(context, result.loan))
        return self._final(context, result)

    def _final(self, context: _Request, result: QueueResult) -> AdmitReply:
        """The answer for a queued request, from what its queue future resolved to."""
        refusal: Refusal
        match result:
            case Dispatched(reply):
                return reply
            case Expired():
                refusal = Refusal.QUEUE_TIMEOUT
            case Cancelled():
                refusal = Refusal.CANCELLED
            case Moved() | Borrowing():  # moved away (a loan is waited for in `_outcome`)
                refusal = Refusal.NOT_OWNER
        self.metrics.child(self.metrics.flow_decisions, context.band.name, str(refusal)).inc()
        return self._refusal(context.request.id, refusal, band=context.band.name)

    async def _wait_in_queue(self, context: _Request, future: asyncio.Future[QueueResult]) -> None:
        request = context.request
        try:
            if not context.borrowing:  # a loan takes a round trip or two: no QUEUED for it
                queued = AdmitReply(id=request.id, status=ReplyStatus.QUEUED)
                await self._respond(context.reply_to, queued)
            final = await self._outcome(context, await future)
            await self._respond(context.reply_to, final)  # the latest ask's (read after the wait)
        finally:
            self._waiting.pop(request.id, None)

    def _dispatch_waiter(
        self, waiter: Waiter, decision: GateDecision
    ) -> Dispatched | Borrowing[_Loan | _QuotaWait] | Held | Moved:
        """The tick let a queued request go: place it now (synchronously, inside the tick), say
        which loan it waits for first (`_outcome`), or send it back to the head of its queue
        (`_QuotaWait`). Not if this instance no longer decides its shard (fenced, or the shard
        is leaving): it goes back to its edge, which asks the owner; another instance may have
        claimed the shard and pinned the session already."""
        context: _Request = waiter.token.context
        if not self.decides(context.request.shard):
            return MOVED
        placed = self._place_or_borrow(context, overflow=decision is GateDecision.OVERFLOW)
        if isinstance(placed, _QuotaWait) and placed.in_queue:
            self.metrics.child(self.metrics.quota_holds, context.band.name).inc()
            return HELD
        self.metrics.child(self.metrics.flow_decisions, context.band.name, decision.value).inc()
        if isinstance(placed, AdmitReply):
            return Dispatched(self._finish(context, placed))
        return Borrowing(placed)

    def _finish(self, context: _Request, reply: AdmitReply) -> AdmitReply:
        self.metrics.decision_duration.observe(time.perf_counter() - context.started)
        return reply

    def _place_or_borrow(
        self, context: _Request, *, overflow: bool
    ) -> AdmitReply | _Loan | _QuotaWait:
        """`place`, unless this instance's share of a limit is all that keeps the request off
        the provider a lone instance holding the whole limit would run it on: then the loan
        it needs first; or, for a request of a band that waits, quota alone keeps it off our
        engines: then it waits (`_QuotaWait`)."""
        return self._place(context, overflow=overflow, loans=True)

    def _room_freed(self) -> None:
        """A lease ended here, or a peer's request ended: room may be back for requests held
        for quota (the queue's, at the next tick; those in their `limit_grace`, at once)."""
        if self.flow is not None:
            self.flow.room_freed()
        if self._room is not None:
            if not self._room.done():
                self._room.set_result(None)
            self._room = None

    async def _room_freed_or(self, until: float) -> bool:
        """Until `_room_freed` (True), or for as long as the service clock took to reach `until`
        (False)."""
        remaining = until - self._clock()
        if remaining <= 0:
            return False
        if self._room is None:
            self._room = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._room), remaining)
        except TimeoutError:
            return False
        return True

    def _waits_for_ours(self, context: _Request) -> bool:
        """Whether the request waits for our engines rather than runs on a third party: it may
        not overflow (its band does not, its overflow budget is used up, or no third party
        serves its model: a band with nowhere to overflow waits like any other), and flow
        control runs."""
        return self.flow is not None and not context.can_overflow

    def place(self, context: _Request, *, overflow: bool) -> AdmitReply:
        """Place the request, take its lease and change its pin: one synchronous step."""
        placed = self._place(context, overflow=overflow, loans=False)
        assert isinstance(placed, AdmitReply)
        return placed

    def _place(
        self,
        context: _Request,
        *,
        overflow: bool,
        loans: bool,
        tried: Sequence[tuple[str, str]] = (),
    ) -> AdmitReply | _Loan | _QuotaWait:
        """`place`; with `loans`, a request that only this instance's share of a limit keeps
        from its place gets the `_Loan` it needs instead (nothing taken or changed), at most
        `_LOAN_ROUNDS` per pair (`tried`: the pairs of the rounds it waited for already); past
        those, a request of a band that waits (`_QuotaWait`) is held rather than sent to a
        third party or refused."""
        request = context.request
        now = self._clock()
        if not self.ledger.key_room(request.key):  # checked and granted in this one step
            if loans and request.key is not None:
                pair = key_pair(request.key)
                if tried.count(pair) < _LOAN_ROUNDS and self.quotas.loans.spare(pair) is not None:
                    return _Loan(pair, QuotaCounts(1, 1, 0), overflow)  # what the request will use
            return self._refusal(
                request.id,
                Refusal.KEY_LIMIT,
                f"This API key already has {request.key_parallel} requests in flight, its "
                "max_parallel_requests.",
            )
        outcome: Placement | Refusal = Refusal.NO_CAPACITY
        models = context.models or (request.model,)
        served = models[0]
        too_long = True  # every model's snapshot said CONTEXT_LENGTH_EXCEEDED (the windows
        # changed since the request arrived)
        pin: PinRecord | None = None
        waits = loans and not overflow and self._waits_for_ours(context)
        grace_until = context.arrived + self.config.admission.limit_grace
        brief = (
            loans and not overflow and not waits and not context.grace_spent and now < grace_until
        )
        held: tuple[str, str] | None = None  # a managed pair whose quota alone held it back
        for candidate in models:
            snapshot, pin = self.catalog.snapshot(
                candidate,
                context.feature,
                request.session,
                request.exclude,
                now,
                context.prompt,
                request.parent,
                context.need,
            )
            asked = PlacementRequest(
                request.session, context.band.interactive, overflow, self._rng.random()
            )
            outcome = place(snapshot, asked)
            if outcome is Refusal.CONTEXT_LENGTH_EXCEEDED:
                continue
            too_long = False
            lacking = _held_back(snapshot, outcome) if loans and not overflow else None
            if lacking is not None:
                loan = self._loan_for(snapshot, asked, outcome, candidate)
                if loan is not None and tried.count(loan.pair) < _LOAN_ROUNDS:
                    return loan
                if (waits or brief) and held is None:
                    held = (lacking, candidate)
            if isinstance(outcome, Placement):
                served = candidate
                break
            if outcome is Refusal.UNSUPPORTED and candidate == request.model:
                return self._refusal(
                    request.id,
                    Refusal.UNSUPPORTED,
                    f"No provider serves '{request.model}' for {request.feature} requests.",
                )
        if held is not None and (
            not isinstance(outcome, Placement)
            or (
                self.catalog.is_unlimited(outcome.provider)
                and offload_reason(outcome) in _QUOTA_OFFLOADS
            )
        ):
            return _QuotaWait(held, None if waits else grace_until)
        if too_long and context.need is not None and request.max_output is not None:
            return self._too_long(request, models, context.feature, context.need)
        if not isinstance(outcome, Placement):
            return self._refusal(
                request.id,
                Refusal.NO_CAPACITY,
                f"No provider can take a '{request.model}' request right now.",
            )
        if served != models[0]:  # (one that fits no window of its model counts in window_routes)
            self.metrics.child(self.metrics.fallbacks, request.model, served).inc()
        lease = self._apply(request, outcome, served, pin, now)
        endpoint = self.catalog.endpoint_config(outcome.endpoint)
        if context.prompt is not None and not self.catalog.is_unlimited(outcome.provider):
            share, index = self.prefixes.placed(endpoint.id, served, context.prompt, now)
            self.metrics.child(self.metrics.prefix_share, index).observe(share)
        self.breakers.take(endpoint.id, now)  # half open: this request is the probe
        self.metrics.child(self.metrics.placements, outcome.provider, outcome.route.value).inc()
        if outcome.affinity_break is not None:
            self.metrics.child(
                self.metrics.affinity_breaks, outcome.provider, outcome.affinity_break
            ).inc()
        if self.catalog.is_unlimited(outcome.provider):
            self.metrics.child(
                self.metrics.offloads, outcome.provider, offload_reason(outcome)
            ).inc()
        # The decision's own values (`trusted`: no re-validation on the decision path).
        return trusted(
            AdmitReply,
            id=request.id,
            status=ReplyStatus.ADMITTED,
            target=trusted(
                Target,
                provider=outcome.provider,
                provider_kind=self.catalog.kind(outcome.provider).value,
                endpoint=endpoint.id,
                url=endpoint.url,
                upstream_model=endpoint.upstream_name(served),
                priority=self._engine_priority[context.band.name]
                if endpoint.priority_scheduling
                else None,
            ),
            lease=lease,
            route=outcome.route.value,
            served_model=served,
            refresh=outcome.refresh_pin_on_success,
            owner=self.instance,
        )

    def _loan_for(
        self, snapshot: Snapshot, asked: PlacementRequest, outcome: Any, model: str
    ) -> _Loan | None:
        """The loan that would let the request run where a lone instance would run it: the
        placement over the same snapshot with every managed pair's room as if this instance
        held what it could borrow (`QuotaKeeper.spare`). None when that changes nothing."""
        spares = {}
        providers = []
        for state in snapshot.providers:
            spare = self.quotas.loans.spare((state.id, model)) if state.managed else None
            if spare is not None:
                spares[state.id] = spare
                room = self.ledger.room(state.id, model, spare)
                state = replace(state, room=room)
            providers.append(state)
        if not spares:
            self.quotas.loans.held_back()  # held back, and nothing seems to be had
            return None
        ideal = place(replace(snapshot, providers=tuple(providers)), asked)
        if (
            not isinstance(ideal, Placement)
            or ideal.provider not in spares
            or (
                isinstance(outcome, Placement)
                and (outcome.provider, outcome.route) == (ideal.provider, ideal.route)
            )
        ):
            return None
        # What the request will use there (the round borrows what its requests lack together).
        unreserved = 0 if ideal.lease_kind is LeaseKind.PINNED else 1
        pin = 1 if ideal.pin_action is not PinAction.NONE and not ideal.evict else 0
        return _Loan((ideal.provider, model), QuotaCounts(1, unreserved, pin), asked.overflow)

    def _apply(
        self,
        request: AdmitRequest,
        placement: Placement,
        model: str,
        pin: PinRecord | None,
        now: float,
    ) -> LeaseRecord:
        """The ledger transitions of a placement (and the pin writes and events they cause)."""
        provider = placement.provider
        session = request.session
        listed: PinRecord | None = None
        if placement.evict:
            self._evict(provider, model, now)
        if placement.pin_action is PinAction.CREATE:
            assert session is not None
            key = pin_key(request.shard, model, session)
            listed = self.ledger.create_pin(
                key,
                new_token(self._rng),
                provider,
                model,
                session,
                request.shard,
                now,
                request.parent,
            )
            self.pins.put(listed)
            self._pin_event(PinEvent, listed, "pin.created")
        elif placement.pin_action is PinAction.MOVE:
            assert pin is not None
            listed = self.ledger.move_pin(pin, new_token(self._rng), provider, now)
            self.pins.put(listed)
            self.events.emit(
                PinMoved,
                provider=provider,
                model=model,
                session=listed.session,
                pin_id=listed.pin_id,
                shard=listed.shard,
                from_provider=pin.provider,
                from_pin_id=pin.pin_id,
                reason=placement.reason or "moved",
            )
            if placement.route is Route.RETURNED_HOME:
                self.metrics.returned_home.labels(pin.provider, provider).inc()
        elif placement.route is Route.PINNED:
            listed = pin
        return self.ledger.grant(
            new_token(self._rng),
            provider,
            model,
            placement.lease_kind,
            shard=request.shard,
            edge=request.edge,
            now=now,
            session=session,
            pin=listed,
            endpoint=placement.endpoint,
            key=request.key,
        )

    def _evict(self, provider: str, model: str, now: float) -> None:
        victims = self.ledger.to_evict(provider, model, now, self.catalog.min_idle_before_evict)
        if not victims:
            # placement saw them: nothing changed in between (same turn)
            raise RuntimeError("no pin to evict")
        for victim in victims:
            self._evict_pin(victim, now)

    def _evict_one(self, provider: str, model: str, now: float) -> bool:
        """Evict the pair's least recently used evictable pin, if it has one."""
        victim = self.ledger.evictable(provider, model, now, self.catalog.min_idle_before_evict)
        if victim is None:
            return False
        self._evict_pin(victim, now)
        return True

    def _evict_pin(self, victim: PinRecord, now: float) -> None:
        self.ledger.remove_pin(victim, now, "evicted")
        self.pins.delete(victim)
        self.metrics.pins_evicted.labels(victim.provider).inc()
        self._pin_event(PinEvent, victim, "pin.evicted")

    def _pin_event(self, kind: type[PinEvent], pin: PinRecord, event: str) -> None:
        self.events.emit(
            kind,
            event=event,
            provider=pin.provider,
            model=pin.model,
            session=pin.session,
            pin_id=pin.pin_id,
            shard=pin.shard,
            parent=pin.parent,
        )

    def _refusal(
        self, request_id: str, refusal: Refusal, message: str | None = None, *, band: str = ""
    ) -> AdmitReply:
        self.metrics.child(self.metrics.rejections, refusal.value).inc()
        return AdmitReply(
            id=request_id,
            status=ReplyStatus.REFUSED,
            refusal=refusal,
            message=message or _MESSAGES.get(refusal, "").format(band=band) or None,
            retry_after=RETRY_AFTER_S if refusal in _RETRYABLE else None,
        )

    async def _respond(self, reply_to: str | None, reply: AdmitReply) -> None:
        if self._spans is not None:
            self._spans.replied(reply)
        answer = reply.model_dump_json(exclude_none=True).encode()
        if reply.status is not ReplyStatus.QUEUED and reply.refusal not in _ASKED_ANEW:
            self._remember_answer(reply, answer)
        if reply_to:
            with contextlib.suppress(Exception):
                await self.nc.publish(reply_to, answer)

    def _remember_answer(self, reply: AdmitReply, answer: bytes) -> None:
        answered, now = self._answered, self._clock()
        answered[reply.id] = (now, answer, reply.lease.lease_id if reply.lease else None)
        while answered and (
            len(answered) > _ANSWERED_MAX
            or now - next(iter(answered.values()))[0] > self._answered_for
        ):
            answered.popitem(last=False)

    def answers_for(self, state: ShardState) -> tuple[AdmitReply, ...]:
        """The grants answered here whose leases move with `state` (a handover): the new owner
        answers an ask again of those attempts with the same grant, never a second lease."""
        moving = {lease.lease_id for lease in state.leases}
        return tuple(
            AdmitReply.model_validate_json(answer)
            for _, answer, lease in self._answered.values()
            if lease in moving
        )

    def _follow_models_and_bands(self, config: Config) -> None:
        """The tables the decisions read from `config.models` and `config.admission.bands`."""
        bands = config.admission.bands
        self._bands = {b.name: b for b in bands}
        self._models = frozenset(m.name for m in config.models)  # canonical names (wire values)
        ranked = sorted(bands, key=lambda b: -b.priority)
        self._engine_priority = {b.name: index for index, b in enumerate(ranked)}
        self._fallbacks = {m.name: tuple(m.fallbacks) for m in config.models}

    def follow_config(self, config: Config) -> int:
        """Decide by `config`'s models (names, fallbacks), bands and queue bounds from the next
        decision on, and expire idle pins after its `pin_inactivity_timeout` (an applied
        config; `live.apply_fleet` swaps the rest). Queued requests of a removed band are
        answered (`FlowControl.reconfigure`); returns how many."""
        self._follow_models_and_bands(config)
        self.ledger.pin_inactivity_timeout = config.pinning.pin_inactivity_timeout
        return self.flow.reconfigure(config) if self.flow is not None else 0

    def _drop_queued(self, shard: int) -> None:
        """The shard moved away: its queued requests are answered `Moved` (NOT_OWNER: their
        edges ask its new owner)."""
        if self.flow is not None:
            self.flow.drop(lambda context: context.request.shard == shard)

    def remember_answers(self, answers: tuple[AdmitReply, ...]) -> None:
        """Answers of a handover's attempts whose leases were taken in here (`answers_for`)."""
        for reply in answers:
            if reply.lease is not None and reply.lease.lease_id in self.ledger.leases:
                self._remember_answer(reply, reply.model_dump_json(exclude_none=True).encode())

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- what edges tell us ---------------------------------------------------------------------

    def _record_failure(self, failed: FailedAttempt, now: float) -> None:
        """A retry's failed attempt: the breakers learn it before the retry is placed (its
        RequestEnded may arrive later; `_failures_seen` keeps it from counting twice)."""
        if failed.attempt in self._failures_seen:
            return
        self._failures_seen[failed.attempt] = now
        if failed.outcome in UPSTREAM_FAILURES:
            self.breakers.record(
                failed.endpoint, False, now, retry_after=failed.retry_after, at_once=failed.refused
            )

    async def on_request_ended(self, msg: Msg) -> None:
        if self._own_edge_marker is not None and self._own_edge_marker in msg.data:
            return  # the colocated edge's own end: applied already (`ended_here`)
        try:
            ended = RequestEnded.model_validate_json(msg.data)
        except ValidationError:
            return
        self.ended_here(ended)

    def serve_edge(self, edge: str) -> None:
        """This instance runs in edge `edge`'s process (``admission.colocated``): that edge hands
        its ends to `ended_here` and this instance ignores their copies on NATS. The marker is
        the bytes that the edge's compact JSON holds for its `edge` field; no other field's
        string can hold them (quotes inside strings are escaped)."""
        self._own_edge_marker = f'"edge":"{edge}"'.encode()

    def ended_here(self, ended: RequestEnded) -> bool:
        """Apply an end: release its lease here if it is this instance's, then feed the balancer
        and the breakers. True if its lease (or none) was settled here: for the colocated edge
        (which calls this in process), what is left for the others on NATS (balancer sample,
        breaker evidence) may then wait a few milliseconds."""
        now = self._clock()
        settled = True
        if ended.lease is not None:
            released = self.ledger.release(ended.lease, now, refresh=ended.refresh and ended.ok)
            if released is None:
                settled = False
                if ended.shard is not None and not self.shards.serves(ended.shard):
                    self._remember_ended(ended.lease, now)
            else:
                self._room_freed()
        if not ended.sent:
            return settled
        self.rates.add(ended)
        if ended.id in self._failures_seen:
            return settled
        if ended.ok or ended.outcome in UPSTREAM_FAILURES:
            self.breakers.record(
                ended.endpoint,
                ended.ok,
                now,
                retry_after=None if ended.ok else ended.retry_after,
                at_once=ended.refused,
            )
        return settled

    def _remember_ended(self, lease_id: str, now: float) -> None:
        remembered = self._ended_elsewhere
        remembered[lease_id] = now
        while remembered and (
            len(remembered) > _ENDED_MEMORY_MAX
            or now - next(iter(remembered.values())) > _ENDED_MEMORY_S
        ):
            remembered.popitem(last=False)

    def without_ended(self, state: ShardState) -> ShardState:
        """`state` less the leases whose end reached this instance before the shard did (the
        giver had taken them out, the end found them nowhere): taken in, they would stay here
        until ``lease_timeout`` with nobody to end them (their edge renews them no more)."""
        remembered = self._ended_elsewhere
        if not remembered:
            return state
        kept = tuple(lease for lease in state.leases if lease.lease_id not in remembered)
        for lease in state.leases:
            remembered.pop(lease.lease_id, None)
        return state if len(kept) == len(state.leases) else replace(state, leases=kept)

    async def on_renewal(self, msg: Msg) -> None:
        try:
            renewal = LeaseRenewal.model_validate_json(msg.data)
        except ValidationError:
            return
        if not self.decides(renewal.shard):
            return  # no answer: the edge tries again (the new owner answers)
        now = self._clock()
        refused: list[str] = []
        if renewal.claims:  # grants the edge made alone during a NATS outage
            claims = tuple(c for c in renewal.claims if c.shard == renewal.shard)
            dropped, _ = self.ledger.add_shard(ShardState(renewal.shard, (), claims), now)
            refused = sorted(lease.lease_id for lease in dropped)
            refused += sorted(c.lease_id for c in renewal.claims if c.shard != renewal.shard)
            if refused:
                log.warning(
                    "edge %s: %d outage grants do not fit this instance's quota yet",
                    renewal.edge,
                    len(refused),
                )
        lost = self.ledger.renew(
            renewal.edge, renewal.shard, renewal.leases, now, settle=self.settle
        )
        if refused:  # listed too, but not ours: neither lost nor renewed
            not_taken = set(refused)
            lost = [lease_id for lease_id in lost if lease_id not in not_taken]
        if msg.reply:
            reply = LeaseRenewalReply(
                lost=tuple(lost),
                refused=tuple(refused),
                owner=self.instance,
                edges=len(self.ledger.edges()),
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, reply.model_dump_json().encode())

    # ---- load gossip --------------------------------------------------------------------------

    def _endpoint_changed(self, endpoint: str, count: int) -> None:
        self.load.set_own(endpoint, count, self._clock())
        if self.load.knows(endpoint):
            self._load_changed.add(endpoint)
            if not self._load_scheduled and self.membership.has_peers():
                # Sent at the next loop turn, batching this turn's changes: peers must see a
                # grant before their next dispatch tick, or each would spend the same headroom.
                self._load_scheduled = True
                asyncio.get_running_loop().call_soon(self._send_load, False)

    def _send_load(self, full: bool) -> None:
        self._load_scheduled = False
        now = self._clock()
        endpoints = self.load.endpoints() if full else sorted(self._load_changed)
        self._load_changed.clear()
        if full:
            self._load_sent_at = now
        message = FlowLoad(
            instance=self.instance,
            scope=self.config.pinning.bucket,
            at=now,
            full=full,
            inflight={e: self.ledger.endpoint_leases(e) for e in endpoints},
        )
        if self.nc.is_connected:
            self._spawn(self.nc.publish(ADMISSION_LOAD_SUBJECT, message.model_dump_json().encode()))

    async def on_load(self, msg: Msg) -> None:
        try:
            load = FlowLoad.model_validate_json(msg.data)
        except ValidationError:
            return
        if load.instance != self.instance and load.scope == self.config.pinning.bucket:
            fewer = self.load.peer_load(
                load.instance, load.at, load.inflight, self._clock(), full=load.full
            )
            if fewer:  # a request of the peer's ended: it may lend again
                self.quotas.loans.peer_freed(load.instance)
                self._room_freed()

    # ---- housekeeping -------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """One pass of expiry: leases not renewed, idle pins; lazy pin refreshes."""
        for lease in self.ledger.expired_leases(now):
            self.metrics.leases_expired.labels(lease.provider).inc()
            self.events.emit(
                LeaseExpired,
                provider=lease.provider,
                model=lease.model,
                lease_id=lease.lease_id,
                edge=lease.edge,
                shard=lease.shard,
                session=lease.session,
                pin_id=lease.pin_id,
            )
        for pin in self.ledger.idle_pins(now):
            self.ledger.remove_pin(pin, now, "expired")
            self.pins.delete(pin)
            self._pin_event(PinEvent, pin, "pin.expired")
        refresh_every = self.config.pinning.pin_inactivity_timeout / 4
        for pin in list(self.ledger.pins_to_refresh(refresh_every)):
            self.pins.put(pin)
        if self._failures_seen:
            self._failures_seen = {k: t for k, t in self._failures_seen.items() if now - t < 60.0}
        if now - self._load_sent_at >= _LOAD_HEARTBEAT and len(self.membership.live()) > 1:
            self._send_load(True)

    async def _housekeeping(self) -> None:
        interval = self.config.pinning.reaper_interval
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                if self.membership.can_serve() and not self._stopping:
                    self.expire(self._clock())
                live = self.membership.live()
                for peer in list(self.load._peers):
                    if peer not in live:
                        self.load.forget_peer(peer)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping failed")

    # ---- health and state ---------------------------------------------------------------------

    async def _on_health(self, msg: Msg) -> None:
        if msg.reply:
            reply = HealthReply(
                service="admission",
                instance=self.instance,
                shards=len(self.shards.serving),
                serving=self.membership.can_serve(),
            )
            await self.nc.publish(msg.reply, reply.model_dump_json().encode())

    async def _on_state(self, msg: Msg) -> None:
        if not msg.reply:
            return
        pairs = []
        for pair, use in sorted(self.ledger.use.items()):
            quota = self.ledger.pair_quota(pair)
            pairs.append(
                PairHolding(
                    provider=pair[0],
                    model=pair[1],
                    leases=use.leases,
                    unreserved=use.unreserved,
                    pins=use.pins,
                    g=quota.g if quota else None,
                    u=quota.u if quota else None,
                    p=quota.p if quota else None,
                )
            )
        kinds: dict[str, int] = {}
        by_endpoint: dict[str, int] = {}
        for lease in self.ledger.leases.values():
            kinds[lease.kind.value] = kinds.get(lease.kind.value, 0) + 1
            if lease.endpoint is not None:
                by_endpoint[lease.endpoint] = by_endpoint.get(lease.endpoint, 0) + 1
        reply = StateReply(
            instance=self.instance,
            shards=tuple(sorted(self.shards.serving)),
            pairs=tuple(pairs),
            leases_by_kind=kinds,
            edges=len(self.ledger.edges()),
            leases_by_endpoint=by_endpoint,
            prefixes=self.prefixes.summary(),
            fleet_revision=self.fleet_revision,
            config_revision=self.config_revision,
        )
        await self.nc.publish(msg.reply, reply.model_dump_json().encode())

    # ---- loans of quota between instances --------------------------------------------------

    async def _ask_loan(
        self, peer: str, pair: tuple[str, str], need: QuotaCounts
    ) -> tuple[QuotaCounts, int] | None:
        """Ask `peer` to lend quota of `pair` (`QuotaKeeper.borrow`'s transport)."""
        ask = QuotaLoanAsk(
            borrower=self.instance,
            provider=pair[0],
            model=pair[1],
            g=need.leases,
            u=need.unreserved,
            p=need.pins,
        )
        try:
            msg = await self.nc.request(
                loan_subject(peer), ask.model_dump_json().encode(), timeout=self._loan_timeout
            )
            loan = QuotaLoan.model_validate_json(msg.data)
        except Exception:  # no responders, a timeout, NATS trouble: place without it
            log.debug("no loan from %s for %s", peer, pair, exc_info=True)
            return None
        return QuotaCounts(loan.g, loan.u, loan.p), loan.revision

    def _evict_for_loan(self, pair: tuple[str, str], count: int) -> int:
        """Evict up to `count` idle pins of `pair` (those a new pin here would evict) so that
        their pin quota can be lent to a peer; returns how many went."""
        now = self._clock()
        evicted = 0
        while evicted < count and self._evict_one(*pair, now):
            evicted += 1
        return evicted

    async def _on_loan_ask(self, msg: Msg) -> None:
        try:
            ask = QuotaLoanAsk.model_validate_json(msg.data)
        except ValidationError:
            log.warning("malformed quota loan request")
            return
        lent, revision = QuotaCounts(), 0
        if self.membership.can_serve():
            try:
                lent, revision = await self.quotas.loans.lend(
                    ask.borrower, (ask.provider, ask.model), QuotaCounts(ask.g, ask.u, ask.p)
                )
            except Exception:
                log.warning("lending quota of %s failed", (ask.provider, ask.model), exc_info=True)
        if msg.reply:
            answer = QuotaLoan(g=lent.leases, u=lent.unreserved, p=lent.pins, revision=revision)
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, answer.model_dump_json().encode())

    # ---- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.ensure_layout(self.config.admission.shards)
        self.membership.on_lost = self._lost
        await self.membership.join()
        for subject, handler in (
            (ADMISSION_HEALTH_SUBJECT, self._on_health),
            (ADMISSION_STATE_SUBJECT, self._on_state),
            (REQUEST_STATS_SUBJECT, self.on_request_ended),
            (ADMISSION_LOAD_SUBJECT, self.on_load),
            (handover_subject(self.instance), self.shards.on_handover),
            (loan_subject(self.instance), self._on_loan_ask),
        ):
            self._subs.append(await self.nc.subscribe(subject, cb=handler))
        self.quotas.loans.ask_loan = self._ask_loan
        self.quotas.loans.evict_idle = self._evict_for_loan
        self.quotas.joins.evict_idle = self._evict_for_loan
        await self.quotas.start()
        if self.flow is not None:
            await self.flow.start()
        await self.prefixes.start(self.nc)  # reads the recent past while the shards come in
        await self.shards.start()
        self._loops.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        await self.nc.flush()

    def _lost(self) -> None:
        """Fenced, or the member key was taken away: drop everything and join again under a new
        id (unless stopping: then the shards are left to be claimed)."""
        if self.membership.fenced_at is not None:
            self.ledger.observer.fenced(self.membership.fenced_at)
        if self._stopping:
            return
        self._spawn(self._rejoin())

    async def _rejoin(self) -> None:
        old = self.instance
        await self.shards.drop_all()
        self.quotas.earmarks.forget()
        for sub in list(self._subs):
            if sub.subject in (handover_subject(old), loan_subject(old)):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                self._subs.remove(sub)
        new = f"{old.rsplit('-r', 1)[0]}-r{new_token(self._rng)[:6]}"
        await self.membership.rejoin(new)
        self._subs.append(
            await self.nc.subscribe(handover_subject(new), cb=self.shards.on_handover)
        )
        self._subs.append(await self.nc.subscribe(loan_subject(new), cb=self._on_loan_ask))
        await self.quotas.adjust()

    async def stop(self) -> None:
        """Hand every shard over (or release it), give back unused quota, leave."""
        self._stopping = True
        await cancel_and_wait(self._loops)
        await self.shards.stop()
        if self.flow is not None:
            await self.flow.stop()
        if self.nc.is_connected:  # else nothing lands: the next owners adopt from the bucket
            await self.pins.drain()
            await self.quotas.leave()
        await self.quotas.stop()
        await self.prefixes.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        await self.membership.leave(write=self.nc.is_connected)

    def live_peers(self) -> int:
        now = self._clock()
        return sum(1 for at, _ in self.load._peers.values() if now - at <= PEER_FORGET_AFTER)


__all__ = ["AdmissionService", "LeaseKind", "limits_from_config"]
