"""The admission service: decides the requests of the shards it owns, in memory.

Per request, flow control (`FlowControl`) says whether it may run now, waits, or overflows to
an unlimited provider; placement (`llmgw.core.placement`) picks provider, endpoint and what
happens to the session's pin, over one snapshot; the ledger (`llmgw.core.ledger`) takes the
lease and changes the pin. Decision and transition happen in one event-loop turn: atomic, with
no I/O on the way. The common path costs no KV round trip at all: pins are written to the
routing bucket in the background (`PinWriter`), and leases live only here and at the edge.

`AdmissionService` is the composition root: it builds the rooms, wires each to what it needs
and runs their lifetime (start, a rejoin after a loss, stop). Each room is a module of its own
(docs/architecture.md, "Admission in rooms"):

- `Intake` (intake.py): a request's entry, the checks and flow control's gate;
- `Waiting` (waiting.py): a request that waits in a queue, for a loan or for room;
- `Placer` (placing.py): placement applied to the ledger, pins and events;
- `Answers` (answers.py): replies, and their memory for an edge that asks again;
- `LeaseUpkeep` (upkeep.py): renewals, ends and expiry of the leases granted here;
- `LoadGossip` (gossip.py): every instance's leases per endpoint, shared;
- `QuotaKeeper` (quotas.py) with `QuotaJoins`, `Earmarks` and `Loans`: the quota books;
- `ShardKeeper` (shards.py): which shards this instance serves, handovers and adoption.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from llmgw.clock import SYSTEM, Clock
from llmgw.config.schema import limits_from_config
from llmgw.core.breaker import BreakerBoard, BreakerSettings
from llmgw.core.ledger import LeaseKind, Ledger, LedgerObserver
from llmgw.events import EventPublisher
from llmgw.services.admission.answers import Answers
from llmgw.services.admission.balancing import RateBoard
from llmgw.services.admission.catalog import ProviderCatalog
from llmgw.services.admission.decision import Current
from llmgw.services.admission.flow import FlowControl
from llmgw.services.admission.gossip import LoadGossip
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.intake import Intake
from llmgw.services.admission.loadboard import LoadBoard
from llmgw.services.admission.loans import LoanDesk
from llmgw.services.admission.membership import Membership
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.services.admission.pins import PinWriter
from llmgw.services.admission.placing import Placer, new_token
from llmgw.services.admission.prefixes import PrefixBoard
from llmgw.services.admission.quotas import QuotaKeeper
from llmgw.services.admission.shards import ShardContext, ShardKeeper
from llmgw.services.admission.status import health_reply, state_reply
from llmgw.services.admission.tracing import DecisionSpans
from llmgw.services.admission.upkeep import LeaseUpkeep
from llmgw.services.admission.waiting import Waiting
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    ADMISSION_HEALTH_SUBJECT,
    ADMISSION_LOAD_SUBJECT,
    ADMISSION_STATE_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitReply,
    AdmitRequest,
    RequestEnded,
    handover_subject,
    loan_subject,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.state.store import RoutingStore
    from llmgw.tracing import Tracing

log = logging.getLogger("llmgw.admission")


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
        clock: Clock = SYSTEM,
        tracing: Tracing | None = None,
    ) -> None:
        # One clock for every room: the wall reader stamps what other hosts read (pins, quota
        # books, events), the monotonic one measures graces, intervals and expiries here.
        monotonic = clock.monotonic
        wall = clock.wall
        spans = DecisionSpans(tracing) if tracing is not None else None
        self.nc = nc
        self.store = store
        self._clock = wall
        self._rng = rng or random.Random()
        self.health = health or HealthBoard()
        self.load = load or LoadBoard(config, self.health)
        self.metrics = metrics or AdmissionMetrics()
        self.events = events or EventPublisher(nc, instance, clock=wall)
        pinning, admission = config.pinning, config.admission
        # ---- the state: ledger, boards, catalog ----
        self.limits = limits_from_config(config)
        self.ledger = Ledger(
            self.limits,
            lease_timeout=pinning.lease_timeout,
            pin_inactivity_timeout=pinning.pin_inactivity_timeout,
            observer=observer,
        )
        self.rates = rates or RateBoard(config, rng=self._rng, clock=wall)
        self.breakers = BreakerBoard(
            BreakerSettings(
                failure_threshold=config.router.failure_threshold, cooldown=config.router.cooldown
            ),
            self._rng.random,
        )
        self.prefixes = PrefixBoard(config, self.load, instance, clock=wall)
        catalog = ProviderCatalog(
            config,
            self.health,
            self.load,
            self.rates,
            self.breakers,
            self.ledger,
            clock=wall,
            prefixes=self.prefixes,
        )
        self.current = Current(config, catalog)
        self.current.follow(config)
        self.fleet_revision = 0  # the live fleet's revision applied (services/admission/live.py)
        self.config_revision = 0  # the applied config's revision in force here (0: the file)
        # ---- membership and the quota books ----
        self.membership = Membership(
            store,
            instance,
            heartbeat=admission.heartbeat,
            ttl=admission.member_ttl,
            clock=wall,
            monotonic=monotonic,
        )
        self.quotas = QuotaKeeper(
            store,
            self.ledger,
            self.membership,
            self.limits,
            interval=admission.quota_interval,
            clock=wall,
        )
        loans = self.quotas.loans
        self.pins = PinWriter(store, self.ledger)
        # ---- the decision: answers, placement, waiting, flow control, intake ----
        self.answers = Answers(
            nc,
            self.ledger,
            self.metrics,
            clock=wall,
            remember_for=2 * config.nats.request_timeout,
            spans=spans,
        )
        self.placer = Placer(
            self.current,
            self.ledger,
            loans=loans,
            prefixes=self.prefixes,
            breakers=self.breakers,
            pins=self.pins,
            events=self.events,
            metrics=self.metrics,
            answers=self.answers,
            membership=self.membership,
            flow_on=admission.enabled,
            rng=self._rng,
            clock=wall,
        )
        self.waiting = Waiting(
            self.placer, loans, self.answers, self.metrics, decides=self.decides, clock=wall
        )
        self.flow = (
            FlowControl(
                config, self.load, nc, instance, self.metrics, self.waiting.dispatch, clock=wall
            )
            if admission.enabled
            else None
        )
        self.waiting.flow = self.flow
        self.upkeep = LeaseUpkeep(
            nc,
            self.current,
            self.ledger,
            answers=self.answers,
            rates=self.rates,
            breakers=self.breakers,
            pins=self.pins,
            events=self.events,
            metrics=self.metrics,
            membership=self.membership,
            serves=self.serves,
            decides=self.decides,
            room_freed=self.waiting.room_freed,
            clock=wall,
            settle=min(2.0, pinning.lease_timeout / 3),
        )
        self.intake = Intake(
            self.current,
            self.ledger,
            waiting=self.waiting,
            placer=self.placer,
            answers=self.answers,
            upkeep=self.upkeep,
            quotas=self.quotas,
            prefixes=self.prefixes,
            metrics=self.metrics,
            decides=self.decides,
            spawn=self._spawn,
            clock=wall,
            spans=spans,
        )
        # ---- between instances: load gossip, loans, shards ----
        self.gossip = LoadGossip(
            nc,
            self.current,
            self.load,
            self.ledger,
            self.membership,
            peer_freed=self._peer_freed,
            spawn=self._spawn,
            clock=wall,
        )
        self.ledger.on_endpoint_change = self.gossip.endpoint_changed
        # A peer's loan is one request/reply and one CAS: a peer that takes longer is skipped.
        self.loan_desk = LoanDesk(
            nc, self.membership, loans, timeout=min(0.5, config.nats.request_timeout / 4)
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
                clock=wall,
                settings=admission,
                intake=self.intake,
                upkeep=self.upkeep,
                waiting=self.waiting,
                answers=self.answers,
            )
        )
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False

    # ---- what a live change swaps (`live.apply_fleet`) ------------------------------------------

    @property
    def config(self) -> Config:
        return self.current.config

    @config.setter
    def config(self, config: Config) -> None:
        self.current.config = config

    @property
    def catalog(self) -> ProviderCatalog:
        return self.current.catalog

    @catalog.setter
    def catalog(self, catalog: ProviderCatalog) -> None:
        self.current.catalog = catalog

    def follow_config(self, config: Config) -> int:
        """Decide by `config`'s models (names, fallbacks), bands and queue bounds from the next
        decision on, and expire idle pins after its `pin_inactivity_timeout` (an applied
        config; `live.apply_fleet` swaps the rest). Queued requests of a removed band are
        answered (`FlowControl.reconfigure`); returns how many."""
        self.current.follow(config)
        self.ledger.pin_inactivity_timeout = config.pinning.pin_inactivity_timeout
        return self.flow.reconfigure(config) if self.flow is not None else 0

    # ---- the wiring's few questions and signals ---------------------------------------------

    @property
    def instance(self) -> str:
        return self.membership.instance

    def serves(self, shard: int) -> bool:
        """Whether this instance serves `shard` (holds its leases and takes its requests)."""
        return self.shards.serves(shard)

    def decides(self, shard: int) -> bool:
        """Whether this instance decides `shard`'s requests now: it serves the shard and is not
        fenced. Asked again in the same turn as every decision (on arrival, after a loan, when
        the tick lets a queued request go): either may have changed while it waited."""
        return self.shards.serves(shard) and self.membership.can_serve()

    def _peer_freed(self, peer: str) -> None:
        """A request of `peer`'s ended (its load gossip): it may lend again, and room may be
        back for requests held for quota."""
        self.quotas.loans.peer_freed(peer)
        self.waiting.room_freed()

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- for callers in process: the colocated edge, tests and tools -----------------------------

    async def admit_here(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool] | None:
        """`Intake.admit_here`: decide `request` in the colocated edge's process."""
        return await self.intake.admit_here(request, client_gone)

    def begin(self, request: AdmitRequest, reply_to: str | None) -> AdmitReply | None:
        """`Intake.begin`: decide now, or queue (the answer goes to `reply_to` later)."""
        return self.intake.begin(request, reply_to)

    async def decide(self, request: AdmitRequest) -> AdmitReply:
        """`Intake.decide`: decide one request in process, waiting through the queue."""
        return await self.intake.decide(request)

    def serve_edge(self, edge: str) -> None:
        """`LeaseUpkeep.serve_edge`: this instance runs in edge `edge`'s process."""
        self.upkeep.serve_edge(edge)

    def ended_here(self, ended: RequestEnded) -> bool:
        """`LeaseUpkeep.ended_here`: apply an end handed over in process."""
        return self.upkeep.ended_here(ended)

    async def on_request(self, msg: Msg) -> None:
        """`Intake.on_request`: an admission request message of a shard served here."""
        await self.intake.on_request(msg)

    async def on_request_ended(self, msg: Msg) -> None:
        await self.upkeep.on_request_ended(msg)

    def expire(self, now: float) -> None:
        """One pass of expiry (`LeaseUpkeep.expire`), and the load heartbeat to the peers."""
        self.upkeep.expire(now)
        self.gossip.heartbeat(now)

    # ---- lifetime -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.ensure_layout(self.config.admission.shards)
        self.membership.on_lost = self._lost
        await self.membership.join()
        for subject, handler in (
            (ADMISSION_HEALTH_SUBJECT, self._on_health),
            (ADMISSION_STATE_SUBJECT, self._on_state),
            (REQUEST_STATS_SUBJECT, self.upkeep.on_request_ended),
            (ADMISSION_LOAD_SUBJECT, self.gossip.on_load),
            (handover_subject(self.instance), self.shards.on_handover),
            (loan_subject(self.instance), self.loan_desk.on_ask),
        ):
            self._subs.append(await self.nc.subscribe(subject, cb=handler))
        self.quotas.loans.ask_loan = self.loan_desk.ask
        # A lender evicts idle pins it is asked for, a joining pair those above its limit.
        self.quotas.loans.evict_idle = self.placer.evict_idle
        self.quotas.joins.evict_idle = self.placer.evict_idle
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
        self.pins.abandon()  # its shards are others' to claim: no queued pin write lands
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
        self._subs.append(await self.nc.subscribe(loan_subject(new), cb=self.loan_desk.on_ask))
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

    async def _housekeeping(self) -> None:
        interval = self.config.pinning.reaper_interval
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                if self.membership.can_serve() and not self._stopping:
                    self.expire(self._clock())
                self.gossip.forget_gone()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping failed")

    async def _on_health(self, msg: Msg) -> None:
        if msg.reply:
            reply = health_reply(self.membership, self.shards.serving)
            await self.nc.publish(msg.reply, reply.model_dump_json().encode())

    async def _on_state(self, msg: Msg) -> None:
        if msg.reply:
            reply = state_reply(
                self.instance,
                self.ledger,
                self.shards.serving,
                self.prefixes,
                fleet_revision=self.fleet_revision,
                config_revision=self.config_revision,
            )
            await self.nc.publish(msg.reply, reply.model_dump_json().encode())


__all__ = ["AdmissionService", "LeaseKind"]
