"""The edge's request leases: held while their requests run, renewed in batches per shard.

Ownership: the edge holds a lease from the admission reply until the request ends (`end`); the
release itself travels in the request's `RequestEnded` message, which the shard's owner applies.
While held, every ``lease_timeout / 3`` the edge sends each shard's owner *one* message listing
all its live leases there (`LeaseRenewal`): the owner renews them, answers which it does not hold
(lost), and ends the edge's unlisted ones (so a lost end message costs one interval, not a
leak). The edge lists a shard for ``lease_timeout`` after its last lease there ended (an empty
list, then): a lost end message there is ended as well, though the edge holds nothing else in
that shard (later the owner has expired it anyway). A batch that gets no answer is tried again
at the next interval.

A lease is **lost** when its owner says so, or when it was not renewed for ``lease_timeout``
(this process was paused, or cut off from NATS, that long: the owner has expired it and may have
granted its capacity again). Then `on_lost` ends its request at once (the upstream call is
cancelled) and the request's outcome is `lease_lost`, whatever else happened: a lost lease never
feeds a breaker, and is never released (its capacity is no longer this edge's).

Roll call: when a shard changes owner without a handover (a crash), the new owner asks every
edge for its leases there; `on_rollcall` answers with the full records.

Local grants (outage mode `local`, `llmgw.core.outage`): a lease the edge granted itself while
NATS was unreachable is held *unclaimed*: no owner knows it, so it is never expired by the
renewal timer. Each renewal round offers the shard's unclaimed leases to its owner (`claims`,
listed as well); the owner takes them into its books as far as its quota covers, and a taken
one is renewed like any other from then on; a refused one is offered again next round. Roll-call
answers include them too. Ending a local grant gives its place in the edge's local budget back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    ADMISSION_ROLLCALL_SUBJECT,
    LeaseRenewal,
    LeaseRenewalReply,
    RollCall,
    RollCallAnswer,
    leases_subject,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.core.ledger import LeaseRecord
    from llmgw.core.outage import LocalBudget

log = logging.getLogger("llmgw.edge.leases")

LOCAL_LEASE_PREFIX = "local-"  # lease ids an edge gives its own grants in outage mode `local`


def is_local_lease(lease_id: str) -> bool:
    return lease_id.startswith(LOCAL_LEASE_PREFIX)


class HeldLease:
    """One request's lease at the edge (`llmgw.contracts.LeaseHold`)."""

    __slots__ = (
        "_lost",
        "claimed",
        "confirmed_at",
        "cut_short",
        "ended",
        "local",
        "on_lost",
        "record",
    )

    def __init__(self, record: LeaseRecord, now: float, *, local: bool = False) -> None:
        self.record = record
        self.confirmed_at = now  # monotonic time of the grant or the last confirmed renewal
        self.on_lost: Callable[[], object] | None = None  # its result is ignored
        self._lost = False
        self.ended = False
        self.cut_short = False  # ended by the edge's drain deadline (`cut`)
        self.local = local  # granted by this edge alone during a NATS outage
        self.claimed = not local  # an owner holds it (always, unless a local grant not yet taken)

    @property
    def lost(self) -> bool:
        return self._lost

    def cut(self) -> None:
        """The edge is stopping and its drain deadline passed: end the request now (its
        upstream call is closed; the request ends as ``shutting_down`` and releases the lease)."""
        if self._lost or self.ended:
            return
        self.cut_short = True
        if self.on_lost is not None:
            self.on_lost()

    def lose(self) -> None:
        if self._lost or self.ended:
            return
        self._lost = True
        if self.on_lost is not None:
            self.on_lost()


class EdgeLeases:
    """`llmgw.contracts.LeaseStore` over NATS (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        edge_id: str,
        *,
        lease_timeout: float,
        request_timeout: float,
        monotonic: Clock | TimeSource = SYSTEM,
        local_budget: LocalBudget | None = None,
    ) -> None:
        self._nc = nc
        self.edge_id = edge_id
        self.local_budget = local_budget
        self.lease_timeout = lease_timeout
        self.renew_every = lease_timeout / 3
        self.request_timeout = request_timeout
        self._monotonic = monotonic_of(monotonic)
        self.held: dict[str, HeldLease] = {}
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self.renewals = 0
        self.lost = 0
        # When the edge last held a lease in each shard (monotonic): `renew_all` lists a shard
        # until lease_timeout after that.
        self._held_in: dict[int, float] = {}

    # ---- the request path ---------------------------------------------------------------------

    def hold(self, lease: LeaseRecord) -> HeldLease:
        held = HeldLease(lease, self._monotonic(), local=is_local_lease(lease.lease_id))
        self.held[lease.lease_id] = held
        self._held_in[lease.shard] = held.confirmed_at
        return held

    def end(self, hold: HeldLease) -> None:
        if hold.ended:
            return
        hold.ended = True
        self.held.pop(hold.record.lease_id, None)
        if hold.local and self.local_budget is not None:
            record = hold.record
            self.local_budget.give_back(
                record.provider, record.endpoint or "", record.model, record.session
            )

    def unclaimed(self) -> int:
        """Local grants no owner has taken yet."""
        return sum(1 for hold in self.held.values() if not hold.claimed)

    def expired(self, hold: HeldLease) -> bool:
        """Not confirmed for lease_timeout: as good as lost (checked before any other outcome).
        An unclaimed local grant depends on no owner: it never expires."""
        if hold.lost:
            return True
        if not hold.claimed:
            return False
        if self._monotonic() - hold.confirmed_at >= self.lease_timeout:
            self.lost += 1
            hold.lose()
            return True
        return False

    # ---- renewals -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(ADMISSION_ROLLCALL_SUBJECT, cb=self.on_rollcall)
        self._task = asyncio.create_task(self._renewing(), name="lease-renewals")

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait([task])
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _renewing(self) -> None:
        while self._task is not None:
            await asyncio.sleep(self.renew_every)
            try:
                await self.renew_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("lease renewal round failed", exc_info=True)

    async def renew_all(self) -> None:
        """One renewal round: expire what was not confirmed in time, renew the rest by shard."""
        for hold in list(self.held.values()):
            self.expired(hold)  # a paused edge finds out here first
        now = self._monotonic()
        self._held_in = {s: t for s, t in self._held_in.items() if now - t < self.lease_timeout}
        by_shard: dict[int, list[HeldLease]] = {shard: [] for shard in self._held_in}
        for hold in self.held.values():
            if not hold.lost:
                by_shard.setdefault(hold.record.shard, []).append(hold)
                self._held_in[hold.record.shard] = now
        if by_shard:
            await asyncio.gather(*(self._renew(s, holds) for s, holds in by_shard.items()))

    async def _renew(self, shard: int, holds: list[HeldLease]) -> None:
        sent = self._monotonic()
        message = LeaseRenewal(
            edge=self.edge_id,
            shard=shard,
            leases=tuple(h.record.lease_id for h in holds),
            claims=tuple(h.record for h in holds if not h.claimed),
        )
        try:
            msg = await self._nc.request(
                leases_subject(shard),
                message.model_dump_json().encode(),
                timeout=self.request_timeout,
            )
            reply = LeaseRenewalReply.model_validate_json(msg.data)
        except (ValidationError, Exception) as exc:
            log.debug("renewal of %d leases in shard %d got no answer: %s", len(holds), shard, exc)
            return
        self.renewals += 1
        lost = set(reply.lost)
        refused = set(reply.refused)
        for hold in holds:
            if not hold.claimed:
                if hold.record.lease_id in refused:
                    continue  # offered again next round
                hold.claimed = True
                log.info("local grant %s taken by %s", hold.record.lease_id, reply.owner)
            if hold.record.lease_id in lost:
                self.lost += 1
                log.warning("lease %s was lost; ending its request", hold.record.lease_id)
                hold.lose()
            else:
                hold.confirmed_at = max(hold.confirmed_at, sent)

    async def on_rollcall(self, msg: Msg) -> None:
        try:
            call = RollCall.model_validate_json(msg.data)
        except ValidationError:
            return
        shards = set(call.shards)
        leases = tuple(
            h.record for h in self.held.values() if h.record.shard in shards and not h.lost
        )
        if leases and msg.reply:
            answer = RollCallAnswer(edge=self.edge_id, leases=leases)
            with contextlib.suppress(Exception):
                await self._nc.publish(msg.reply, answer.model_dump_json().encode())
