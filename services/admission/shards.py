"""Which shards this instance serves: claims, handovers, adoption after a crash.

Each shard this instance has anything of is one record (`Shard`) in one phase of its lifecycle
(`llmgw.core.shards.ShardPhase`: CLAIMING, RECEIVING, SERVING, LEAVING; no record is GONE),
moved only by `ShardKeeper.move`, which refuses an illegal step. The state table (phases,
steps, who holds the shard's leases in each, what a crash in each leaves behind) is in
docs/adr/0002-admission-at-memory-speed.md, "Shard lifecycle".

The shard keys in the routing bucket say who owns each shard; `Membership` follows them. Each
round (every heartbeat, and at once when members or owners change) `ShardKeeper.rebalance`:

1. drops a shard it serves whose key names another instance (re-read first: the view may lag);
2. takes over a shard whose key names this instance but of which it has no record yet (a
   handover to it, or its own earlier claim);
3. claims, by CAS, the shards rendezvous hashing gives it whose owner is gone
   (`llmgw.core.shards.plan_shards`) and takes them over;
4. hands over the shards it owns that rendezvous hashing gives to another settled member.

`Handovers` owns the sequences that move a shard between instances, each read top to bottom
in one method, with the owner of the shard's leases stated at every step: `Handovers.give`
(the giver of a handover), `Handovers.release` (a stopping instance with nobody to give the
shard to), `Handovers.receive` (the receiver of a handover) and `Handovers.adopt` (a claimant
whose giver is gone, or whose handover did not arrive in time). The quota book operations they
call (`hold_out`, `earmark`, `reclaim`, `transfer`, `take_in`, `end_incoming`) are the quota
keeper's `Earmarks`, and the counts they move are the shard's record's while they move.

**Handover** (graceful: a rebalance, or `stop`), giver G to receiver R: G stops serving the shard
(drains its subscriptions: requests delivered to it meanwhile, and its queued requests of the
shard, are answered NOT_OWNER and the edges ask again),
lets the shard's pin writes land, takes the shard's pins and leases out of its ledger, earmarks
the quota they use in the quota books (held out of its own spending meanwhile), CASes the shard
key to R (so R, however it takes the shard in, finds the earmark there), and sends them to R
(``llmgw.v1.admission.handover.<R>``; "no responders", a receiver that joined a moment ago and
does not listen yet, is sent again within the handover timeout). R moves the earmarked
quota to itself (one CAS per pair), takes them in and serves the shard. Nothing is lost: a
lease is in exactly one ledger at every moment but the message's flight, when neither ends it;
an edge's end message that arrives during that flight is remembered by R, which leaves the
ended lease out of what it takes in (`Answers.without_ended`). The leases' recent grants
travel with them, so R answers an edge that asks again for one of those attempts with the same
grant (`Answers.for_state`), never a second lease. G takes an earmark back
once R has answered (what R took is gone from it by then) or, without an answer, after
``member_ttl`` (by then R has taken it, or adopted the shard without it); which of the two got
it is decided by the book's CAS, not by that timing (docs/adr/0002, "Handover and adoption").
A handover that reaches R after the shard moved on (R adopted it, then handed it on) finds the
key no longer saying G handed it to R, and R takes nothing in. Nor does a handover or an
adoption whose instance was lost while it ran (`drop_all` waits for the round in flight).

**Adoption** (G is gone: a crash, or G released the shard with no member to take it; or G's
handover did not arrive in time): R claims the shard, loads its pins from the bucket, asks every
edge for its leases there (a roll call, answers collected for ``admission.rollcall_window``),
moves their quota from G to itself (G's earmark for the shard if there is one; without one,
the counts, but only from a G that is no longer live), and serves. A lease no edge announced in
time is not adopted; its edge learns at its next renewal that the lease is lost and ends the
request.

**A dead instance's quota** (`DeadQuota`, ``adoption.py``): once no shard key names a dead G as its
owner, and every other adoption from G has had time to move its counts (``_ADOPTION_SETTLE``
after its claim), each adopter drops what is left of G's entry from the books (one CAS per
book; the first wins, the others find nothing), instead of leaving it to the reaper's grace.
Dead means not live: G's key was removed (a successor, `successor.py`) or not renewed for
``member_ttl`` (G fenced itself before that: it never spends its entry again). A transfer from G
that lands after the drop moves nothing, and its receiver takes in what its own quota covers
(docs/adr/0002, "Changed (2026-12-03)").

While a shard has no subscriber (between the giver's unsubscribe and the receiver's
subscribe), edges' requests for it find no responders and are retried with a short backoff.

The keeper sees the rest of the admission instance only through `ShardContext`: the objects it
uses (the membership, ledger, quota keeper, pin writer; the intake, lease upkeep and waiting
rooms whose subscriptions and queue it starts and ends with a shard; the answers that travel
with a shard), never the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.errors import NoRespondersError
from pydantic import ValidationError

from llmgw.core.keys import ShardValue
from llmgw.core.ledger import EndReason, ShardState
from llmgw.core.shards import ShardPhase, ShardStep, next_phase, plan_shards
from llmgw.events import ShardEvent
from llmgw.services.admission.adoption import DeadQuota, gather
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    Handover,
    HandoverReply,
    admission_subject,
    handover_subject,
    leases_subject,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import AdmissionConfig
    from llmgw.core.ledger import Ledger, Pair
    from llmgw.core.quota import QuotaCounts
    from llmgw.events import EventPublisher
    from llmgw.services.admission.answers import Answers
    from llmgw.services.admission.earmarks import Incoming
    from llmgw.services.admission.intake import Intake
    from llmgw.services.admission.membership import Membership
    from llmgw.services.admission.pins import PinWriter
    from llmgw.services.admission.quotas import QuotaKeeper
    from llmgw.services.admission.upkeep import LeaseUpkeep
    from llmgw.services.admission.waiting import Waiting
    from llmgw.state.store import RoutingStore

log = logging.getLogger("llmgw.admission.shards")

_MAX_RELEASE_PER_ROUND = 8
_HANDOVER_WAIT = 1.0  # seconds a new owner waits for the old one's handover before a roll call
_HANDOVER_TIMEOUT = 2.0
_NO_RESPONDERS_PAUSE = 0.05  # before a handover that found no responders is sent again
# How long after another instance's claim of a dead instance's shard its adoption may still be
# moving counts from the dead entry (the handover wait, the roll call, the transfers): only
# then is the entry dropped. For liveness only: a transfer after the drop moves nothing.
_ADOPTION_SETTLE = _HANDOVER_WAIT + _HANDOVER_TIMEOUT + 2.0


@dataclass(frozen=True, slots=True)
class ShardContext:
    """What the shard keeper uses of its admission instance, and nothing more."""

    nc: NATS
    store: RoutingStore
    membership: Membership
    ledger: Ledger
    quotas: QuotaKeeper
    pins: PinWriter
    events: EventPublisher
    clock: Callable[[], float]
    settings: AdmissionConfig  # heartbeat, member_ttl, shards, rollcall_window
    intake: Intake  # a served shard's admission requests (`on_request`)
    upkeep: LeaseUpkeep  # a served shard's lease renewals (`on_renewal`)
    waiting: Waiting  # a shard that leaves: its queued requests answered moved (`drop_queued`)
    # The grants answered here whose leases move with a shard (a handover carries them), and
    # ends of leases that came before their shard (`without_ended`).
    answers: Answers

    @property
    def instance(self) -> str:
        return self.membership.instance


@dataclass(slots=True, eq=False)
class Shard:
    """One shard this instance has anything of, and what its phase needs."""

    number: int
    phase: ShardPhase = ShardPhase.GONE
    subs: list[Subscription] = field(default_factory=list)  # SERVING, LEAVING (draining)
    # Set once a handover to this instance has been taken in (or answered): a claim of the
    # shard waits for it before it adopts by roll call.
    handed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once RECEIVING ends (taken in, or not): a handover that comes late waits for it.
    received: asyncio.Event = field(default_factory=asyncio.Event)
    # Its quota on the move (`Earmarks`). Going (LEAVING, and after it left until its earmark
    # is in the book or reclaimed): its use held out of spending, not yet earmarked. Coming
    # (RECEIVING): quota moved here for it, set aside until it is taken in.
    pending: dict[Pair, QuotaCounts] = field(default_factory=dict)
    incoming: dict[Pair, Incoming] = field(default_factory=dict)


class ShardKeeper:
    """The shards of this instance: one `Shard` record each, its rounds of claims and
    handovers, its subscriptions. The handover and adoption sequences are `Handovers`'."""

    def __init__(self, ctx: ShardContext) -> None:
        self.ctx = ctx
        self._shards: dict[int, Shard] = {}  # no record: GONE
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()  # quotas read: handovers can be taken in
        self.stopping = False
        self.handovers = Handovers(ctx, self)

    # ---- the records --------------------------------------------------------------------------

    def serves(self, shard: int) -> bool:
        record = self._shards.get(shard)
        return record is not None and record.phase is ShardPhase.SERVING

    @property
    def serving(self) -> frozenset[int]:
        """The shards this instance holds in its ledger and subscriptions (SERVING, or LEAVING
        while a handover, release or drop runs)."""
        return frozenset(n for n, r in self._shards.items() if r.phase in _HELD)

    def phase(self, shard: int) -> ShardPhase:
        record = self._shards.get(shard)
        return ShardPhase.GONE if record is None else record.phase

    def _held(self) -> list[Shard]:
        return [r for r in self._shards.values() if r.phase in _HELD]

    def move(self, record: Shard, step: ShardStep) -> None:
        """Move `record` by `step` (`llmgw.core.shards.SHARD_TRANSITIONS`; an illegal step
        raises, a bug). A record that reaches GONE leaves the keeper."""
        phase = next_phase(record.phase, step)
        current = self._shards.get(record.number)
        if phase is not ShardPhase.GONE and current not in (None, record):
            raise RuntimeError(f"shard {record.number} would have two records")
        record.phase = phase
        if phase is ShardPhase.GONE:
            if current is record:
                del self._shards[record.number]
        else:
            self._shards[record.number] = record

    def add(self, shard: int, step: ShardStep) -> Shard:
        """A record for a shard of which this instance has nothing yet (GONE), moved by `step`."""
        record = Shard(shard)
        self.move(record, step)
        return record

    def record(self, shard: int) -> Shard | None:
        return self._shards.get(shard)

    def end(self, record: Shard) -> None:
        """Out of the ledger and done (LEAVING to GONE); a no-op if it is gone already (dropped
        while its handover ran: a rejoin)."""
        if record.phase is not ShardPhase.GONE:
            self.move(record, ShardStep.END)

    @property
    def adopted_leases(self) -> int:
        return self.handovers.adopted_leases

    @property
    def refused_leases(self) -> int:
        return self.handovers.refused_leases

    def wake(self) -> None:
        self._wake.set()

    def background(self) -> list[asyncio.Task[None]]:
        """Its tasks: the rounds, unanswered handovers' reclaims, dead instances' settling."""
        tasks = [self._task] if self._task is not None else []
        return [*tasks, *self.handovers.background()]

    # ---- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.ctx.membership.on_change = self.wake
        self._started.set()
        await self.rebalance()
        self._task = asyncio.create_task(self._loop(), name="shard-keeper")

    async def _loop(self) -> None:
        heartbeat = self.ctx.settings.heartbeat
        while not self.stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heartbeat):
                    await self._wake.wait()
            self._wake.clear()
            if self.stopping:
                return
            try:
                await self.rebalance()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("shard rebalance failed", exc_info=True)

    async def stop(self) -> None:
        """Hand every shard to another member; with none left, release them (the next
        instance to start adopts their leases from the edges)."""
        self.stopping = True
        # Leaving: unanswered handovers' earmarks stay for their receivers (or the reaper).
        await cancel_and_wait(self.background())
        nc = self.ctx.nc
        if nc.is_connected:
            with contextlib.suppress(Exception):
                await self.ctx.membership.announce_leaving()
                await self.ctx.membership.refresh_members()  # hand over only to the living
                await self.rebalance(max_release=len(self.serving) + 1)
        for record in self._held():
            if self._shards.get(record.number) is not record:
                continue  # gone meanwhile (handed over by a round, or released)
            if not nc.is_connected:
                # Nothing can be written: the shard is left to whoever claims it once this
                # member's key expires, and its leases are adopted by roll call (as after a
                # crash) instead of waiting out a timeout per shard.
                await self.stop_serving(record)
                self.end(record)
                continue
            try:
                await self.handovers.release(record)
            except Exception as exc:
                log.warning("shard %d not released (%s): left to be claimed", record.number, exc)

    async def drop_all(self) -> None:
        """Lost: every shard out without a handover. After the round in flight, whose claims
        and adoptions were made under the id being given up (an adoption that sees the loss
        takes nothing in; one past that check holds its shard by now, dropped here)."""
        async with self._lock:
            for record in self._held():
                await self._drop(record)

    async def on_handover(self, msg: Msg) -> None:
        """A handover to this instance (``llmgw.v1.admission.handover.<instance>``)."""
        await self._started.wait()  # joined a moment ago: its quotas are being read
        await self.handovers.receive(msg)

    # ---- a round ------------------------------------------------------------------------------

    async def rebalance(self, max_release: int = _MAX_RELEASE_PER_ROUND) -> None:
        ctx = self.ctx
        membership = ctx.membership
        if not membership.can_serve():
            return
        async with self._lock:
            if not membership.can_serve():
                return  # lost while this round waited for the lock
            me = membership.instance
            owners = {k: v.owner for k, v in membership.owners.items()}
            for record in self._held():
                shard = record.number
                if owners.get(shard) != me and record.phase is ShardPhase.SERVING:
                    stored = await ctx.store.shard(shard)
                    if stored is None or stored.value.owner != me:
                        log.warning(
                            "shard %d is no longer ours (%s): dropping it",
                            shard,
                            stored.value.owner if stored else "released",
                        )
                        await self._drop(record)
            takeovers: list[tuple[int, str | None]] = [
                (k, v.previous)
                for k, v in membership.owners.items()
                if v.owner == me and k not in self._shards
            ]
            plan = plan_shards(
                me,
                ctx.settings.shards,
                owners,
                membership.live(),
                ctx.clock(),
                settle=2 * ctx.settings.heartbeat,
                max_release=max_release,
                stopping=(me,) if self.stopping else (),
            )
            for shard in plan.claim:
                if shard in self._shards:
                    continue
                current = membership.owners.get(shard)
                previous = None
                if current is not None:
                    previous = current.owner if current.owner is not None else current.previous
                value = ShardValue(me, ctx.clock(), previous)
                revision = await ctx.store.set_shard(
                    shard, value, membership.owner_revisions.get(shard)
                )
                if revision is None:
                    continue  # somebody else moved it meanwhile: the next round sees who
                membership.owners[shard] = value
                membership.owner_revisions[shard] = revision
                takeovers.append((shard, previous))
            if takeovers:
                await self._take_over(takeovers)
            for shard, target in plan.release:
                giving = self._shards.get(shard)
                if giving is not None and giving.phase is ShardPhase.SERVING:
                    await self.handovers.give(giving, target)

    async def _take_over(self, shards: list[tuple[int, str | None]]) -> None:
        """Shards whose key names this instance (CLAIMING): a live previous owner is handing
        them over, so give it a moment; then adopt every one no handover has taken in."""
        membership = self.ctx.membership
        me = membership.instance
        claims = [(self.add(k, ShardStep.CLAIM), p) for k, p in shards if k not in self._shards]
        try:
            waits = [
                record.handed.wait()
                for record, previous in claims
                if previous is not None and previous != me and membership.is_live(previous)
            ]
            if waits:  # a live previous owner is handing them over: give it a moment
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_HANDOVER_WAIT):
                        await asyncio.gather(*waits)
            adopt = []
            for record, previous in claims:
                current = self._shards.get(record.number)
                if current is None:  # a handover of it failed meanwhile: claimed again
                    current = self.add(record.number, ShardStep.CLAIM)
                if current.phase is ShardPhase.CLAIMING:
                    adopt.append((current.number, previous))
            if adopt:
                await self.handovers.adopt(adopt)
        finally:
            for record, _ in claims:
                current = self._shards.get(record.number)
                if current is not None and current.phase is ShardPhase.CLAIMING:
                    self.move(current, ShardStep.ABANDON)  # not taken in: the next round

    # ---- serving ------------------------------------------------------------------------------

    async def subscribe(self, record: Shard) -> None:
        """Taken in: subscribe to its requests and renewals (RECEIVING to SERVING)."""
        ctx = self.ctx
        shard = record.number
        record.subs = [
            await ctx.nc.subscribe(admission_subject(shard), cb=ctx.intake.on_request),
            await ctx.nc.subscribe(leases_subject(shard), cb=ctx.upkeep.on_renewal),
        ]
        self.move(record, ShardStep.SERVE)
        with contextlib.suppress(Exception):
            await ctx.nc.flush(timeout=2)

    async def stop_serving(self, record: Shard) -> None:
        """To LEAVING: its subscriptions drained, its queued requests answered moved."""
        self.move(record, ShardStep.LEAVE)
        for sub in record.subs:
            # Drained, not unsubscribed: requests already delivered here are still answered
            # (NOT_OWNER: their edges ask the new owner) instead of dropped unanswered.
            try:
                # nats-py leaves Subscription.drain unannotated
                await asyncio.wait_for(sub.drain(), _HANDOVER_TIMEOUT)  # type: ignore[no-untyped-call]
            except Exception:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self.ctx.waiting.drop_queued(record.number)

    async def _drop(self, record: Shard) -> None:
        """No longer this instance's (its key names another, or it joins again): out of the
        ledger without a handover; the new owner adopts its leases by roll call."""
        if record.phase is ShardPhase.GONE:
            return  # ended meanwhile (its handover or release finished first)
        await self.stop_serving(record)
        self.ctx.pins.abandon(record.number)  # its writes not made yet: never (another's)
        self.ctx.ledger.take_shard(record.number, self.ctx.clock(), EndReason.DROPPED)
        self.end(record)


_HELD = frozenset({ShardPhase.SERVING, ShardPhase.LEAVING})


class Handovers:
    """The sequences that move a shard between instances, each in one method: `give`,
    `release`, `receive`, `adopt`. Each step says who holds the shard's leases then; the quota
    book operations are `QuotaKeeper`'s (docs/adr/0002, "Shard lifecycle")."""

    def __init__(self, ctx: ShardContext, keeper: ShardKeeper) -> None:
        self.ctx = ctx
        self.keeper = keeper
        self._reclaims: set[asyncio.Task[None]] = set()  # unanswered handovers' earmarks
        self.dead = DeadQuota(ctx, keeper, settle_after=_ADOPTION_SETTLE)
        self.adopted_leases = 0
        self.refused_leases = 0

    def background(self) -> list[asyncio.Task[None]]:
        return [*self._reclaims, *self.dead.tasks()]

    # ---- the giver ----------------------------------------------------------------------------

    async def give(self, record: Shard, target: str) -> None:
        """Hand a served shard to `target` (a rebalance, or stopping)."""
        ctx = self.ctx
        membership = ctx.membership
        me = ctx.instance
        shard = record.number
        # 1. Stop serving (SERVING to LEAVING). Leases: this ledger's; requests delivered
        #    meanwhile and queued ones are answered NOT_OWNER (their edges ask again).
        await self.keeper.stop_serving(record)
        # 2. Let the shard's pin writes land (the receiver reads nothing from the bucket, but
        #    an adoption after a lost message does).
        await ctx.pins.drain([p.key for p in ctx.ledger.shard_state(shard).pins])
        # 3. Out of the ledger, its use held out and earmarked for the receiver. Leases: in
        #    no ledger (in the state about to be sent); their quota in this entry, unspendable.
        #    Earmarked before the shard key names the receiver: however late this handover
        #    reaches it (it may adopt the shard by roll call meanwhile), the earmark is there.
        state = await self._set_aside(record)
        # 4. The shard key names the receiver (CAS).
        value = ShardValue(target, ctx.clock(), me)
        revision = await ctx.store.set_shard(shard, value, membership.owner_revisions.get(shard))
        if revision is None:
            # Claimed meanwhile (this instance was taken for dead): its claimant adopts the
            # leases by roll call and takes the earmark; what it leaves comes back here.
            log.warning("shard %d changed hands during its handover: dropping it", shard)
            self.keeper.end(record)
            self._reclaim_later(record)
            return
        membership.owners[shard] = value
        membership.owner_revisions[shard] = revision
        # 5. Send the state (with the grants answered for its leases). Leases: in flight;
        #    the receiver's once it takes them in (`receive`).
        try:
            handover = Handover(source=me, state=state, answers=ctx.answers.for_state(state))
            reply = await self.send(target, handover)
            answer = HandoverReply.model_validate_json(reply.data)
            if answer.refused:
                log.warning("shard %d: %s refused %d leases", shard, target, len(answer.refused))
            # 6. It has taken what it takes (a late adoption of its own takes the earmark
            #    first, or finds it back here): the rest of the earmark is this instance's.
            await ctx.quotas.earmarks.reclaim(record)
        except Exception as exc:  # the receiver adopts by roll call instead
            log.warning("shard %d: handover to %s not confirmed (%s)", shard, target, exc)
            # 6'. Unanswered: the earmark comes back after member_ttl, if still there.
            self._reclaim_later(record)
        self.keeper.end(record)  # LEAVING to GONE
        ctx.events.emit(
            ShardEvent,
            event="shard.handed",
            owner=target,
            shards=(shard,),
            previous=me,
            leases=len(state.leases),
            pins=len(state.pins),
        )
        ctx.quotas.wake()

    async def send(self, target: str, handover: Handover) -> Msg:
        """The handover request, within ``_HANDOVER_TIMEOUT``. "No responders" is asked again
        shortly: a receiver that joined a moment ago may not listen yet, and without the message
        it would adopt the shard by roll call, losing the leases no edge announced in time."""
        nc = self.ctx.nc
        payload = handover.model_dump_json().encode()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _HANDOVER_TIMEOUT
        while True:
            try:
                return await nc.request(
                    handover_subject(target), payload, timeout=deadline - loop.time()
                )
            except NoRespondersError:
                if loop.time() + _NO_RESPONDERS_PAUSE >= deadline:
                    raise
                await asyncio.sleep(_NO_RESPONDERS_PAUSE)

    async def release(self, record: Shard) -> None:
        """Stopping with nobody to take the shard: write it ownerless, its quota earmarked (the
        next owner takes the earmark from this instance's entry when it adopts the shard)."""
        ctx = self.ctx
        shard = record.number
        try:
            # 1. Stop serving (to LEAVING; a shard handed here while stopping was never
            #    subscribed). Leases: this ledger's.
            await self.keeper.stop_serving(record)
            # 2. Its pin writes land (deferred first writes made now): the next owner adopts
            #    the pins from the bucket.
            pins = ctx.ledger.shard_state(shard).pins
            ctx.pins.flush(pins)
            await ctx.pins.drain([p.key for p in pins])
            # 3. Out of this (stopping) ledger, as in a handover, and earmarked before the
            #    shard key says it is free. Leases: their edges' only, until a roll call.
            await self._set_aside(record)
            # 4. The shard key names nobody (and this instance as its previous owner).
            value = ShardValue(None, ctx.clock(), ctx.instance)
            await ctx.store.set_shard(shard, value, ctx.membership.owner_revisions.get(shard))
        finally:
            self.keeper.end(record)

    async def _set_aside(self, record: Shard) -> ShardState:
        """Take the shard out of the ledger, its use held out and earmarked for its next owner
        (`Earmarks.hold_out`, then `earmark`: one CAS per pair)."""
        ctx = self.ctx
        shard = record.number
        earmarks = ctx.quotas.earmarks
        earmarks.hold_out(record, ctx.ledger.shard_state(shard).counts())
        state = ctx.ledger.take_shard(shard, ctx.clock(), EndReason.MOVED)
        try:
            await earmarks.earmark(record)
        except Exception as exc:  # held out (unspendable) until reclaimed
            log.warning("shard %d: its quota could not be earmarked (%s)", shard, exc)
        return state

    def _reclaim_later(self, record: Shard) -> None:
        """Take back an unanswered handover's earmark once its receiver has surely taken it, or
        taken the shard in without it: ``member_ttl`` (a timing for liveness, not for safety:
        the book decides who got it)."""

        if self.keeper.stopping:
            return  # leaving: the earmark stays for the receiver (or the reaper, with the entry)

        async def reclaim() -> None:
            await asyncio.sleep(self.ctx.settings.member_ttl)
            await self.ctx.quotas.earmarks.reclaim(record)

        task = asyncio.create_task(reclaim(), name=f"reclaim-{record.number}")
        self._reclaims.add(task)
        task.add_done_callback(self._reclaims.discard)

    # ---- the receiver -------------------------------------------------------------------------

    async def receive(self, msg: Msg) -> None:
        """A handover to this instance: take the shard in and serve it."""
        ctx = self.ctx
        keeper = self.keeper
        try:
            handover = Handover.model_validate_json(msg.data)
        except ValidationError:
            return
        # Less the ends that overtook the handover.
        state = ctx.answers.without_ended(handover.state, ctx.clock())
        shard = state.shard
        me = ctx.instance
        refused: list[str] = []
        stopping = keeper.stopping
        if keeper.record(shard) is None and not await self._handed_here(shard, handover.source):
            # Stale: the shard moved on since it was sent (this instance adopted it when the
            # message was late, and handed it on). Taken in, its old pins and leases would be
            # decided here beside the shard's owner until the next round dropped it.
            log.warning(
                "shard %d: a handover from %s came after it moved on", shard, handover.source
            )
            lost = tuple(lease.lease_id for lease in state.leases)
            await self._answer(msg, HandoverReply(accepted=False, refused=lost))
            return
        record = keeper.record(shard)
        if record is not None and record.phase is not ShardPhase.CLAIMING:
            # Adopted meanwhile (the handover came late), or held here already: that adoption
            # takes the earmark, or finds none and takes in what its own quota covers.
            # Answered once it is done.
            if record.phase is ShardPhase.RECEIVING:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_HANDOVER_TIMEOUT):
                        await record.received.wait()
            ctx.answers.take_in(handover.answers)
            record.handed.set()
        else:
            # 1. RECEIVING (from CLAIMING if this instance's claim waits for the handover).
            #    Leases: in the message (no ledger ends them).
            if record is None:
                record = keeper.add(shard, ShardStep.RECEIVE)
            else:
                keeper.move(record, ShardStep.RECEIVE)
            try:
                # 2. Keys' quotas tracked, then the giver's earmark moved here (one CAS per
                #    pair), set aside for the shard: unspendable until taken in.
                await ctx.quotas.joins.track_keys(state.leases)
                await ctx.quotas.earmarks.transfer(
                    handover.source, ctx.instance, state.counts(), record=record, plain=False
                )
                # 3. Taken in: leases and pins in this ledger and their quota spendable, in one
                #    step. Leases: this ledger's (what does not fit is refused: lost). Not if
                #    this instance was lost meanwhile: the shard's next owner adopts it.
                may = self._may_take_in(me)
                dropped, unpinned = (
                    ctx.quotas.earmarks.take_in(record, state, ctx.clock()) if may else ([], [])
                )
                if not may:
                    refused = [lease.lease_id for lease in state.leases]
                elif stopping:
                    # Handed a shard while stopping (the giver had not seen it yet): release it
                    # at once (below); the next claimant adopts its leases from the edges.
                    keeper.move(record, ShardStep.LEAVE)
                else:
                    refused = [lease.lease_id for lease in dropped]
                    self.adopted_leases += len(state.leases) - len(dropped)
                    self.refused_leases += len(dropped)
                    ctx.answers.take_in(handover.answers)
                    now = ctx.clock()
                    for pin in state.pins:
                        ctx.pins.known(pin.key, pin.revision)
                        if not pin.revision:  # never written: its first write still waits
                            ctx.pins.defer(pin, now)
                    for pin in unpinned:
                        ctx.pins.delete(pin)
                    # 4. Subscribed: SERVING.
                    await keeper.subscribe(record)
            finally:
                ctx.quotas.earmarks.end_incoming(record)
                if record.phase is ShardPhase.RECEIVING:  # taking it in failed
                    keeper.move(record, ShardStep.ABANDON)
                    keeper.wake()
                record.received.set()
            record.handed.set()
            if record.phase is ShardPhase.LEAVING:
                await self._answer(msg, HandoverReply(accepted=True))
                await self.release(record)
                return
        await self._answer(msg, HandoverReply(accepted=True, refused=tuple(refused)))

    def _may_take_in(self, me: str) -> bool:
        """Whether an intake begun as `me` may still take its shard in: not lost (nor fenced)
        and not joined again under another id meanwhile (the shard key names `me`)."""
        return self.ctx.instance == me and self.ctx.membership.can_serve()

    async def _handed_here(self, shard: int, giver: str) -> bool:
        """Whether the shard's key still says `giver` handed it to this instance (the giver
        writes that before it sends the handover; read from the store, as the watch may lag)."""
        stored = await self.ctx.store.shard(shard)
        return (
            stored is not None
            and stored.value.owner == self.ctx.instance
            and stored.value.previous == giver
        )

    async def _answer(self, msg: Msg, reply: HandoverReply) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):
                await self.ctx.nc.publish(msg.reply, reply.model_dump_json().encode())

    # ---- adoption -----------------------------------------------------------------------------

    async def adopt(self, shards: list[tuple[int, str | None]]) -> None:
        """Take in claimed shards (CLAIMING) whose giver is gone, or whose handover did not
        arrive in time, from the bucket (pins) and the edges (leases): `shards` with their
        previous owners."""
        ctx = self.ctx
        keeper = self.keeper
        me = ctx.instance
        # 1. RECEIVING, one at a time per shard: a handover of one of them that arrives now
        #    waits for this adoption and takes nothing more (`receive`). Leases: their edges'
        #    (and the previous owner's ledger, if it still lives and unmarked its earmark).
        records = []
        for shard, previous in shards:
            record = keeper.record(shard)
            if record is not None and record.phase is ShardPhase.CLAIMING:
                keeper.move(record, ShardStep.RECEIVE)
                records.append((record, previous))
        if not records:
            return
        try:
            states = await gather(ctx, [r.number for r, _ in records])
            # 2. The API keys' quotas tracked, then each shard's quota moved here (one CAS per
            #    pair): the previous owner's earmark if it left one; without one, the counts,
            #    but only from an owner no longer live. Set aside for the shard meanwhile.
            for state in states:
                await ctx.quotas.joins.track_keys(state.leases)
            for state, (record, previous) in zip(states, records, strict=True):
                if previous is None or previous == me:
                    continue
                await ctx.quotas.earmarks.transfer(
                    previous,
                    me,
                    state.counts(),
                    record=record,
                    plain=not ctx.membership.is_live(previous),
                )
            if not self._may_take_in(me):
                return  # lost meanwhile (the records are abandoned below): nothing taken in
            # 3. Taken in, all in one step with the quota moved in for them. Leases: this
            #    ledger's (what does not fit is refused: lost at its edge's next renewal).
            adopted = refused = pins_in = 0
            now = ctx.clock()  # the roll call and the transfers took a while
            for state, (record, _) in zip(states, records, strict=True):
                # Less the leases whose end came after their edge answered the roll call:
                # taken in, they would stay here until lease_timeout with nobody to end them.
                state = ctx.answers.without_ended(state, now)
                dropped, unpinned = ctx.quotas.earmarks.take_in(record, state, now)
                adopted += len(state.leases) - len(dropped)
                refused += len(dropped)
                pins_in += len(state.pins) - len(unpinned)
                for pin in unpinned:  # no pin quota left: the session pins again
                    ctx.pins.delete(pin)
            # 4. Subscribed: SERVING.
            for record, _ in records:
                await keeper.subscribe(record)
        finally:
            for record, _ in records:
                ctx.quotas.earmarks.end_incoming(record)
                if record.phase is ShardPhase.RECEIVING:  # taking it in failed
                    keeper.move(record, ShardStep.ABANDON)
                record.received.set()
        self.adopted_leases += adopted
        self.refused_leases += refused
        if refused:
            log.warning(
                "%d leases could not be adopted (no quota left): their requests end", refused
            )
        # 5. The dead previous owners' quota goes back now if this adoption was the last
        #    (before the ready line of a successor that adopted every shard); else once the
        #    others' are done.
        for dead in {p for _, p in records if p is not None and p != me}:
            if await self.dead.settle_once(dead) is not None:
                self.dead.settle(dead)
        previous = next((p for _, p in records if p is not None), None)
        ctx.events.emit(
            ShardEvent,
            event="shard.claimed",
            owner=me,
            shards=tuple(r.number for r, _ in records),
            previous=previous,
            leases=adopted,
            pins=pins_in,
        )
        ctx.quotas.wake()
