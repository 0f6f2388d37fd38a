"""Upkeep of the leases granted here: what edges tell about them, and what time does to them.

A lease granted here is run and renewed by the edge from the reply on; this instance accounts
it until the edge's end message (`on_request_ended`, the broadcast ``llmgw.v1.stats.request``;
`ended_here` for the colocated edge), the edge's complete lease list leaving it out
(`on_renewal`), ``lease_timeout`` without a renewal (`expire`), or the shard moving away with it.
A reply that never reaches the edge leaves a lease nobody renews: it expires after
``lease_timeout``. Ends and retries also feed the rate balancer and the breakers, each attempt
once (`record_failure`); idle pins expire here, and stored pins are refreshed lazily.

`LeaseUpkeep` ends and renews leases in the ledger and removes idle pins; it never grants a
lease or creates a pin. An end of a lease of a shard not served here is remembered by `Answers`
(it may come before its shard's handover).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.core.ledger import ShardState
from llmgw.events import LeaseExpired
from llmgw.services.admission.balancing import UPSTREAM_FAILURES
from llmgw.services.admission.placing import pin_event
from llmgw.wire import FailedAttempt, LeaseRenewal, LeaseRenewalReply, RequestEnded

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from llmgw.core.breaker import BreakerBoard
    from llmgw.core.ledger import Ledger
    from llmgw.events import EventPublisher
    from llmgw.services.admission.answers import Answers
    from llmgw.services.admission.balancing import RateBoard
    from llmgw.services.admission.decision import Current
    from llmgw.services.admission.membership import Membership
    from llmgw.services.admission.metrics import AdmissionMetrics
    from llmgw.services.admission.pins import PinWriter

log = logging.getLogger("llmgw.admission")


class LeaseUpkeep:
    """Ends, renewals and expiry of this instance's leases; the breakers' and balancer's
    samples; idle pins."""

    def __init__(
        self,
        nc: NATS,
        current: Current,
        ledger: Ledger,
        *,
        answers: Answers,
        rates: RateBoard,
        breakers: BreakerBoard,
        pins: PinWriter,
        events: EventPublisher,
        metrics: AdmissionMetrics,
        membership: Membership,
        serves: Callable[[int], bool],
        decides: Callable[[int], bool],
        room_freed: Callable[[], None],
        clock: Callable[[], float],
        settle: float,
    ) -> None:
        self.nc = nc
        self.current = current
        self.ledger = ledger
        self.answers = answers
        self.rates = rates
        self.breakers = breakers
        self.pins = pins
        self.events = events
        self.metrics = metrics
        self.membership = membership
        self.serves = serves  # whether this instance serves a shard (holds its leases)
        self.decides = decides  # whether it decides a shard's requests now (and is not fenced)
        self.room_freed = room_freed  # a lease ended here: room for requests held for quota
        self._clock = clock
        # Leases an edge's renewal leaves out are ended only once older than this (younger ones'
        # grants may still be on their way to the edge: `Ledger.renew`).
        self.settle = settle
        self._failures_seen: dict[str, float] = {}  # attempt ids the breakers already have
        self._own_edge_marker: bytes | None = None  # `serve_edge`

    def record_failure(self, failed: FailedAttempt, now: float) -> None:
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
                if ended.shard is not None and not self.serves(ended.shard):
                    self.answers.ended_elsewhere(ended.lease, now)
            else:
                self.room_freed()
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
                owner=self.membership.instance,
                edges=len(self.ledger.edges()),
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, reply.model_dump_json().encode())

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
            pin_event(self.events, pin, "pin.expired")
        refresh_every = self.current.config.pinning.pin_inactivity_timeout / 4
        for pin in list(self.ledger.pins_to_refresh(refresh_every)):
            self.pins.put(pin)
        self.pins.write_deferred(older_than=now - refresh_every)
        if self._failures_seen:
            self._failures_seen = {k: t for k, t in self._failures_seen.items() if now - t < 60.0}
