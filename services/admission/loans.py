"""Loans of quota: room for a request that this instance's share of a limit cannot take.

When only this instance's share keeps a request from the provider a lone instance holding the
whole limit would run it on, the request borrows first (`Loans.borrow`): what nobody holds, by
one CAS raising this instance's entry, then a peer's idle quota, which the peer moves to this
instance in one CAS of the book (`Loans.lend`, asked over ``llmgw.v1.admission.loan.<peer>`` by
`LoanDesk`). A loan keeps every sum of the book, the lender lowers its grants before it writes
and the borrower raises its own only once the book shows the loan: never an over-admission.

It reads and writes the books only through the keeper (`QuotaKeeper.cas`, `write_own`, `sync`);
of the ledger it reads what is used and spendable; of the request path it knows only the
`then` it calls once a round lands (the placement).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import ValidationError

from llmgw.core.quota import NO_COUNTS, Quota, QuotaBook, QuotaCounts, headroom, idle, lendable
from llmgw.wire import QuotaLoan, QuotaLoanAsk, loan_subject

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from llmgw.services.admission.membership import Membership
    from llmgw.services.admission.quotas import QuotaKeeper

log = logging.getLogger("llmgw.admission.quotas")
_desk_log = logging.getLogger("llmgw.admission")

Pair = tuple[str, str]
T = TypeVar("T")
_MAX_CAS = 20
_MAX_LENDERS = 3  # peers asked in one borrowing round, most idle first
# Seconds a peer that lent nothing is not asked again for the pair, unless one of its requests
# ends meanwhile (`peer_freed`).
_DRY_FOR = 0.25
_LEND_LOCK_WAIT = 0.1  # a lender busy longer (a handover's transfer) lends nothing
# Asks a peer for a loan: (peer, pair, counts asked) -> (counts lent, the book's revision with
# the loan), or None when the peer did not answer.
AskLoan = Callable[[str, Pair, QuotaCounts], Awaitable[tuple[QuotaCounts, int] | None]]


class Loans:
    """Borrowing rounds of this instance, and its loans to peers."""

    def __init__(
        self,
        keeper: QuotaKeeper,
        *,
        monotonic: Callable[[], float],
    ) -> None:
        self.keeper = keeper
        self.ask_loan: AskLoan | None = None  # `LoanDesk.ask`, once the instance has started
        # Evicts up to n idle pins of a pair (as a new pin would), returns how many: a lender
        # asked for pins it holds for idle sessions frees them as a lone instance would. Set by
        # the service as it starts.
        self.evict_idle: Callable[[Pair, int], int] | None = None
        self._monotonic = monotonic
        # The round of each pair that requests can still join, the round running, what the
        # running round is getting for its waiters (never given back by `adjust` until they are
        # placed: `borrowing`).
        self._joinable: dict[Pair, _Round[Any]] = {}
        self._running: dict[Pair, asyncio.Task[None]] = {}
        self._borrowing: dict[Pair, QuotaCounts] = {}
        self._dry: dict[tuple[Pair, str], float] = {}  # (pair, peer) -> not asked until
        self.rounds = {"free": 0, "lent": 0, "none": 0}  # borrowing rounds, by where room came from
        self.lent = 0  # loans this instance made to peers

    def borrowing(self, pair: Pair) -> QuotaCounts:
        """Room a running round got for its waiters, not placed yet: in use, to the keeper."""
        return self._borrowing.get(pair, NO_COUNTS)

    def held_back(self) -> None:
        """A request was held back by this instance's share, and nothing seemed to be had."""
        self.rounds["none"] += 1

    def spare(self, pair: Pair) -> QuotaCounts | None:
        """How much more of `pair` this instance could at most get on the request path: what
        nobody holds, plus what live peers hold (peers that just lent nothing are left out for
        a moment). None: nothing, or not a kept pair."""
        limits = self.keeper.limits.get(pair)
        stored = self.keeper.books.get(pair)
        if limits is None or stored is None or self.keeper.joins.joining(pair):
            return None
        book = stored.value
        g, u, p = book.free(limits)
        if self.ask_loan is not None:
            now = self._monotonic()
            for peer in self.keeper.membership.live():
                if peer == self.keeper.me or self._dry.get((pair, peer), 0.0) > now:
                    continue
                # Its wants are as old as its last write: a peer holding any is worth asking
                # (it answers for what it really has idle; one that lends nothing is left out
                # for a moment). Pins held for idle sessions are its to evict and lend, as a
                # lone instance would evict them for a new session.
                entry = book.quota(peer)
                g, u, p = g + entry.g, u + entry.u, p + entry.p
        if g <= 0 and u <= 0 and p <= 0:
            return None
        return QuotaCounts(max(0, g), max(0, u), max(0, p))

    def peer_freed(self, peer: str) -> None:
        """A request of `peer`'s ended (its load gossip): it is asked again at once, though it
        lent nothing a moment ago (`_DRY_FOR` is for a peer whose quota is all in use)."""
        for key in [k for k in self._dry if k[1] == peer]:
            del self._dry[key]

    def _slack(self, pair: Pair) -> QuotaCounts:
        """The headroom every instance asks for beyond its use (`desired`), per count."""
        limits = self.keeper.limits[pair]
        members = max(1, len(self.keeper.membership.live()))
        total = limits.max_global_in_flight_request_slots
        reserved = min(limits.global_in_flight_request_slots_reserved_for_pinned_sessions, total)
        return QuotaCounts(
            headroom(total, members),
            headroom(total - reserved, members),
            headroom(limits.max_pinned_sessions, members),
        )

    async def borrow(self, pair: Pair, need: QuotaCounts, then: Callable[[], T]) -> T:
        """Get room for a request that will use `need` of `pair` and that this instance's share
        cannot take, then call `then` (which places it) in the same event-loop turn as the last
        of it lands.

        Requests of a pair that need room together share one round: first what nobody holds
        (one CAS raising this instance's entry, with headroom), then loans from the peers that
        hold any of what is missing, most idle first by the book's guess (each moves its own
        idle quota to this instance in one CAS of the book, `lend`). Never over-admits: a loan is a CAS of the book that keeps every sum,
        the lender lowers its own grants before it writes, and this instance raises its grants
        only once the book shows the loan. `then` runs even if nothing came (the request then
        goes where placement sends it)."""
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        joinable = self._joinable.get(pair)
        if joinable is None:
            joinable = self._joinable[pair] = _Round()
            previous = self._running.get(pair)
            self._running[pair] = asyncio.create_task(
                self._round(pair, joinable, previous), name="quota-loan"
            )
        joinable.add(need, waiter, then)
        return await waiter

    async def _round(
        self, pair: Pair, round_: _Round[Any], previous: asyncio.Task[None] | None
    ) -> None:
        try:
            if previous is not None:
                await asyncio.wait({previous})  # one round of a pair at a time; never raises
            if self._joinable.get(pair) is round_:
                del self._joinable[pair]  # requests from now on join the next round
            self._borrowing[pair] = round_.need
            try:
                source = await self._get_room(pair, self._lacking(pair, round_.need))
                self.rounds[source] += 1
            except Exception:
                log.warning("borrowing quota of %s failed", pair, exc_info=True)
        finally:
            if self._joinable.get(pair) is round_:  # cancelled before it started
                del self._joinable[pair]
            round_.settle()  # places every waiter now, in this turn, before the floor goes
            self._borrowing.pop(pair, None)
            if self._running.get(pair) is asyncio.current_task():
                del self._running[pair]

    def _lacking(self, pair: Pair, need: QuotaCounts) -> QuotaCounts:
        """What this instance's quota of `pair` lacks for requests that will use `need` more
        (leases, unreserved, pins) than it uses now. A lease with room for leases fits a pinned
        request (its reserve, or unreserved quota, has room: g = (g - u) + u)."""
        quota = self.keeper.ledger.pair_quota(pair) or Quota()
        use = self.keeper.ledger.pair_use(pair)
        return QuotaCounts(
            max(0, need.leases - (quota.g - use.leases)),
            max(0, need.unreserved - (quota.u - use.unreserved)),
            max(0, need.pins - (quota.p - use.pins)),
        )

    async def _get_room(self, pair: Pair, need: QuotaCounts) -> str:
        """Get up to `need` more of `pair`: from what nobody holds, then from peers. Returns
        where room came from ("free", "lent", or "none"; "free" too when nothing was lacking
        any more: room came back here meanwhile)."""
        if not any(need):
            return "free"
        source = "none"
        limits = self.keeper.limits[pair]
        slack = self._slack(pair)

        def take_free(book: QuotaBook) -> tuple[QuotaBook, QuotaCounts] | None:
            free_g, free_u, free_p = book.free(limits)
            mine = book.quota(self.keeper.me)
            g = max(0, min(free_g, need.leases + slack.leases)) if need.leases else 0
            u = (
                max(0, min(free_u, need.unreserved + slack.unreserved, mine.g + g - mine.u))
                if need.unreserved
                else 0
            )
            p = max(0, min(free_p, need.pins + slack.pins)) if need.pins else 0
            if g == 0 and u == 0 and p == 0:
                return None  # nothing that helps is free
            use = self.keeper.ledger.pair_use(pair)
            entry = Quota(
                mine.g + g,
                mine.u + u,
                mine.p + p,
                max(mine.wg, min(limits.max_global_in_flight_request_slots, use.leases + g)),
                max(mine.wu, use.unreserved + u),
                max(mine.wp, min(limits.max_pinned_sessions, use.pins + p)),
                self.keeper.clock(),
            )
            return book.with_quota(self.keeper.me, entry), QuotaCounts(g, u, p)

        # Raising its own entry needs no lock (only lowering does: `_writing`); a write of the
        # keeper's in flight meanwhile makes one of the two CASes fail and read again.
        got = await self.keeper.cas(pair, take_free)
        self.keeper.sync(pair)
        left = need
        if got is not None:
            source = "free"
            left = need.less(got)
        if not any(left) or self.ask_loan is None:
            return source
        now = self._monotonic()
        book = self.keeper.books[pair].value
        peers = [
            (idle(book.quota(peer), slack), peer)
            for peer in self.keeper.membership.live()
            if peer != self.keeper.me and self._dry.get((pair, peer), 0.0) <= now
        ]
        # Most idle first by the book's guess; any that holds what is missing may have it idle.
        peers = [
            (i, peer)
            for i, peer in peers
            if any(a and b for a, b in zip(book.quota(peer).counts, left, strict=True))
        ]
        # Most of what is missing first (unreserved alone, when only that is: a peer whose
        # leases pinned sessions hold may have it idle), then the most idle leases and pins.
        peers.sort(
            key=lambda item: (
                -sum(min(i, n) for i, n in zip(item[0], left, strict=True)),
                -item[0][0],
                -item[0][2],
                item[1],
            )
        )
        for _, peer in peers[:_MAX_LENDERS]:
            answer = await self.ask_loan(peer, pair, left)
            lent = answer[0] if answer is not None else QuotaCounts()
            if not any(lent):
                self._dry[(pair, peer)] = self._monotonic() + _DRY_FOR
                continue
            assert answer is not None
            await self._catch_up(pair, answer[1])
            source = "lent"
            left = left.less(lent)
            if not any(left):
                break
        return source

    async def _catch_up(self, pair: Pair, revision: int) -> None:
        """Read the pair's book if the copy here is older than `revision` (a loan that landed)."""
        if self.keeper.books[pair].revision >= revision:
            return
        fresh = await self.keeper.store.quota_book(*pair)
        if fresh.revision > self.keeper.books[pair].revision:
            self.keeper.books[pair] = fresh
            self.keeper.sync(pair)

    async def lend(self, borrower: str, pair: Pair, ask: QuotaCounts) -> tuple[QuotaCounts, int]:
        """A live peer asks for room this instance holds idle: move what it can spare (never
        what it uses or has set aside, `llmgw.core.quota.lendable`) to the peer, in one CAS of
        the book. Lowered here before the write is sent (nothing is granted into what is lent),
        as `adjust` does. Returns what moved and the book's revision (0: nothing moved)."""
        if (
            pair not in self.keeper.limits
            or pair not in self.keeper.books
            or borrower == self.keeper.me
        ):
            return NO_COUNTS, 0
        if borrower not in self.keeper.membership.live():
            return NO_COUNTS, 0

        try:  # the keeper may be busy with a handover's transfer: then lend nothing
            await asyncio.wait_for(self.keeper.lock.acquire(), _LEND_LOCK_WAIT)
        except TimeoutError:
            return NO_COUNTS, 0
        try:
            for _ in range(_MAX_CAS):
                stored = self.keeper.books[pair]
                entry = stored.value.quota(self.keeper.me)
                spendable = self.keeper.ledger.pair_quota(pair) or Quota()
                use = self.keeper.ledger.pair_use(pair)
                theirs = stored.value.quota(borrower)
                g, u, p = lendable(entry, spendable, use.counts, ask, theirs)
                if (
                    p < ask.pins
                    and self.evict_idle is not None
                    and self.evict_idle(pair, ask.pins - p)
                ):
                    use = self.keeper.ledger.pair_use(
                        pair
                    )  # fewer pins held now: lend what they had
                    g, u, p = lendable(entry, spendable, use.counts, ask, theirs)
                if g == 0 and u == 0 and p == 0:
                    return NO_COUNTS, 0
                book = stored.value.lend(self.keeper.me, borrower, g, u, p, at=self.keeper.clock())
                revision = await self.keeper.write_own(pair, stored, book)
                if revision is not None:
                    self.lent += 1
                    self.keeper.wake()
                    return QuotaCounts(g, u, p), revision
        finally:
            self.keeper.lock.release()
        return NO_COUNTS, 0


@dataclass(slots=True)
class _Round(Generic[T]):
    """One borrowing round of a pair: what its requests need together, and how to place each
    (`Loans.borrow`)."""

    need: QuotaCounts = NO_COUNTS
    waiters: list[tuple[asyncio.Future[T], Callable[[], T]]] = field(default_factory=list)

    def add(self, need: QuotaCounts, waiter: asyncio.Future[T], then: Callable[[], T]) -> None:
        self.need = self.need.plus(need)
        self.waiters.append((waiter, then))

    def settle(self) -> None:
        """Place every waiter, one after another in this turn (no await between)."""
        waiters, self.waiters = self.waiters, []
        for waiter, then in waiters:
            if waiter.done():
                continue
            try:
                waiter.set_result(then())
            except Exception as exc:
                waiter.set_exception(exc)


class LoanDesk:
    """The loans' transport: asks a peer to lend (`ask`), answers a peer's ask (`on_ask`)."""

    def __init__(self, nc: NATS, membership: Membership, loans: Loans, *, timeout: float) -> None:
        self.nc = nc
        self.membership = membership
        self.loans = loans
        # A peer's loan is one request/reply and one CAS: a peer that takes longer is skipped.
        self.timeout = timeout

    async def ask(self, peer: str, pair: Pair, need: QuotaCounts) -> tuple[QuotaCounts, int] | None:
        """Ask `peer` to lend quota of `pair` (`Loans.borrow`'s transport)."""
        ask = QuotaLoanAsk(
            borrower=self.membership.instance,
            provider=pair[0],
            model=pair[1],
            g=need.leases,
            u=need.unreserved,
            p=need.pins,
        )
        try:
            msg = await self.nc.request(
                loan_subject(peer), ask.model_dump_json().encode(), timeout=self.timeout
            )
            loan = QuotaLoan.model_validate_json(msg.data)
        except Exception:  # no responders, a timeout, NATS trouble: place without it
            _desk_log.debug("no loan from %s for %s", peer, pair, exc_info=True)
            return None
        return QuotaCounts(loan.g, loan.u, loan.p), loan.revision

    async def on_ask(self, msg: Msg) -> None:
        """A peer's ask (``llmgw.v1.admission.loan.<instance>``): lend what is idle here."""
        try:
            ask = QuotaLoanAsk.model_validate_json(msg.data)
        except ValidationError:
            _desk_log.warning("malformed quota loan request")
            return
        lent, revision = QuotaCounts(), 0
        if self.membership.can_serve():
            try:
                lent, revision = await self.loans.lend(
                    ask.borrower, (ask.provider, ask.model), QuotaCounts(ask.g, ask.u, ask.p)
                )
            except Exception:
                _desk_log.warning(
                    "lending quota of %s failed", (ask.provider, ask.model), exc_info=True
                )
        if msg.reply:
            answer = QuotaLoan(g=lent.leases, u=lent.unreserved, p=lent.pins, revision=revision)
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, answer.model_dump_json().encode())
