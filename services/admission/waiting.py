"""Flow: a request's way from its arrival to its decision, when that is not at once.

A request that flow control queues (`FlowControl.check`), that waits for a loan of quota
(`Loan`), or that is held for quota (`QuotaWait`: in its band's queue, or for a lease's end
within ``admission.limit_grace``) waits here; the tick that lets a queued request go places it
synchronously inside the tick (`dispatch`), and a loan's request is placed in the turn the loan
lands. Each wait ends in one answer (`outcome`): the placement's, or a refusal (the queue's
timeout, a cancel, the shard moving away).

`Waiting` owns the queued requests' futures and the wait for room; it places through the
`Placer`, borrows through `Loans` and answers through `Answers`, and reads whether this
instance still decides a shard (`decides`) before every decision it makes after a wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.core.flow import GateDecision, Waiter
from llmgw.core.outcomes import Refusal
from llmgw.services.admission.decision import Deciding, Loan, QuotaWait
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
from llmgw.wire import AdmitReply, ReplyStatus

if TYPE_CHECKING:
    from llmgw.services.admission.answers import Answers
    from llmgw.services.admission.loans import Loans
    from llmgw.services.admission.metrics import AdmissionMetrics
    from llmgw.services.admission.placing import Placer

log = logging.getLogger("llmgw.admission")


class Waiting:
    """Requests waiting for their decision: in a queue, for a loan, or for room."""

    def __init__(
        self,
        placer: Placer,
        loans: Loans,
        answers: Answers,
        metrics: AdmissionMetrics,
        *,
        decides: Callable[[int], bool],
        clock: Callable[[], float],
    ) -> None:
        self.placer = placer
        self.loans = loans
        self.answers = answers
        self.metrics = metrics
        self.decides = decides  # whether this instance decides a shard's requests now
        self._clock = clock
        self.flow: FlowControl | None = None  # set by the service: flow control runs
        # Attempts waiting here, answered QUEUED so far: an ask again of one is answered QUEUED
        # again, and its decision goes to the latest ask's reply subject.
        self.queued: dict[str, Deciding] = {}
        self._room: asyncio.Future[None] | None = None  # `_room_freed_or`'s, while one waits
        # `room_freed` calls so far: a request that placed when it was n and would wait for room
        # looks again at once if it has moved on since (room freed while it was borrowing).
        self._freed = 0

    def placed(
        self, context: Deciding, *, overflow: bool
    ) -> AdmitReply | tuple[Deciding, asyncio.Future[QueueResult]]:
        """Place now, or (a loan of quota would keep the request on our engines) wait for the
        loan in a task and place then."""
        placed = self.placer.place_or_borrow(context, overflow=overflow)
        if isinstance(placed, AdmitReply):
            return self.finish(context, placed)
        if isinstance(placed, QuotaWait) and placed.in_queue:
            return context, self.hold(context)
        context.borrowing = True
        return context, asyncio.ensure_future(self._borrowed(context, placed, self._freed))

    def hold(self, context: Deciding) -> asyncio.Future[QueueResult]:
        """Queue `context` at the head of its band's queue (`QuotaWait`)."""
        assert self.flow is not None  # only requests of a band that waits are held
        request = context.request
        self.metrics.child(self.metrics.quota_holds, context.band.name).inc()
        return self.flow.hold(
            request.id,
            context.models[0] if context.models else request.model,
            context.band.name,
            context.tenant,
            context.arrived,
            context,
        )

    async def _borrowed(self, context: Deciding, loan: Loan | QuotaWait, seen: int) -> QueueResult:
        """`_after_loan` as a wait's result (a request that waits for a loan, not a queue)."""
        return Dispatched(await self._after_loan(context, loan, seen))

    async def _after_loan(
        self, context: Deciding, loan: Loan | QuotaWait, seen: int | None = None
    ) -> AdmitReply:
        """Borrow `loan.need`, then place the request in the turn the loan lands (placement
        decides again: the loan may have brought nothing, or others may have used it). A
        request may need a loan of each of its pairs (its API key's, then a provider's), and a
        second round of a pair when requests that did not wait took what the first brought:
        two per pair at most (placing.py's ``_LOAN_ROUNDS``). A request held for quota
        (`QuotaWait`) waits in its queue, and borrows afresh when the tick lets it go again.
        `seen`: `room_freed`'s count when `loan` was decided (room freed since is looked at at
        once, not waited for)."""
        request = context.request
        seen = self._freed if seen is None else seen
        tried: list[tuple[str, str]] = []  # one entry per round waited for, by pair
        overflow = isinstance(loan, Loan) and loan.overflow

        def place_now() -> AdmitReply | Loan | QuotaWait:
            nonlocal seen
            seen = self._freed
            if not self.decides(request.shard):
                return self.answers.refusal(request.id, Refusal.NOT_OWNER)
            placed = self.placer.place_or_borrow(context, overflow=overflow, tried=tried)
            return self.finish(context, placed) if isinstance(placed, AdmitReply) else placed

        result: AdmitReply | Loan | QuotaWait = loan
        while not isinstance(result, AdmitReply):
            if isinstance(result, QuotaWait) and result.until is not None:  # not in_queue
                if self._freed == seen and not await self._room_freed_or(result.until):
                    context.grace_spent = True
                tried.clear()
                result = place_now()
                continue
            if isinstance(result, QuotaWait):
                if context.borrowing:  # it waits in a queue now: its edge waits longer
                    context.borrowing = False
                    queued = AdmitReply(id=request.id, status=ReplyStatus.QUEUED)
                    await self.answers.respond(context.reply_to, queued)
                match await self.hold(context):
                    case Dispatched(reply):
                        return reply
                    case Borrowing(again):
                        tried.clear()
                        seen = self._freed
                        result = again
                        continue
                    case ended:
                        return self.final(context, ended)
            tried.append(result.pair)
            try:
                result = await self.loans.borrow(result.pair, result.need, place_now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("borrowing for request %s failed", request.id, exc_info=True)
                if not self.decides(request.shard):
                    return self.answers.refusal(request.id, Refusal.NOT_OWNER)
                return self.finish(context, self.placer.place(context, overflow=overflow))
        return result

    async def outcome(self, context: Deciding, result: QueueResult) -> AdmitReply:
        """The answer for a request that waited (queue or loan), from what it resolved to; a
        queued request dispatched into a loan waits for the loan here."""
        if isinstance(result, Borrowing):
            result = Dispatched(await self._after_loan(context, result.loan))
        return self.final(context, result)

    def final(self, context: Deciding, result: QueueResult) -> AdmitReply:
        """The answer for a queued request, from what its queue future resolved to."""
        refusal: Refusal
        match result:
            case Dispatched(reply):
                return reply
            case Expired():
                refusal = Refusal.QUEUE_TIMEOUT
            case Cancelled():
                refusal = Refusal.CANCELLED
            case Moved() | Borrowing():  # moved away (a loan is waited for in `outcome`)
                refusal = Refusal.NOT_OWNER
        self.metrics.child(self.metrics.flow_decisions, context.band.name, str(refusal)).inc()
        return self.answers.refusal(context.request.id, refusal, band=context.band.name)

    async def wait_in_queue(self, context: Deciding, future: asyncio.Future[QueueResult]) -> None:
        request = context.request
        try:
            if not context.borrowing:  # a loan takes a round trip or two: no QUEUED for it
                queued = AdmitReply(id=request.id, status=ReplyStatus.QUEUED)
                await self.answers.respond(context.reply_to, queued)
            final = await self.outcome(context, await future)
            # To the latest ask's reply subject (read after the wait).
            await self.answers.respond(context.reply_to, final)
        finally:
            self.queued.pop(request.id, None)

    def dispatch(
        self, waiter: Waiter, decision: GateDecision
    ) -> Dispatched | Borrowing[Loan | QuotaWait] | Held | Moved:
        """The tick let a queued request go: place it now (synchronously, inside the tick), say
        which loan it waits for first (`outcome`), or send it back to the head of its queue
        (`QuotaWait`). Not if this instance no longer decides its shard (fenced, or the shard
        is leaving): it goes back to its edge, which asks the owner; another instance may have
        claimed the shard and pinned the session already."""
        context: Deciding = waiter.token.context
        if not self.decides(context.request.shard):
            return MOVED
        placed = self.placer.place_or_borrow(context, overflow=decision is GateDecision.OVERFLOW)
        if isinstance(placed, QuotaWait) and placed.in_queue:
            self.metrics.child(self.metrics.quota_holds, context.band.name).inc()
            return HELD
        self.metrics.child(self.metrics.flow_decisions, context.band.name, decision.value).inc()
        if isinstance(placed, AdmitReply):
            return Dispatched(self.finish(context, placed))
        return Borrowing(placed)

    def finish(self, context: Deciding, reply: AdmitReply) -> AdmitReply:
        self.metrics.decision_duration.observe(time.perf_counter() - context.started)
        return reply

    def room_freed(self) -> None:
        """A lease ended here, or a peer's request ended: room may be back for requests held
        for quota (the queue's, at the next tick; those in their `limit_grace`, at once)."""
        self._freed += 1
        if self.flow is not None:
            self.flow.room_freed()
        if self._room is not None:
            if not self._room.done():
                self._room.set_result(None)
            self._room = None

    async def _room_freed_or(self, until: float) -> bool:
        """Until `room_freed` (True), or for as long as the service clock took to reach `until`
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

    def drop_queued(self, shard: int) -> None:
        """The shard moved away: its queued requests are answered `Moved` (NOT_OWNER: their
        edges ask its new owner)."""
        if self.flow is not None:
            self.flow.drop(lambda context: context.request.shard == shard)
