"""The answers this instance sends for admission requests, and their memory.

An edge asks again for an attempt that got no answer in time (a NATS node may die with the ask
or the answer in its buffers). An attempt answered here (remembered by its id for two request
timeouts) gets the same answer again: a grant while its lease lives (nothing once it ended), a
refusal as it was. A shard's answered grants move with it in a handover (`for_state`), so its
new owner answers an ask again of them the same way too (`take_in`).

Ends of leases not held here, of shards not served here, are remembered a few seconds too: one
may be on its way here in a handover that its end overtook (`without_ended`).

`Answers` builds refusals, publishes replies and remembers them; it reads the ledger's leases
(is a grant's lease still live?) and changes nothing of it, nor decides anything.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from llmgw.core.outcomes import Refusal
from llmgw.wire import AdmitReply, ReplyStatus

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.core.ledger import Ledger, ShardState
    from llmgw.services.admission.metrics import AdmissionMetrics
    from llmgw.services.admission.tracing import DecisionSpans

RETRY_AFTER_S = 1.0  # seconds a client is told to wait (Retry-After) after a retryable refusal
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
_ENDED_MEMORY_S = 5.0  # longer than a handover takes (its request times out after 2 s)
_ENDED_MEMORY_MAX = 32_768
# Refusals not repeated to an ask again: NOT_OWNER (asked again, the shard's owner decides) and
# MALFORMED (no attempt id to remember).
_ASKED_ANEW = frozenset({Refusal.NOT_OWNER, Refusal.MALFORMED})
_ANSWERED_MAX = 65_536  # answers remembered for asks again (they are kept 2 request timeouts)


class Answers:
    """Replies sent, remembered for asks again, and ends that came before their shard."""

    def __init__(
        self,
        nc: NATS,
        ledger: Ledger,
        metrics: AdmissionMetrics,
        *,
        clock: Callable[[], float],
        remember_for: float,
        spans: DecisionSpans | None = None,
    ) -> None:
        self.nc = nc
        self.ledger = ledger
        self.metrics = metrics
        self._clock = clock
        self._spans = spans
        # Attempts answered here (id -> when, the answer sent, its lease): an edge that asks
        # again, its answer lost with a NATS node, gets the same answer. An edge asks again
        # within a request timeout of the answer it missed.
        self._answered: OrderedDict[str, tuple[float, bytes, str | None]] = OrderedDict()
        self._answered_for = remember_for
        # Ends of leases not held here, of shards not served here: one may be on its way here
        # in a handover that its end overtook (`without_ended`). Oldest first, bounded.
        self._ended_elsewhere: OrderedDict[str, float] = OrderedDict()

    # ---- replies ------------------------------------------------------------------------------

    def refusal(
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

    async def respond(self, reply_to: str | None, reply: AdmitReply) -> None:
        if self._spans is not None:
            self._spans.replied(reply)
        answer = reply.model_dump_json(exclude_none=True).encode()
        if reply.status is not ReplyStatus.QUEUED and reply.refusal not in _ASKED_ANEW:
            self._remember(reply, answer)
        if reply_to:
            with contextlib.suppress(Exception):
                await self.nc.publish(reply_to, answer)

    def _remember(self, reply: AdmitReply, answer: bytes) -> None:
        answered, now = self._answered, self._clock()
        answered[reply.id] = (now, answer, reply.lease.lease_id if reply.lease else None)
        while answered and (
            len(answered) > _ANSWERED_MAX
            or now - next(iter(answered.values()))[0] > self._answered_for
        ):
            answered.popitem(last=False)

    # ---- asked again --------------------------------------------------------------------------

    def knows(self, attempt: str) -> bool:
        """Whether `attempt` was answered here (and is still remembered)."""
        return attempt in self._answered

    async def again(self, attempt: str, reply_to: str | None) -> None:
        """The same answer to an ask again of an answered attempt; a grant whose lease has ended
        since is not answered (its edge had the answer)."""
        _, answer, lease = self._answered[attempt]
        if reply_to and (lease is None or lease in self.ledger.leases):
            with contextlib.suppress(Exception):
                await self.nc.publish(reply_to, answer)

    # ---- handovers ----------------------------------------------------------------------------

    def for_state(self, state: ShardState) -> tuple[AdmitReply, ...]:
        """The grants answered here whose leases move with `state` (a handover): the new owner
        answers an ask again of those attempts with the same grant, never a second lease."""
        moving = {lease.lease_id for lease in state.leases}
        return tuple(
            AdmitReply.model_validate_json(answer)
            for _, answer, lease in self._answered.values()
            if lease in moving
        )

    def take_in(self, answers: tuple[AdmitReply, ...]) -> None:
        """Answers of a handover's attempts whose leases were taken in here (`for_state`)."""
        for reply in answers:
            if reply.lease is not None and reply.lease.lease_id in self.ledger.leases:
                self._remember(reply, reply.model_dump_json(exclude_none=True).encode())

    def ended_elsewhere(self, lease_id: str, now: float) -> None:
        """The end of a lease not held here, of a shard not served here: remembered a while."""
        remembered = self._ended_elsewhere
        remembered[lease_id] = now
        while remembered and (
            len(remembered) > _ENDED_MEMORY_MAX
            or now - next(iter(remembered.values())) > _ENDED_MEMORY_S
        ):
            remembered.popitem(last=False)

    def without_ended(self, state: ShardState, now: float) -> ShardState:
        """`state` less the leases whose end reached this instance before the shard did (the
        giver had taken them out, or crashed; the end found them nowhere): taken in, they would
        stay here until ``lease_timeout`` with nobody to end them (their edge renews them no
        more). Each one left out is reported to the ledger's observer as ended."""
        remembered = self._ended_elsewhere
        if not remembered:
            return state
        kept = []
        for lease in state.leases:
            if remembered.pop(lease.lease_id, None) is None:
                kept.append(lease)
            else:
                self.ledger.observer.lease_ended_in_transit(lease, now)
        return state if len(kept) == len(state.leases) else replace(state, leases=tuple(kept))
