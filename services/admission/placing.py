"""Placement applied: where a request runs, its lease taken and its pin changed, in one step.

`Placer.place` runs `llmgw.core.placement.place` over one snapshot of the catalog for each model
that may serve the request (its own, then its fallbacks) and applies the result to the ledger in
the same event-loop turn: the lease granted, the pin created, moved or kept (and written to the
routing bucket in the background), idle pins evicted for a new one. With loans
(`place_or_borrow`), a request that only this instance's share of a limit keeps from the
provider a lone instance would run it on gets the `Loan` it needs instead, or the `QuotaWait`
it waits in; nothing is taken or changed then.

The placer decides and applies, synchronously, and awaits nothing: it does not queue, borrow or
answer (`Waiting`, `Loans`, `Answers` do); of the quota keeper it reads only what could be
borrowed (`Loans.spare`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmgw.core.apikeys import key_pair
from llmgw.core.keys import pin_key
from llmgw.core.ledger import LeaseKind, LeaseRecord, Ledger, PinRecord
from llmgw.core.outcomes import Refusal
from llmgw.core.placement import (
    PinAction,
    Placement,
    PlacementRequest,
    Route,
    Snapshot,
    place,
)
from llmgw.core.quota import QuotaCounts
from llmgw.events import EventPublisher, PinEvent, PinMoved
from llmgw.services.admission.decision import Current, Deciding, Loan, QuotaWait
from llmgw.wire import AdmitReply, ReplyStatus, Target, trusted

if TYPE_CHECKING:
    from llmgw.core.breaker import BreakerBoard
    from llmgw.core.context import ContextNeed
    from llmgw.core.requests import Feature
    from llmgw.services.admission.answers import Answers
    from llmgw.services.admission.loans import Loans
    from llmgw.services.admission.membership import Membership
    from llmgw.services.admission.metrics import AdmissionMetrics
    from llmgw.services.admission.pins import PinWriter
    from llmgw.services.admission.prefixes import PrefixBoard
    from llmgw.wire import AdmitRequest

_LOAN_ROUNDS = 2  # borrowing rounds a request may wait for, per pair
# Why a request runs on a third party when it is only our quota that is full: a new session
# (or unpinned request) no managed provider took, a pinned turn over the pair's lease limit.
_QUOTA_OFFLOADS = frozenset({"no_managed_room", "global_limit"})


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


def pin_event(events: EventPublisher, pin: PinRecord, event: str) -> None:
    """A pin's ``pin.*`` event (created, evicted, expired)."""
    events.emit(
        PinEvent,
        event=event,
        provider=pin.provider,
        model=pin.model,
        session=pin.session,
        pin_id=pin.pin_id,
        shard=pin.shard,
        parent=pin.parent,
    )


class Placer:
    """Places requests and applies the placements to the ledger, pins and events."""

    def __init__(
        self,
        current: Current,
        ledger: Ledger,
        *,
        loans: Loans,
        prefixes: PrefixBoard,
        breakers: BreakerBoard,
        pins: PinWriter,
        events: EventPublisher,
        metrics: AdmissionMetrics,
        answers: Answers,
        membership: Membership,
        flow_on: bool,
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        self.current = current
        self.ledger = ledger
        self.loans = loans
        self.prefixes = prefixes
        self.breakers = breakers
        self.pins = pins
        self.events = events
        self.metrics = metrics
        self.answers = answers
        self.membership = membership
        self.flow_on = flow_on  # flow control runs: a request that may not overflow waits
        self._rng = rng
        self._clock = clock

    def place_or_borrow(
        self, context: Deciding, *, overflow: bool, tried: Sequence[tuple[str, str]] = ()
    ) -> AdmitReply | Loan | QuotaWait:
        """`place`, unless this instance's share of a limit is all that keeps the request off
        the provider a lone instance holding the whole limit would run it on: then the loan
        it needs first; or, for a request of a band that waits, quota alone keeps it off our
        engines: then it waits (`QuotaWait`). `tried`: the pairs of the borrowing rounds it
        waited for already."""
        return self._place(context, overflow=overflow, loans=True, tried=tried)

    def place(self, context: Deciding, *, overflow: bool) -> AdmitReply:
        """Place the request, take its lease and change its pin: one synchronous step."""
        placed = self._place(context, overflow=overflow, loans=False)
        assert isinstance(placed, AdmitReply)
        return placed

    def _place(
        self,
        context: Deciding,
        *,
        overflow: bool,
        loans: bool,
        tried: Sequence[tuple[str, str]] = (),
    ) -> AdmitReply | Loan | QuotaWait:
        """`place`; with `loans`, a request that only this instance's share of a limit keeps
        from its place gets the `Loan` it needs instead (nothing taken or changed), at most
        `_LOAN_ROUNDS` per pair (`tried`: the pairs of the rounds it waited for already); past
        those, a request of a band that waits (`QuotaWait`) is held rather than sent to a
        third party or refused."""
        request = context.request
        now = self._clock()
        if not self.ledger.key_room(request.key):  # checked and granted in this one step
            if loans and request.key is not None:
                pair = key_pair(request.key)
                if tried.count(pair) < _LOAN_ROUNDS and self.loans.spare(pair) is not None:
                    return Loan(pair, QuotaCounts(1, 1, 0), overflow)  # what the request will use
            return self.answers.refusal(
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
        grace_until = context.arrived + self.current.config.admission.limit_grace
        brief = (
            loans and not overflow and not waits and not context.grace_spent and now < grace_until
        )
        held: tuple[str, str] | None = None  # a managed pair whose quota alone held it back
        for candidate in models:
            snapshot, pin = self.current.catalog.snapshot(
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
                return self.answers.refusal(
                    request.id,
                    Refusal.UNSUPPORTED,
                    f"No provider serves '{request.model}' for {request.feature} requests.",
                )
        if held is not None and (
            not isinstance(outcome, Placement)
            or (
                self.current.catalog.is_unlimited(outcome.provider)
                and offload_reason(outcome) in _QUOTA_OFFLOADS
            )
        ):
            return QuotaWait(held, None if waits else grace_until)
        if too_long and context.need is not None and request.max_output is not None:
            return self.too_long(request, models, context.feature, context.need)
        if not isinstance(outcome, Placement):
            return self.answers.refusal(
                request.id,
                Refusal.NO_CAPACITY,
                f"No provider can take a '{request.model}' request right now.",
            )
        if served != models[0]:  # (one that fits no window of its model counts in window_routes)
            self.metrics.child(self.metrics.fallbacks, request.model, served).inc()
        lease = self._apply(request, outcome, served, pin, now)
        endpoint = self.current.catalog.endpoint_config(outcome.endpoint)
        if context.prompt is not None and not self.current.catalog.is_unlimited(outcome.provider):
            share, index = self.prefixes.placed(endpoint.id, served, context.prompt, now)
            self.metrics.child(self.metrics.prefix_share, index).observe(share)
        self.breakers.take(endpoint.id, now)  # half open: this request is the probe
        self.metrics.child(self.metrics.placements, outcome.provider, outcome.route.value).inc()
        if outcome.affinity_break is not None:
            self.metrics.child(
                self.metrics.affinity_breaks, outcome.provider, outcome.affinity_break
            ).inc()
        if self.current.catalog.is_unlimited(outcome.provider):
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
                provider_kind=self.current.catalog.kind(outcome.provider).value,
                endpoint=endpoint.id,
                url=endpoint.url,
                upstream_model=endpoint.upstream_name(served),
                priority=self.current.engine_priority[context.band.name]
                if endpoint.priority_scheduling
                else None,
            ),
            lease=lease,
            route=outcome.route.value,
            served_model=served,
            refresh=outcome.refresh_pin_on_success,
            owner=self.membership.instance,
        )

    def _waits_for_ours(self, context: Deciding) -> bool:
        """Whether the request waits for our engines rather than runs on a third party: it may
        not overflow (its band does not, its overflow budget is used up, or no third party
        serves its model: a band with nowhere to overflow waits like any other), and flow
        control runs."""
        return self.flow_on and not context.can_overflow

    def _loan_for(
        self, snapshot: Snapshot, asked: PlacementRequest, outcome: Any, model: str
    ) -> Loan | None:
        """The loan that would let the request run where a lone instance would run it: the
        placement over the same snapshot with every managed pair's room as if this instance
        held what it could borrow (`Loans.spare`). None when that changes nothing."""
        spares = {}
        providers = []
        for state in snapshot.providers:
            spare = self.loans.spare((state.id, model)) if state.managed else None
            if spare is not None:
                spares[state.id] = spare
                room = self.ledger.room(state.id, model, spare)
                state = replace(state, room=room)
            providers.append(state)
        if not spares:
            self.loans.held_back()  # held back, and nothing seems to be had
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
        return Loan((ideal.provider, model), QuotaCounts(1, unreserved, pin), asked.overflow)

    def too_long(
        self, request: AdmitRequest, models: tuple[str, ...], feature: Feature, need: ContextNeed
    ) -> AdmitReply:
        """The refusal of a request that fits no endpoint of its model or of its fallbacks."""
        self.metrics.child(self.metrics.window_routes, request.model, "none").inc()
        largest = max(
            (
                w
                for m in models
                if (w := self.current.catalog.largest_window(m, feature)) is not None
            ),
            default=None,
        )
        needs = f"{'' if need.exact else 'at least '}{need.tokens()} tokens"
        where = "This model's" if len(models) == 1 else "This model's (and its fallbacks')"
        return self.answers.refusal(
            request.id,
            Refusal.CONTEXT_LENGTH_EXCEEDED,
            f"{where} maximum context length is {largest} tokens. However, your request needs "
            f"{needs} ({need.prompt} in the prompt, {max(1, need.output)} for the output). "
            "Please reduce the length of the messages or of the output.",
        )

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
            self.pins.defer(listed, now)  # written once its session comes back
            pin_event(self.events, listed, "pin.created")
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
        if pin is not None and placement.pin_action is PinAction.NONE:
            self.pins.used_again(pin)  # its session came back: a deferred first write now
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
        victims = self.ledger.to_evict(
            provider, model, now, self.current.catalog.min_idle_before_evict
        )
        if not victims:
            # placement saw them: nothing changed in between (same turn)
            raise RuntimeError("no pin to evict")
        for victim in victims:
            self._evict_pin(victim, now)

    def _evict_one(self, provider: str, model: str, now: float) -> bool:
        """Evict the pair's least recently used evictable pin, if it has one."""
        victim = self.ledger.evictable(
            provider, model, now, self.current.catalog.min_idle_before_evict
        )
        if victim is None:
            return False
        self._evict_pin(victim, now)
        return True

    def _evict_pin(self, victim: PinRecord, now: float) -> None:
        self.ledger.remove_pin(victim, now, "evicted")
        self.pins.delete(victim)
        self.metrics.pins_evicted.labels(victim.provider).inc()
        pin_event(self.events, victim, "pin.evicted")

    def evict_idle(self, pair: tuple[str, str], count: int) -> int:
        """Evict up to `count` idle pins of `pair` (those a new pin here would evict) so that
        their pin quota can be lent to a peer; returns how many went."""
        now = self._clock()
        evicted = 0
        while evicted < count and self._evict_one(*pair, now):
            evicted += 1
        return evicted
