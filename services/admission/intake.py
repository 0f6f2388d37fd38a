"""Intake: where an admission request enters, and its first decision.

Per request (`on_request`, on ``llmgw.v1.admission.request.<shard>`` of every shard this
instance serves; `admit_here` in the colocated edge's process; `decide` for tests and tools):
whether this instance decides it (it serves the shard and is not fenced), an ask again of an
attempt answered or queued here (the same answer), then the checks that need no placement (an
unknown model or band, a context window it fits nowhere) and flow control's gate
(`FlowControl.check`): granted or overflowing, it is placed at once (`Waiting.placed`), queued
it waits (`Waiting`), else refused.

`Intake` reads the catalog and tables of `Current`, releases a retry's failed attempt's lease
before deciding the retry, and hands a retry's failure to the breakers (`LeaseUpkeep`); it
places, waits and answers only through the rooms that own those.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmgw.core.apikeys import KeyLimits, key_pair
from llmgw.core.context import ContextNeed, ContextWindow, need_of
from llmgw.core.flow import GateDecision
from llmgw.core.outcomes import Refusal
from llmgw.core.requests import Feature
from llmgw.logs import request_id
from llmgw.services.admission.decision import ANONYMOUS_TENANT, Current, Deciding
from llmgw.services.admission.flow import QueueResult
from llmgw.services.admission.tracing import DecisionSpans
from llmgw.wire import AdmitReply, AdmitRequest, ContextExceeded, ReplyStatus

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from llmgw.core.ledger import Ledger
    from llmgw.services.admission.answers import Answers
    from llmgw.services.admission.flow import FlowControl
    from llmgw.services.admission.metrics import AdmissionMetrics
    from llmgw.services.admission.placing import Placer
    from llmgw.services.admission.prefixes import PrefixBoard
    from llmgw.services.admission.quotas import QuotaKeeper
    from llmgw.services.admission.upkeep import LeaseUpkeep
    from llmgw.services.admission.waiting import Waiting

log = logging.getLogger("llmgw.admission")


class Intake:
    """The entry of admission requests: who decides, asked again, checks, the gate."""

    def __init__(
        self,
        current: Current,
        ledger: Ledger,
        *,
        waiting: Waiting,
        placer: Placer,
        answers: Answers,
        upkeep: LeaseUpkeep,
        quotas: QuotaKeeper,
        prefixes: PrefixBoard,
        metrics: AdmissionMetrics,
        decides: Callable[[int], bool],
        spawn: Callable[[Awaitable[Any]], None],
        clock: Callable[[], float],
        spans: DecisionSpans | None = None,
    ) -> None:
        self.current = current
        self.ledger = ledger
        self.waiting = waiting
        self.placer = placer
        self.answers = answers
        self.upkeep = upkeep
        self.quotas = quotas  # an API key's quota is tracked on its first request here
        self.prefixes = prefixes
        self.metrics = metrics
        self.decides = decides  # whether this instance decides a shard's requests now
        self._spawn = spawn
        self._clock = clock
        self._spans = spans
        self.answered_again = 0  # asks of an attempt granted or queued here, answered again

    @property
    def flow(self) -> FlowControl | None:
        return self.waiting.flow

    async def on_request(self, msg: Msg) -> None:
        try:
            request = AdmitRequest.model_validate_json(msg.data)
        except ValidationError as exc:
            request_id.set(None)  # not the previous message's (one task runs them all)
            log.warning("malformed admission request: %s", exc.errors()[:1])
            await self.answers.respond(msg.reply, self.answers.refusal("?", Refusal.MALFORMED))
            return
        if not await self.may_decide(request):
            await self.answers.respond(
                msg.reply, self.answers.refusal(request.id, Refusal.NOT_OWNER)
            )
            return
        if request.id in self.waiting.queued or self.answers.knows(request.id):
            await self._answer_again(request.id, msg.reply)
            return
        traced = self._spans.start(msg.headers, request) if self._spans is not None else None
        try:
            reply = self.begin(request, msg.reply)
            if reply is not None:
                await self.answers.respond(msg.reply, reply)
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
            if not await self.may_decide(request):
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
        reply = await self.waiting.outcome(context, result)
        if reply.refusal is Refusal.NOT_OWNER:  # the shard moved while it waited
            return None
        return reply, left

    async def may_decide(self, request: AdmitRequest) -> bool:
        """Whether this instance decides `request` now: it owns the request's shard and is not
        fenced. First, once per key and instance, a share of the key's limit is taken (one book
        read and CAS); after the ownership check nothing may await until the decision (the shard
        could move meanwhile)."""
        # On this decision's log records (and its queue wait's): the id the client knows.
        request_id.set(request.request_id or request.id)
        if request.key is not None and request.key_parallel is not None:
            await self.quotas.track(key_pair(request.key), KeyLimits(request.key_parallel))
        return self.decides(request.shard)

    def _started(
        self, request: AdmitRequest
    ) -> AdmitReply | tuple[Deciding, asyncio.Future[QueueResult]]:
        """`_start`, with a failure of the service itself answered as a refusal."""
        try:
            return self._start(request)
        except Exception:
            log.exception("admission failed for request %s", request.id)
            return self.answers.refusal(
                request.id, Refusal.NO_CAPACITY, "The admission service failed."
            )

    def begin(self, request: AdmitRequest, reply_to: str | None) -> AdmitReply | None:
        """Decide now, or queue (then the answer is sent to `reply_to` later: None)."""
        started = self._started(request)
        if isinstance(started, AdmitReply):
            return started
        context, future = started
        context.reply_to = reply_to
        self.waiting.queued[request.id] = context
        self._spawn(self.waiting.wait_in_queue(context, future))
        return None

    async def _answer_again(self, attempt: str, reply_to: str | None) -> None:
        """An edge asked again for an attempt answered or queued here (the answer or the ask may
        have been lost with a NATS node): the same answer, never a second decision or lease. A
        queued one's decision goes to the latest ask's reply subject; a grant whose lease has
        ended since is not answered (its edge had the answer)."""
        self.answered_again += 1
        context = self.waiting.queued.get(attempt)
        if context is not None:
            context.reply_to = reply_to or context.reply_to
            await self.answers.respond(reply_to, AdmitReply(id=attempt, status=ReplyStatus.QUEUED))
            return
        await self.answers.again(attempt, reply_to)

    async def decide(self, request: AdmitRequest) -> AdmitReply:
        """Decide one request in this process, waiting through the queue as an edge would
        (tests and tools; edges ask over NATS)."""
        started = self._start(request)
        if isinstance(started, AdmitReply):
            return started
        context, future = started
        return await self.waiting.outcome(context, await future)

    def _start(
        self, request: AdmitRequest
    ) -> AdmitReply | tuple[Deciding, asyncio.Future[QueueResult]]:
        started = time.perf_counter()
        now = self._clock()
        model = request.model
        if model not in self.current.models:
            return self.answers.refusal(
                request.id, Refusal.UNKNOWN_MODEL, f"The model '{model}' does not exist."
            )
        if request.retry_of is not None:  # the failed attempt's lease goes first, atomically
            self.ledger.release(request.retry_of, now, refresh=False)
        if request.failed is not None:
            self.upkeep.record_failure(request.failed, now)
        band = self.current.bands.get(request.band or self.current.config.admission.default_band)
        if band is None:
            return self.answers.refusal(
                request.id, Refusal.UNKNOWN_BAND, f"Unknown priority band '{request.band}'."
            )
        feature = Feature(request.feature)
        need = need_of(request.prompt_tokens, request.prompt_bytes, request.max_output or 0)
        if request.exceeded is not None:  # an engine refused it for its length: more than that
            need = self._beyond(need, request.exceeded)
        models = (model, *self.current.fallbacks.get(model, ()))
        fitting = self.fitting(models, feature, need) if need.known else models
        if not fitting and request.max_output is None:  # an older edge: the engine judges
            need, fitting = ContextNeed(), models
        if need.known:
            if not fitting:
                return self.placer.too_long(request, models, feature, need)
            if fitting[0] != model:
                self.metrics.child(self.metrics.window_routes, model, fitting[0]).inc()
            models = fitting
        can_overflow = (
            band.overflow
            and not request.no_overflow  # its overflow budget is used up: it waits for ours
            and any(self.current.catalog.can_overflow(candidate, feature) for candidate in models)
        )
        prompt = self.prefixes.prompt_of(request) if request.prefix else None
        context = Deciding(
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
            return self.waiting.placed(context, overflow=False)
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
            return self.waiting.placed(context, overflow=False)
        if decision is GateDecision.OVERFLOW:
            return self.waiting.placed(context, overflow=True)
        refusal = Refusal.CANCELLED if decision is GateDecision.CANCELLED else Refusal.QUEUE_FULL
        return self.answers.refusal(request.id, refusal, band=band.name)

    def fitting(
        self, models: tuple[str, ...], feature: Feature, need: ContextNeed
    ) -> tuple[str, ...]:
        """The models of `models` with an endpoint whose context window `need` fits."""
        return tuple(m for m in models if self.current.catalog.fits(m, feature, need))

    def _beyond(self, need: ContextNeed, exceeded: ContextExceeded) -> ContextNeed:
        """`need`, known to exceed the window of the engine that refused it: the window it
        named, else the one known for its endpoint (counted as that endpoint counts); neither:
        nothing more is known (its retry only excludes that endpoint)."""
        endpoint = self.current.catalog.find_endpoint(exceeded.endpoint)
        known = (
            self.current.catalog.window(endpoint, exceeded.model) if endpoint is not None else None
        )
        if exceeded.window is not None:
            hold = known.hold_output if known is not None else True
            return need.beyond(ContextWindow(exceeded.window, hold))
        return need.beyond(known) if known is not None else need
