"""A request in its `limit_grace` that a lease's end wakes between its loan round's placement and
its own next turn looks again at once instead of waiting out its grace.

`Loans.borrow` places every request of a round in the turn the round settles (`then`), but the
request's task resumes a turn later: a `room_freed` in between found no one waiting (before
2026-12-07 the request then slept until its grace ended and went to the third party while our
quota had room). `Waiting` is driven here with a placer and a loan desk that play that order of
events, on a stepped clock (a grace that would be waited out is 60 s: the test would time out).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from timing import SteppedClock

from llmgw.core.quota import QuotaCounts
from llmgw.services.admission.decision import Loan, QuotaWait
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.services.admission.waiting import Waiting
from llmgw.wire import AdmitReply, ReplyStatus

PAIR = ("ours", "m")
GRACE = 60.0


class Placer:
    """Answers a loan first, then room to wait for (the loan brought nothing), then a grant."""

    def __init__(self, clock: SteppedClock) -> None:
        self.answers: list[Any] = [
            QuotaWait(PAIR, until=clock.monotonic() + GRACE),
            AdmitReply(id="r-1", status=ReplyStatus.ADMITTED),
        ]
        self.calls = 0

    def place_or_borrow(self, context: Any, *, overflow: bool, tried: Any = ()) -> Any:
        self.calls += 1
        return self.answers.pop(0)


class LoanDesk:
    """A round that brought nothing: it places its request (`then`) as it settles, and a lease
    ends here before the request's task runs again."""

    def __init__(self) -> None:
        self.waiting: Waiting | None = None

    async def borrow(self, pair: Any, need: Any, then: Any) -> Any:
        placed = then()
        assert self.waiting is not None
        self.waiting.room_freed()  # the lease's end, in the turn after the round settled
        await asyncio.sleep(0)
        return placed


async def test_a_wake_between_the_rounds_placement_and_the_requests_turn_is_not_lost() -> None:
    clock = SteppedClock()
    placer, desk = Placer(clock), LoanDesk()
    waiting = Waiting(
        placer,  # type: ignore[arg-type]
        desk,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # no refusal on this path
        AdmissionMetrics(),
        decides=lambda shard: True,
        clock=clock.monotonic,
    )
    desk.waiting = waiting
    context: Any = SimpleNamespace(
        request=SimpleNamespace(shard=0, id="r-1"),
        borrowing=True,
        grace_spent=False,
        started=time.perf_counter(),
    )
    loan = Loan(PAIR, QuotaCounts(1, 1, 0))
    reply = await asyncio.wait_for(waiting._after_loan(context, loan), 5.0)
    assert reply.status is ReplyStatus.ADMITTED
    assert placer.calls == 2  # placed again at once, not after its grace
    assert not context.grace_spent
