"""Which shards this instance serves: claims, handovers, adoption after a crash.

The shard keys in the routing bucket say who owns each shard; `Membership` follows them. Each
round (every heartbeat, and at once when members or owners change) `ShardKeeper.rebalance`:

1. stops serving a shard whose key names another instance (re-read first: the view may lag);
2. takes over a shard whose key names this instance but which it does not serve yet (a
   handover to it, or its own earlier claim);
3. claims, by CAS, the shards rendezvous hashing gives it whose owner is gone
   (`llmgw.core.shards.plan_shards`) and takes them over;
4. hands over the shards it owns that rendezvous hashing gives to another settled member.

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
ended lease out of what it takes in (`AdmissionService.without_ended`). The leases' recent grants
travel with them, so R answers an edge that asks again for one of those attempts with the same
grant (`AdmissionService.answers_for`), never a second lease. G takes an earmark back
once R has answered (what R took is gone from it by then) or, without an answer, after
``member_ttl`` (by then R has taken it, or adopted the shard without it); which of the two got
it is decided by the book's CAS, not by that timing (docs/adr/0002, "Handover and adoption").

**Adoption** (G is gone: a crash, or G released the shard with no member to take it; or G's
handover did not arrive in time): R claims the shard, loads its pins from the bucket, asks every
edge for its leases there (a roll call, answers collected for ``admission.rollcall_window``),
moves their quota from G to itself (G's earmark for the shard if there is one; without one,
the counts, but only from a G that is no longer live), and serves. A lease no edge announced in
time is not adopted; its edge learns at its next renewal that the lease is lost and ends the
request.

**A dead instance's quota** (`_settle_dead`): once no shard key names a dead G as its owner, and
every other adoption from G has had time to move its counts (``_ADOPTION_SETTLE`` after its
claim), each adopter drops what is left of G's entry from the books (one CAS per book; the first
wins, the others find nothing), instead of leaving it to the reaper's grace. Dead means not live:
G's key was removed (a successor, `successor.py`) or not renewed for ``member_ttl`` (G fenced
itself before that: it never spends its entry again). A transfer from G that lands after the drop
moves nothing, and its receiver takes in what its own quota covers (docs/adr/0002, "Changed
(2026-12-03)").

While a shard has no subscriber (between the giver's unsubscribe and the receiver's
subscribe), edges' requests for it find no responders and are retried with a short backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from nats.errors import NoRespondersError
from pydantic import ValidationError

from llmgw.core.keys import ShardValue
from llmgw.core.ledger import EndReason, LeaseRecord, PinRecord, ShardState
from llmgw.core.shards import plan_shards
from llmgw.events import QuotaReclaimed, ShardEvent
from llmgw.services.admission.successor import drop_dead_quota
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    ADMISSION_ROLLCALL_SUBJECT,
    Handover,
    HandoverReply,
    RollCall,
    RollCallAnswer,
    admission_subject,
    handover_subject,
    leases_subject,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.services.admission.service import AdmissionService

log = logging.getLogger("llmgw.admission.shards")

_MAX_RELEASE_PER_ROUND = 8
_HANDOVER_WAIT = 1.0  # seconds a new owner waits for the old one's handover before a roll call
_HANDOVER_TIMEOUT = 2.0
_NO_RESPONDERS_PAUSE = 0.05  # before a handover that found no responders is sent again
# How long after another instance's claim of a dead instance's shard its adoption may still be
# moving counts from the dead entry (the handover wait, the roll call, the transfers): only
# then is the entry dropped. For liveness only: a transfer after the drop moves nothing.
_ADOPTION_SETTLE = _HANDOVER_WAIT + _HANDOVER_TIMEOUT + 2.0


class ShardKeeper:
    def __init__(self, service: AdmissionService) -> None:
        self.service = service
        self.serving: dict[int, list[Subscription]] = {}
        self.leaving: set[int] = set()
        self._taking: set[int] = set()
        # Shards being taken in (a handover or an adoption), set when done: one at a time.
        self._receiving: dict[int, asyncio.Event] = {}
        self._handed: dict[int, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()  # quotas read: handovers can be taken in
        self._reclaims: set[asyncio.Task[None]] = set()  # unanswered handovers' earmarks
        self._settling: dict[str, asyncio.Task[None]] = {}  # dead instances' quota, by id
        self.stopping = False
        self.adopted_leases = 0
        self.refused_leases = 0

    def serves(self, shard: int) -> bool:
        return shard in self.serving and shard not in self.leaving

    def wake(self) -> None:
        self._wake.set()

    # ---- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.service.membership.on_change = self.wake
        self._started.set()
        await self.rebalance()
        self._task = asyncio.create_task(self._loop(), name="shard-keeper")

    async def _loop(self) -> None:
        heartbeat = self.service.config.admission.heartbeat
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
        await cancel_and_wait(
            [t for t in (self._task, *self._reclaims, *self._settling.values()) if t is not None]
        )
        nc = self.service.nc
        if nc.is_connected:
            with contextlib.suppress(Exception):
                await self.service.membership.announce_leaving()
                await self.service.membership.refresh_members()  # hand over only to the living
                await self.rebalance(max_release=len(self.serving) + 1)
        for shard in list(self.serving):
            if not nc.is_connected:
                # Nothing can be written: the shard is left to whoever claims it once this
                # member's key expires, and its leases are adopted by roll call (as after a
                # crash) instead of waiting out a timeout per shard.
                await self._stop_serving(shard)
                self.serving.pop(shard, None)
                self.leaving.discard(shard)
                continue
            try:
                await self._release(shard)
            except Exception as exc:
                log.warning("shard %d not released (%s): left to be claimed", shard, exc)
                self.serving.pop(shard, None)
                self.leaving.discard(shard)

    async def drop_all(self) -> None:
        for shard in list(self.serving):
            await self._drop(shard)

    # ---- a round ------------------------------------------------------------------------------

    async def rebalance(self, max_release: int = _MAX_RELEASE_PER_ROUND) -> None:
        service = self.service
        membership = service.membership
        if not membership.can_serve():
            return
        async with self._lock:
            me = membership.instance
            owners = {k: v.owner for k, v in membership.owners.items()}
            for shard in list(self.serving):
                if owners.get(shard) != me and shard not in self.leaving:
                    stored = await service.store.shard(shard)
                    if stored is None or stored.value.owner != me:
                        log.warning(
                            "shard %d is no longer ours (%s): dropping it",
                            shard,
                            stored.value.owner if stored else "released",
                        )
                        await self._drop(shard)
            takeovers: list[tuple[int, str | None]] = [
                (k, v.previous)
                for k, v in membership.owners.items()
                if v.owner == me and k not in self.serving and k not in self._taking
            ]
            plan = plan_shards(
                me,
                service.config.admission.shards,
                owners,
                membership.live(),
                service._clock(),
                settle=2 * service.config.admission.heartbeat,
                max_release=max_release,
                stopping=(me,) if self.stopping else (),
            )
            for shard in plan.claim:
                if shard in self._taking:
                    continue
                current = membership.owners.get(shard)
                previous = None
                if current is not None:
                    previous = current.owner if current.owner is not None else current.previous
                value = ShardValue(me, service._clock(), previous)
                revision = await service.store.set_shard(
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
                await self._hand_over(shard, target)

    # ---- taking shards ------------------------------------------------------------------------

    async def _take_over(self, shards: list[tuple[int, str | None]]) -> None:
        membership = self.service.membership
        me = membership.instance
        for shard, _ in shards:
            self._taking.add(shard)
        try:
            waits = [
                self._handed.setdefault(shard, asyncio.Event())
                for shard, previous in shards
                if previous is not None and previous != me and membership.is_live(previous)
            ]
            if waits:  # a live previous owner is handing them over: give it a moment
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_HANDOVER_WAIT):
                        await asyncio.gather(*(w.wait() for w in waits))
            adopt = [(k, p) for k, p in shards if k not in self.serving]
            if adopt:
                await self._adopt(adopt)
        finally:
            for shard, _ in shards:
                self._taking.discard(shard)

    async def _adopt(self, shards: list[tuple[int, str | None]]) -> None:
        # A handover of one of them may be in progress: the first to start takes the shard in.
        shards = [(k, p) for k, p in shards if k not in self._receiving and k not in self.serving]
        if not shards:
            return
        done = asyncio.Event()
        self._receiving.update((k, done) for k, _ in shards)
        try:
            await self._adopt_shards(shards)
        finally:
            for k, _ in shards:
                self.service.quotas.end_incoming(k)
                self._receiving.pop(k, None)
            done.set()

    async def _adopt_shards(self, shards: list[tuple[int, str | None]]) -> None:
        service = self.service
        me = service.instance
        now = service._clock()
        announced = await self._rollcall([k for k, _ in shards])
        states: list[tuple[ShardState, str | None]] = []
        for shard, previous in shards:
            pins = []
            for key, stored in await service.store.shard_pins(shard):
                value = stored.value
                pins.append(
                    PinRecord(
                        key,
                        value.pin_id,
                        value.provider,
                        value.model,
                        value.session,
                        shard,
                        value.created_at,
                        value.since,
                        max(value.refreshed_at, now),
                        value.refreshed_at,
                        stored.revision,
                        uses=2,  # its history is unknown: a conversation, not a one-shot
                    )
                )
                service.pins.known(key, stored.revision)
            states.append(
                (ShardState(shard, tuple(pins), tuple(announced.get(shard, ()))), previous)
            )
        for state, _ in states:
            await service.quotas.track_keys(state.leases)
        for state, previous in states:
            if previous is None or previous == me:
                continue
            await service.quotas.transfer(
                previous,
                me,
                state.counts(),
                shard=state.shard,
                plain=not service.membership.is_live(previous),
            )
        adopted = refused = pins_in = 0
        now = service._clock()  # the roll call and the transfers took a while
        for state, _ in states:  # all in one step, with the quota moved in for them
            # Less the leases whose end came after their edge answered the roll call: taken in,
            # they would stay here until lease_timeout with nobody to end them.
            state = service.without_ended(state)
            dropped, unpinned = service.quotas.take_in(state, now)
            adopted += len(state.leases) - len(dropped)
            refused += len(dropped)
            pins_in += len(state.pins) - len(unpinned)
            for pin in unpinned:  # no pin quota left: the session pins again
                service.pins.delete(pin)
        for state, _ in states:
            await self._subscribe(state.shard)
        self.adopted_leases += adopted
        self.refused_leases += refused
        if refused:
            log.warning(
                "%d leases could not be adopted (no quota left): their requests end", refused
            )
        for dead in {p for _, p in shards if p is not None and p != me}:
            # Its quota goes back now if this adoption was the last (before the ready line of
            # a successor that adopted every shard); else once the others' are done.
            if await self._settle_once(dead) is not None:
                self._settle_dead(dead)
        previous = next((p for _, p in shards if p is not None), None)
        service.events.emit(
            ShardEvent,
            event="shard.claimed",
            owner=me,
            shards=tuple(k for k, _ in shards),
            previous=previous,
            leases=adopted,
            pins=pins_in,
        )
        service.quotas.wake()

    def _settle_dead(self, dead: str) -> None:
        """Drop what is left of the dead instance's quota once its shards are adopted."""
        if self.stopping or dead in self._settling:
            return
        task = asyncio.create_task(self._drop_dead_quota(dead), name=f"settle-{dead}")
        self._settling[dead] = task
        task.add_done_callback(lambda _: self._settling.pop(dead, None))

    async def _drop_dead_quota(self, dead: str) -> None:
        config = self.service.config.admission
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 3 * config.member_ttl  # then the reaper's grace does it
        while not self.stopping and loop.time() < give_up:
            wait = await self._settle_once(dead)
            if wait is None:
                return
            await asyncio.sleep(min(wait, config.member_ttl))

    async def _settle_once(self, dead: str) -> float | None:
        """Drop the dead instance's quota if its shards are adopted (None: done, or it is not
        dead after all); else how long to wait before looking again."""
        service = self.service
        membership = service.membership
        heartbeat = service.config.admission.heartbeat
        if membership.is_live(dead):
            return None  # not dead: a live member's entry is its own
        me = membership.instance
        wait = 0.0
        try:
            now = service._clock()
            for shard, stored in (await service.store.shard_owners()).items():
                value = stored.value
                if (
                    value.owner == dead
                    or (value.owner is None and value.previous == dead)
                    or (value.owner == me and shard not in self.serving)
                ):
                    wait = max(wait, heartbeat)  # a shard still to be adopted
                elif value.previous == dead and value.owner != me:
                    wait = max(wait, _ADOPTION_SETTLE - (now - value.since))
            if wait > 0:
                return wait
            dropped = await drop_dead_quota(service.store, dead)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("quota of %s not settled yet (%s)", dead, exc)
            return heartbeat
        quotas = service.quotas
        for held, book in dropped:
            pair = (book.value.provider, book.value.model)
            if pair in quotas.books and book.revision > quotas.books[pair].revision:
                quotas.books[pair] = book  # the keeper takes what was freed at once
            service.events.emit(
                QuotaReclaimed,
                provider=book.value.provider,
                model=book.value.model,
                member=dead,
                leases=held.g,
                unreserved=held.u,
                pins=held.p,
            )
        if dropped:
            log.info(
                "dropped what was left of %s's quota in %d books: its shards are adopted",
                dead,
                len(dropped),
            )
            await quotas.adjust()
        return None

    async def _rollcall(self, shards: Iterable[int]) -> dict[int, list[LeaseRecord]]:
        """Ask every edge which leases it holds in `shards`; answers within the window."""
        service = self.service
        wanted = set(shards)
        found: dict[int, dict[str, LeaseRecord]] = {}

        async def collect(msg: Msg) -> None:
            try:
                answer = RollCallAnswer.model_validate_json(msg.data)
            except ValidationError:
                return
            for lease in answer.leases:
                if lease.shard in wanted:
                    found.setdefault(lease.shard, {})[lease.lease_id] = lease

        inbox = service.nc.new_inbox()
        sub = await service.nc.subscribe(inbox, cb=collect)
        try:
            call = RollCall(owner=service.instance, shards=tuple(sorted(wanted)))
            await service.nc.publish(
                ADMISSION_ROLLCALL_SUBJECT, call.model_dump_json().encode(), reply=inbox
            )
            # Not a guess at synchronisation: a roll call has no count of answers to wait for
            # (edges come and go); the window is its documented deadline.
            await asyncio.sleep(service.config.admission.rollcall_window)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return {shard: list(leases.values()) for shard, leases in found.items()}

    async def on_handover(self, msg: Msg) -> None:
        service = self.service
        try:
            handover = Handover.model_validate_json(msg.data)
        except ValidationError:
            return
        await self._started.wait()  # joined a moment ago: its quotas are being read
        state = service.without_ended(handover.state)  # ends that overtook the handover
        shard = state.shard
        refused: list[str] = []
        if shard in self._receiving or shard in self.serving:
            # Adopted meanwhile (the handover came late): that adoption takes the earmark, or
            # finds none and takes in what its own quota covers. Answered once it is done.
            adopting = self._receiving.get(shard)
            if adopting is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_HANDOVER_TIMEOUT):
                        await adopting.wait()
            service.remember_answers(handover.answers)
        elif self.stopping:
            # Handed a shard while stopping (the giver had not seen it yet): take it, then
            # release it at once; the next claimant adopts its leases from the edges.
            self._receiving[shard] = asyncio.Event()
            try:
                await service.quotas.track_keys(state.leases)
                await service.quotas.transfer(
                    handover.source, service.instance, state.counts(), shard=shard, plain=False
                )
                service.quotas.take_in(state, service._clock())
            finally:
                service.quotas.end_incoming(shard)
                self._receiving.pop(shard).set()
            self._handed.setdefault(shard, asyncio.Event()).set()
            if msg.reply:
                reply = HandoverReply(accepted=True)
                with contextlib.suppress(Exception):
                    await service.nc.publish(msg.reply, reply.model_dump_json().encode())
            await self._release(shard)
            return
        else:
            self._receiving[shard] = asyncio.Event()
            try:
                await service.quotas.track_keys(state.leases)
                await service.quotas.transfer(
                    handover.source, service.instance, state.counts(), shard=shard, plain=False
                )
                dropped, unpinned = service.quotas.take_in(state, service._clock())
                refused = [lease.lease_id for lease in dropped]
                self.adopted_leases += len(state.leases) - len(dropped)
                self.refused_leases += len(dropped)
                service.remember_answers(handover.answers)
                for pin in state.pins:
                    service.pins.known(pin.key, pin.revision)
                for pin in unpinned:
                    service.pins.delete(pin)
                await self._subscribe(shard)
            finally:
                service.quotas.end_incoming(shard)
                self._receiving.pop(shard).set()
        self._handed.setdefault(shard, asyncio.Event()).set()
        if msg.reply:
            reply = HandoverReply(accepted=True, refused=tuple(refused))
            with contextlib.suppress(Exception):
                await service.nc.publish(msg.reply, reply.model_dump_json().encode())

    async def _subscribe(self, shard: int) -> None:
        service = self.service
        subs = [
            await service.nc.subscribe(admission_subject(shard), cb=service.on_request),
            await service.nc.subscribe(leases_subject(shard), cb=service.on_renewal),
        ]
        self.serving[shard] = subs
        self.leaving.discard(shard)
        with contextlib.suppress(Exception):
            await service.nc.flush(timeout=2)

    # ---- giving shards away -------------------------------------------------------------------

    async def _stop_serving(self, shard: int) -> None:
        self.leaving.add(shard)
        for sub in self.serving.get(shard, ()):
            # Drained, not unsubscribed: requests already delivered here are still answered
            # (NOT_OWNER: their edges ask the new owner) instead of dropped unanswered.
            try:
                await asyncio.wait_for(sub.drain(), _HANDOVER_TIMEOUT)
            except Exception:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        flow = self.service.flow
        if flow is not None:
            flow.drop(lambda context: context.request.shard == shard)

    async def _hand_over(self, shard: int, target: str) -> None:
        service = self.service
        membership = service.membership
        me = service.instance
        await self._stop_serving(shard)
        keys = [p.key for p in service.ledger.shard_state(shard).pins]
        await service.pins.drain(keys)
        # The receiver moves the shard's quota from this instance's entry to its own as it
        # takes the state in: that use is set aside here and earmarked for it in the books
        # first, and spendable here again only if the books give the earmark back. First,
        # before the shard key names the receiver: however late this handover reaches it
        # (it may adopt the shard by roll call meanwhile), the earmark is there to take.
        state = await self._give_up(shard, EndReason.MOVED)
        value = ShardValue(target, service._clock(), me)
        revision = await service.store.set_shard(
            shard, value, membership.owner_revisions.get(shard)
        )
        if revision is None:
            # Claimed meanwhile (this instance was taken for dead): its claimant adopts the
            # leases by roll call and takes the earmark; what it leaves comes back here.
            log.warning("shard %d changed hands during its handover: dropping it", shard)
            self.serving.pop(shard, None)
            self.leaving.discard(shard)
            self._reclaim_later(shard)
            return
        membership.owners[shard] = value
        membership.owner_revisions[shard] = revision
        try:
            handover = Handover(source=me, state=state, answers=service.answers_for(state))
            reply = await self._send_handover(target, handover)
            answer = HandoverReply.model_validate_json(reply.data)
            if answer.refused:
                log.warning("shard %d: %s refused %d leases", shard, target, len(answer.refused))
            # It has taken what it takes (a late adoption of its own takes the earmark first,
            # or finds it back here): the rest is this instance's again.
            await service.quotas.reclaim(shard)
        except Exception as exc:  # the receiver adopts by roll call instead
            log.warning("shard %d: handover to %s not confirmed (%s)", shard, target, exc)
            self._reclaim_later(shard)
        self.serving.pop(shard, None)
        self.leaving.discard(shard)
        service.events.emit(
            ShardEvent,
            event="shard.handed",
            owner=target,
            shards=(shard,),
            previous=me,
            leases=len(state.leases),
            pins=len(state.pins),
        )
        service.quotas.wake()

    async def _send_handover(self, target: str, handover: Handover) -> Msg:
        """The handover request, within ``_HANDOVER_TIMEOUT``. "No responders" is asked again
        shortly: a receiver that joined a moment ago may not listen yet, and without the message
        it would adopt the shard by roll call, losing the leases no edge announced in time."""
        nc = self.service.nc
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

    async def _release(self, shard: int) -> None:
        """Stopping with nobody to take the shard: write it ownerless, earmark its quota (the
        next owner takes the earmark from this instance's entry when it adopts the shard)."""
        service = self.service
        membership = service.membership
        await self._stop_serving(shard)
        await service.pins.drain([p.key for p in service.ledger.shard_state(shard).pins])
        # Out of this (stopping) ledger, as in a handover, and earmarked before the shard key
        # says it is free: the next owner adopts the pins from the bucket and the leases from
        # the edges, and takes the earmark.
        await self._give_up(shard, EndReason.MOVED)
        value = ShardValue(None, service._clock(), service.instance)
        await service.store.set_shard(shard, value, membership.owner_revisions.get(shard))
        for sub in self.serving.pop(shard, ()):
            del sub
        self.leaving.discard(shard)

    async def _give_up(self, shard: int, reason: EndReason) -> ShardState:
        """Take the shard out of the ledger, its use held out and earmarked for its next owner."""
        service = self.service
        service.quotas.hold_out(shard, service.ledger.shard_state(shard).counts())
        state = service.ledger.take_shard(shard, service._clock(), reason)
        try:
            await service.quotas.earmark(shard)
        except Exception as exc:  # held out (unspendable) until reclaimed
            log.warning("shard %d: its quota could not be earmarked (%s)", shard, exc)
        return state

    def _reclaim_later(self, shard: int) -> None:
        """Take back an unanswered handover's earmark once its receiver has surely taken it, or
        taken the shard in without it: ``member_ttl`` (a timing for liveness, not for safety:
        the book decides who got it)."""

        if self.stopping:
            return  # leaving: the earmark stays for the receiver (or the reaper, with the entry)

        async def reclaim() -> None:
            await asyncio.sleep(self.service.config.admission.member_ttl)
            await self.service.quotas.reclaim(shard)

        task = asyncio.create_task(reclaim(), name=f"reclaim-{shard}")
        self._reclaims.add(task)
        task.add_done_callback(self._reclaims.discard)

    async def _drop(self, shard: int) -> None:
        await self._stop_serving(shard)
        await self._forget(shard, EndReason.DROPPED)

    async def _forget(self, shard: int, reason: EndReason) -> None:
        self.service.ledger.take_shard(shard, self.service._clock(), reason)
        self.serving.pop(shard, None)
        self.leaving.discard(shard)
