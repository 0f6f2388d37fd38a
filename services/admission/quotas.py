"""Keeping this instance's quota of every pair with limits (llmgw.core.quota), by CAS.

Per pair, the keeper follows the pair's `QuotaBook` (a KV watch) and, whenever the book, the
members or this instance's use change (and at least every ``interval``), recomputes the fair
targets from everybody's wants and moves its own entry toward its target:

- down: never below what it uses (a quota never shrinks under a granted lease or a held pin);
- up: never beyond what nobody holds (Σ stays within the limits: the book's invariant).

Its wants are its use plus headroom (`llmgw.core.quota.headroom`), so a lone instance holds the
whole limit and several split it by demand. The ledger grants from the quota the book shows for
this instance (`Ledger.set_quota`), never more: a lower entry applies before its write is sent
(nothing is granted into what is being given back), a higher one only once it has landed, and
on every change another instance makes (a transfer to this instance, for example).

Adoption and handover move counts between instances in one CAS per pair (`transfer`), made by
the receiver just before it takes the shard's leases and pins in. A handover's giver sets them
aside first (`hold_out`: removed from its ledger, still in its entry, not spendable), then
earmarks them in the book (`earmark`); the receiver moves exactly the earmark, or the giver
takes it back (`reclaim`) when it no longer expects the receiver to. Which of the two happened
is whatever the book says, so no timing makes the same count spendable at both; the giver
spends an earmark again only once its book shows it is back (`llmgw.core.quota.QuotaBook.take`).
At the receiver, what `transfer` moves in is set aside for the shard (unspendable, never given
back) until `take_in` adds the shard's leases and pins to the ledger in the same step as it
makes that quota spendable: the receiver goes on deciding its own shards meanwhile (a transfer
of several pairs awaits the store between them), and a grant into that quota would leave the
handed leases without room (refused: their requests lost in a graceful handover).

An applied config changes which pairs have limits (`keep`, `release`; `llmgw.core.pairs`): a
pair that starts to have them is granted on from a quota only once its book holds every live
instance's first entry (what runs there) and fits the limits, leases and pins apart; until
then this instance only gives back, and evicts idle pins it holds above its share. A pair that
stops having them is no longer counted at once; this instance's entry leaves its book.

The sequences that call these operations, step by step, are `Handovers`' (``shards.py``; the
lifecycle: docs/adr/0002-admission-at-memory-speed.md, "Shard lifecycle").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from llmgw.core.apikeys import KeyLimits
from llmgw.core.keys import QUOTA_PREFIX
from llmgw.core.pairs import NOT_JOINED, Fits, first_entry, fits, joined
from llmgw.core.quota import (
    NO_COUNTS,
    NO_QUOTA,
    Quota,
    QuotaBook,
    QuotaCounts,
    QuotaError,
    fair_targets,
    headroom,
    idle,
    lendable,
    scaled_quota,
)
from llmgw.tasks import cancel_and_wait

if TYPE_CHECKING:
    from llmgw.core.ledger import LeaseRecord, Ledger, PinRecord, ShardState
    from llmgw.core.quota import PairLimits
    from llmgw.services.admission.membership import Membership
    from llmgw.state.store import RoutingStore, Stored

log = logging.getLogger("llmgw.admission.quotas")

Pair = tuple[str, str]
T = TypeVar("T")
_MAX_CAS = 20
_MAX_LENDERS = 3  # peers asked in one borrowing round, most idle first
# Seconds a peer that lent nothing is not asked again for the pair, unless one of its requests
# ends meanwhile (`peer_freed`).
_DRY_FOR = 0.25
_SLOW_JOIN = 10.0  # seconds a pair given limits may take to join before it is logged
_LEND_LOCK_WAIT = 0.1  # a lender busy longer (a handover's transfer) lends nothing
# Asks a peer for a loan: (peer, pair, counts asked) -> (counts lent, the book's revision with
# the loan), or None when the peer did not answer.
AskLoan = Callable[[str, Pair, QuotaCounts], Awaitable[tuple[QuotaCounts, int] | None]]


class QuotaKeeper:
    def __init__(
        self,
        store: RoutingStore,
        ledger: Ledger,
        membership: Membership,
        limits: Mapping[Pair, PairLimits | None],
        *,
        interval: float,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.membership = membership
        self.limits = {pair: lim for pair, lim in limits.items() if lim is not None}
        self.interval = interval
        self._clock = clock
        self.books: dict[Pair, Stored[QuotaBook]] = {}
        self._by_key: dict[str, Pair] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        # Use on its way to another instance (a shard being handed over): already out of the
        # ledger, its earmark not yet in the book (by shard, then pair). Never spendable; once
        # earmarked, the book's earmark stands for it (`_aside`).
        self._pending: dict[int, dict[Pair, QuotaCounts]] = {}
        # Quota moved (or being moved) to this instance for a shard it is taking in, by shard,
        # then pair: never spendable, never given back, until `take_in` adds the shard's
        # leases and pins to the ledger in the same step as it makes the quota theirs. With a
        # source: an earmark being taken, counted once the book no longer shows it.
        self._incoming: dict[int, dict[Pair, _Incoming]] = {}
        self._writing: dict[Pair, Quota] = {}  # this instance's entry while its write flies
        self._caps: dict[Pair, Quota] = {}  # limits lowered: the most it grants until the book fits
        self._tracking: dict[Pair, asyncio.Future[None]] = {}  # pairs added at run time
        # Pairs whose limits an applied config started to be kept (`keep`): no grant until the
        # book has joined (`llmgw.core.pairs.joined`); `_entered`: this instance's first entry
        # is written.
        self._joining: dict[Pair, Fits] = {}  # what of each has joined so far
        self._entered: set[Pair] = set()
        self._joins: dict[Pair, asyncio.Task[None]] = {}
        self._joining_since: dict[Pair, float] = {}  # until it joined or was said to lag
        # Loans (`borrow`): the round of each pair that requests can still join, the round
        # running, what the next round is to ask for, and what the running round is getting for
        # its waiters (never given back by `adjust` until they are placed).
        self.ask_loan: AskLoan | None = None  # set by the service (a NATS request to the peer)
        # Evicts up to n idle pins of a pair (as a new pin would), returns how many: a lender
        # asked for pins it holds for idle sessions frees them as a lone instance would.
        self.evict_idle: Callable[[Pair, int], int] | None = None
        self._joinable: dict[Pair, _Round[Any]] = {}
        self._running: dict[Pair, asyncio.Task[None]] = {}
        self._borrowing: dict[Pair, QuotaCounts] = {}
        self._dry: dict[tuple[Pair, str], float] = {}  # (pair, peer) -> not asked until
        self._monotonic = time.monotonic
        self.writes = 0
        self.conflicts = 0
        self.loans = {"free": 0, "lent": 0, "none": 0}  # borrowing rounds, by where room came from
        self.lent = 0  # loans this instance made to peers

    @property
    def me(self) -> str:
        return self.membership.instance

    async def start(self) -> None:
        from llmgw.core.keys import quota_key

        for pair in self.limits:
            self._by_key[quota_key(*pair)] = pair
            self.books[pair] = await self.store.quota_book(*pair)
            self._sync(pair)
        await self.adjust()
        self._tasks.append(asyncio.create_task(self._follow(), name="quota-watch"))
        self._tasks.append(asyncio.create_task(self._loop(), name="quota-keeper"))

    async def track(self, pair: Pair, limits: PairLimits) -> None:
        """Keep a quota of `pair` too, from now on (an API key's max_parallel_requests, first
        seen in a request or a shard taken in); a changed limit applies at once. The first call
        for a pair reads its book and takes a first share: the caller waits for that."""
        if pair in self.limits:
            if self.limits[pair] != limits:
                self.limits[pair] = limits
                self.ledger.limits[pair] = limits
                self.wake()
            return
        pending = self._tracking.get(pair)
        if pending is None:
            pending = asyncio.ensure_future(self._start_tracking(pair, limits))
            self._tracking[pair] = pending
        await asyncio.shield(pending)

    def change_limits(self, pair: Pair, limits: PairLimits) -> None:
        """Hold `pair` to new limits from now on (an applied config changed them).

        Raised: the keeper takes its share of the new room at its next adjustment. Lowered:
        this instance stops granting above the new limits at once, before any book write: its
        quota is capped at its share scaled down by the ratio of new to old (floor), so all
        instances' caps together stay within the new limits (their entries summed within the
        old ones). Leases already granted are never revoked: they end as they would. The cap
        goes once the book itself fits the new limits (every instance gave back enough)."""
        old = self.limits.get(pair)
        if old is None or old == limits:
            return
        if pair in self._joining:  # not granting yet: the new limits are what it joins under
            self.limits[pair] = limits
            self.ledger.limits[pair] = limits
            self.wake()
            return
        self.limits[pair] = limits
        self.ledger.limits[pair] = limits
        if pair in self.books:
            mine = self.books[pair].value.quota(self.me)
            current = self._caps.get(pair, mine)
            cap = scaled_quota(mine, old, limits)
            self._caps[pair] = Quota(
                min(cap.g, current.g), min(cap.u, current.u), min(cap.p, current.p)
            )
            self._sync(pair)
        self.wake()

    def keep(self, pair: Pair, limits: PairLimits) -> None:
        """Keep a quota of `pair` from now on: an applied config added it with limits, or gave
        it limits. No grant on it from this call on until its book has joined
        (`llmgw.core.pairs`): this instance writes what it runs there as its first entry, and
        grants again once every live instance has and the entries fit the limits."""
        if pair in self.limits:
            self.change_limits(pair, limits)
            return
        self.limits[pair] = limits
        self.ledger.keep_limits(pair, limits)  # zero quota: nothing granted until joined
        self._joining[pair] = NOT_JOINED
        self._joining_since[pair] = self._monotonic()
        self._entered.discard(pair)
        self._caps.pop(pair, None)
        if pair not in self._joins:
            self._joins[pair] = asyncio.create_task(self._join(pair), name="quota-join")

    async def _join(self, pair: Pair) -> None:
        from llmgw.core.keys import quota_key

        try:
            stored = await self.store.quota_book(*pair)
            if pair not in self.limits:
                return  # released meanwhile
            if pair not in self.books or stored.revision > self.books[pair].revision:
                self.books[pair] = stored
            self._by_key[quota_key(*pair)] = pair
            async with self._lock:
                await self._adjust(pair, False)
            self._sync(pair)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("joining the quota book of %s failed; retried", pair, exc_info=True)
        finally:
            self._joins.pop(pair, None)
        self.wake()

    def _evict_excess(self, pair: Pair, book: QuotaBook) -> None:
        """Pins held above P (taken while the pair had no limits): evict idle ones here, down
        to this instance's even share of P at most, so that the pins join (they are sessions
        between requests; the next request of each pins again)."""
        limits = self.limits[pair]
        excess = book.totals().pins - limits.max_pinned_sessions
        if excess <= 0 or self.evict_idle is None:
            return
        share = limits.max_pinned_sessions // max(1, len(self.membership.live()))
        over = self.ledger.pair_use(pair).pins - share
        if over > 0:
            self.evict_idle(pair, min(excess, over))

    def release(self, pair: Pair) -> None:
        """Stop keeping a quota of `pair`: an applied config removed it, or its limits. Its
        leases stop counting against limits here at once (they end as they would); this
        instance's entry leaves the book soon after (a later `keep` starts from a clean one)."""
        from llmgw.core.keys import quota_key

        if self.limits.pop(pair, None) is None:
            return
        self._joining.pop(pair, None)
        self._joining_since.pop(pair, None)
        self._entered.discard(pair)
        self._caps.pop(pair, None)
        self.books.pop(pair, None)
        self._by_key.pop(quota_key(*pair), None)
        self.ledger.drop_limits(pair)
        self._tasks.append(asyncio.create_task(self._leave(pair), name="quota-leave"))

    async def _leave(self, pair: Pair) -> None:
        """Drop this instance's entry from a book it no longer keeps (by CAS)."""
        for _ in range(_MAX_CAS):
            if pair in self.limits or self._closed:
                return  # kept again meanwhile: its own first entry replaces the old one
            try:
                stored = await self.store.quota_book(*pair)
                if self.me not in stored.value.holders:
                    return
                book = stored.value.drop(self.me)
                if await self.store.write_quota_book(book, stored.revision) is not None:
                    return
            except Exception:
                log.warning("leaving the quota book of %s failed", pair, exc_info=True)
                return

    async def track_keys(self, leases: Iterable[LeaseRecord]) -> None:
        """Track the API keys whose leases a shard brings in, before their counts move here."""
        for lease in leases:
            if lease.key_pair is not None and lease.key_limit is not None:
                await self.track(lease.key_pair, KeyLimits(lease.key_limit))

    async def _start_tracking(self, pair: Pair, limits: PairLimits) -> None:
        from llmgw.core.keys import quota_key

        try:
            self.books[pair] = await self.store.quota_book(*pair)
            self._by_key[quota_key(*pair)] = pair
            self.ledger.limits[pair] = limits
            self.limits[pair] = limits
            self._sync(pair)
            async with self._lock:
                await self._adjust(pair, False)
        finally:
            self._tracking.pop(pair, None)

    async def stop(self) -> None:
        self._closed = True
        await cancel_and_wait([*self._tasks, *self._joins.values()])
        self._tasks.clear()

    def wake(self) -> None:
        """Something changed (use, members): adjust soon."""
        self._wake.set()

    def _sync(self, pair: Pair) -> None:
        """Show the ledger this instance's entry of the book, less what is on its way out; while
        a smaller entry is being written, the smaller of the two. Nothing while a pair whose
        limits started to be kept has not joined (`keep`)."""
        stored = self.books.get(pair)
        if stored is None:
            return
        book = stored.value
        joining = self._joining.get(pair)
        if joining is not None:
            if pair not in self._entered:
                self.ledger.set_quota(pair, NO_QUOTA)
                return
            now = joining.join(joined(book, self.limits[pair], self.membership.live()))
            if now != joining:
                log.info("the quota book of %s/%s joined: %s", *pair, now)
                self.wake()
            joining = self._joining[pair] = now
            if now.both:
                del self._joining[pair]
        quota = book.quota(self.me)
        cap = self._caps.get(pair)
        if cap is not None:  # limits lowered (`change_limits`): until the book fits them
            try:
                book.check(self.limits[pair])
            except QuotaError:
                g = min(quota.g, cap.g)
                quota = Quota(g, min(g, quota.u, cap.u), min(quota.p, cap.p))
            else:
                del self._caps[pair]
        lowering = self._writing.get(pair)
        if lowering is not None:
            g = min(quota.g, lowering.g)
            quota = Quota(g, min(g, quota.u, lowering.u), min(quota.p, lowering.p))
        aside = self._aside(pair)
        if any(aside):
            g = max(0, quota.g - aside.leases)
            quota = Quota(
                g, min(g, max(0, quota.u - aside.unreserved)), max(0, quota.p - aside.pins)
            )
        if joining is not None and not joining.both:  # nothing of what has not joined yet
            quota = Quota(
                quota.g if joining.leases else 0,
                quota.u if joining.leases else 0,
                quota.p if joining.pins else 0,
            )
        self.ledger.set_quota(pair, quota)

    def _aside(self, pair: Pair) -> QuotaCounts:
        """What of this instance's entry it may not spend (and counts as used): what is on its
        way out (its earmarks in the book, held out use whose earmark is not written yet) and
        what is on its way in (moved here for a shard not taken in yet)."""
        book = self.books[pair].value
        aside = book.earmarked(self.me)
        for shard, counts in self._pending.items():
            held = counts.get(pair)
            if held is not None and (self.me, shard) not in book.handing:
                aside = aside.plus(held)
        for shard, moving in self._incoming.items():
            incoming = moving.get(pair)
            if incoming is not None and (incoming.source, shard) not in book.handing:
                aside = aside.plus(incoming.counts)
        return aside

    def hold_out(self, shard: int, counts: Mapping[Pair, QuotaCounts]) -> None:
        """Before a shard leaves the ledger: its use stays unspendable here (else a grant could
        slip into the gap) until it is earmarked, and then until the book shows the earmark
        taken by the receiver or back (`reclaim`)."""
        held = {pair: c for pair, c in counts.items() if pair in self.limits and any(c)}
        if held:
            self._pending[shard] = held
        for pair in held:
            self._sync(pair)

    async def earmark(self, shard: int) -> None:
        """Write the earmarks of what `hold_out` set aside for `shard` (one CAS per pair)."""
        async with self._lock:
            for pair, counts in list(self._pending.get(shard, {}).items()):

                def mark(book: QuotaBook, c: QuotaCounts = counts) -> tuple[QuotaBook, QuotaCounts]:
                    return book.earmark(self.me, shard, *c), c

                if await self._cas(pair, mark):
                    del self._pending[shard][pair]  # the book's earmark stands for it now
                    self._sync(pair)
                # else left held out (never spendable) until `reclaim`
            if not self._pending.get(shard, True):
                del self._pending[shard]

    async def reclaim(self, shard: int) -> None:
        """Take back what is still earmarked for `shard` (its receiver did not take it, and is
        no longer expected to); whatever it took is gone from the book already."""

        def unmark(book: QuotaBook) -> tuple[QuotaBook, bool] | None:
            if (self.me, shard) not in book.handing:
                return None
            return book.unmark(self.me, shard), True

        async with self._lock:
            self._pending.pop(shard, None)
            for pair in list(self.books):
                await self._cas(pair, unmark)
                self._sync(pair)
        self.wake()

    async def _cas(
        self, pair: Pair, change: Callable[[QuotaBook], tuple[QuotaBook, Any] | None]
    ) -> Any:
        """Apply `change` to the pair's book by CAS, re-reading on a conflict; returns what
        `change` returned beside the new book, or None if it declined (or every try lost)."""
        from llmgw.state.store import Stored

        for _ in range(_MAX_CAS):
            stored = self.books.get(pair)
            if stored is None:
                return None  # no longer kept
            changed = change(stored.value)
            if changed is None:
                return None
            revision = await self.store.write_quota_book(changed[0], stored.revision)
            if revision is not None:
                self.books[pair] = Stored(changed[0], revision)
                return changed[1]
            self.conflicts += 1
            self.books[pair] = await self.store.quota_book(*pair)
            self._sync(pair)
        return None

    def forget_handovers(self) -> None:
        """Joined again under a new id: the old id's earmarks are its receivers' to take."""
        self._pending.clear()

    async def _follow(self) -> None:
        from llmgw.state.store import Stored

        while not self._closed:
            try:
                async for entry in self.store.watch(QUOTA_PREFIX):
                    pair = self._by_key.get(entry.key)
                    if pair is None or entry.deleted or pair not in self.books:
                        continue
                    if entry.revision <= self.books[pair].revision:
                        continue
                    try:
                        book = QuotaBook.from_json(entry.value)
                    except QuotaError:
                        continue
                    self.books[pair] = Stored(book, entry.revision)
                    self._sync(pair)
                    self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("quota watch ended; retrying in 1 s", exc_info=True)
                await asyncio.sleep(1.0)

    async def _loop(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                await self.adjust()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("quota adjustment failed", exc_info=True)

    # ---- the policy ---------------------------------------------------------------------------

    def desired(self, pair: Pair, book: QuotaBook, stopping: bool = False) -> Quota:
        """Where this instance's entry should go now (pure given the book, use and members)."""
        limits = self.limits[pair]
        got = self._borrowing.get(pair, NO_COUNTS)  # room a loan got for its waiters
        use = self.ledger.pair_use(pair).counts.plus(self._aside(pair)).plus(got)
        live = sorted(self.membership.live())
        members = max(1, len(live))
        total = limits.max_global_in_flight_request_slots
        reserved = min(limits.global_in_flight_request_slots_reserved_for_pinned_sessions, total)
        pins = limits.max_pinned_sessions
        if stopping:
            wg, wu, wp = use.leases, use.unreserved, use.pins
        else:
            wg = min(total, use.leases + headroom(total, members))
            wu = min(total - reserved, use.unreserved + headroom(total - reserved, members))
            wp = min(pins, use.pins + headroom(pins, members))
        mine = book.quota(self.me)
        stated = book.with_quota(self.me, Quota(mine.g, mine.u, mine.p, wg, wu, wp, mine.at))
        target = fair_targets(stated, limits, live)[self.me]
        if stopping:
            target = Quota(use.leases, use.unreserved, use.pins)
        free_g, free_u, free_p = book.free(limits)
        g = _toward(mine.g, target.g, floor=use.leases, free=free_g)
        u = min(g, _toward(mine.u, target.u, floor=use.unreserved, free=free_u))
        p = _toward(mine.p, target.p, floor=use.pins, free=free_p)
        return Quota(g, u, p, wg, wu, wp, mine.at)

    async def adjust(self, *, stopping: bool = False) -> None:
        async with self._lock:
            for pair in list(self.limits):  # track() may add pairs meanwhile
                await self._adjust(pair, stopping)
        for pair in list(self._joining):  # a member that left may be all it waited for
            if pair not in self._joins:
                if pair in self.books:
                    self._sync(pair)
                else:  # its first read failed
                    self._joins[pair] = asyncio.create_task(self._join(pair), name="quota-join")
            self._say_if_slow(pair)

    def _say_if_slow(self, pair: Pair) -> None:
        """Log once when a pair given limits waits long to join (an instance that does not
        apply the config, or pins above P that are not idle): nothing is granted there."""
        since = self._joining_since.get(pair)
        if pair not in self._joining or since is None:
            self._joining_since.pop(pair, None)
            return
        if self._monotonic() - since < _SLOW_JOIN:
            return
        del self._joining_since[pair]
        stored = self.books.get(pair)
        holders = set(stored.value.holders) if stored is not None else set()
        missing = sorted(set(self.membership.live()) - holders)
        log.warning(
            "the quota book of %s/%s has not joined after %.0f s (%s): nothing is granted on "
            "it until every live instance wrote its entry and the entries fit its limits",
            *pair,
            _SLOW_JOIN,
            f"no entry yet from {', '.join(missing)}" if missing else "its entries exceed them",
        )

    async def _adjust(self, pair: Pair, stopping: bool) -> None:
        for _ in range(_MAX_CAS):
            stored = self.books.get(pair)
            if stored is None or pair not in self.limits:
                return  # released meanwhile, or its book not read yet (`keep`)
            book = stored.value
            mine = book.quota(self.me)
            if pair in self._joining:
                if pair not in self._entered:  # what runs here, whatever the book held
                    use = self.ledger.pair_use(pair)
                    entry = first_entry(use.leases, use.unreserved, use.pins, self._clock())
                    if await self._write_own(pair, stored, book.with_quota(self.me, entry)):
                        self._entered.add(pair)
                        return
                    continue
                joining = self._joining[pair]
                if not joining.pins:
                    self._evict_excess(pair, book)
                # only given back, of what has not joined yet
                want = _held(self.desired(pair, book, stopping), mine, joining)
            else:
                want = self.desired(pair, book, stopping)
            changed = (want.g, want.u, want.p) != (mine.g, mine.u, mine.p)
            limits = self.limits[pair]
            slack = max(1, headroom(limits.max_global_in_flight_request_slots, 1) // 2)
            stale_wants = (
                abs(want.wg - mine.wg) > slack
                or abs(want.wp - mine.wp) > max(1, headroom(limits.max_pinned_sessions, 1) // 2)
                or (self.me not in book.holders)
            )
            if not changed and not stale_wants:
                return
            entry = Quota(want.g, want.u, want.p, want.wg, want.wu, want.wp, self._clock())
            new_book = book.with_quota(self.me, entry)
            try:
                new_book.check(limits)
            except QuotaError:
                # A limit lowered under what is held (an API key's, pins held while a pair had
                # no limits): giving back is still safe, and so is raising a count that fits.
                entry = _held(entry, mine, fits(new_book, limits))
                new_book = book.with_quota(self.me, entry)
            if await self._write_own(pair, stored, new_book) is not None:
                return

    async def _write_own(
        self, pair: Pair, stored: Stored[QuotaBook], book: QuotaBook
    ) -> int | None:
        """Write `book`, which changes this instance's own entry, over `stored` (under the
        keeper's lock). A lower entry takes effect here before the write (nothing is granted
        into the part given back or lent while the write is in flight); a higher one only once
        it has landed. Returns the new revision, or None after a conflict (the book read
        again)."""
        from llmgw.state.store import Stored

        self._writing[pair] = book.quota(self.me)
        self._sync(pair)
        try:
            revision = await self.store.write_quota_book(book, stored.revision)
        finally:
            del self._writing[pair]
        if revision is not None:
            self.books[pair] = Stored(book, revision)
            self._sync(pair)
            self.writes += 1
            return revision
        self.conflicts += 1
        self.books[pair] = await self.store.quota_book(*pair)
        self._sync(pair)
        return None

    # ---- transfers ----------------------------------------------------------------------------

    async def transfer(
        self,
        source: str,
        target: str,
        counts: Mapping[Pair, QuotaCounts],
        *,
        shard: int,
        plain: bool,
    ) -> dict[Pair, QuotaCounts]:
        """Take `shard`'s quota from `source` to `target`; returns what moved (at most what
        `source` held). The receiver of a shard calls it, in the same step as it takes the
        shard's state in (handover or adoption). Where `source` earmarked the shard, exactly
        the earmark moves. Elsewhere `counts` move only if `plain` (`source` is dead: nobody
        spends its entry); from a live source without an earmark nothing moves (it took the
        earmark back, and spends it), and the receiver takes in what its own quota covers.
        What moves stays set aside for the shard until `take_in`."""

        def take(book: QuotaBook) -> tuple[QuotaBook, QuotaCounts] | None:
            if (source, shard) not in book.handing:
                return None
            return book.take(source, shard, target, self._clock())

        def plain_move(book: QuotaBook, counts: QuotaCounts) -> tuple[QuotaBook, QuotaCounts]:
            g, u, p = counts
            have = book.quota(source)
            step = QuotaCounts(min(g, have.g), min(u, have.u, g), min(p, have.p))
            return book.transfer(source, target, *step, at=self._clock()), step

        moved: dict[Pair, QuotaCounts] = {}
        async with self._lock:
            for pair in list(self.books):
                if pair not in self.limits:
                    continue
                if pair not in counts and (source, shard) not in self.books[pair].value.handing:
                    continue  # nothing of the shard's on it (what the giver earmarked there for
                    # leases that ended meanwhile, it takes back once answered)
                # Rare (handovers and adoptions): read the book, the watch may lag the earmark.
                fresh = await self.store.quota_book(*pair)
                if fresh.revision > self.books[pair].revision:
                    self.books[pair] = fresh
                # Set aside for the shard from the moment the book may show it here (the
                # watch can deliver the new book before the write's answer) until `take_in`.
                step = None
                mark = self.books[pair].value.handing.get((source, shard))
                incoming = self._incoming.setdefault(shard, {})
                if mark is not None:
                    incoming[pair] = _Incoming(mark.counts, source)
                    step = await self._cas(pair, take)  # None: taken back meanwhile
                elif plain and pair in counts:
                    incoming[pair] = _Incoming(counts[pair])
                    step = await self._cas(pair, functools.partial(plain_move, counts=counts[pair]))
                if step is not None:
                    moved[pair] = step
                    incoming[pair] = _Incoming(step)
                else:
                    incoming.pop(pair, None)
                self._sync(pair)
        return moved

    def take_in(self, state: ShardState, now: float) -> tuple[list[LeaseRecord], list[PinRecord]]:
        """Add a shard's pins and leases to the ledger (`Ledger.add_shard`) and make the quota
        `transfer` moved in for them spendable, in one step: until then no other request could
        take it (which would leave the shard's own leases without room: refused, their
        requests lost) and the keeper never gives it back. Returns what did not fit."""
        self.end_incoming(state.shard)
        return self.ledger.add_shard(state, now)

    def end_incoming(self, shard: int) -> None:
        """What moved in for `shard` is this instance's to spend from now on: it is taken in
        (`take_in`), or taking it in failed (then called in a ``finally``; a no-op after
        `take_in`), so the quota is never left set aside for nothing."""
        moved = self._incoming.pop(shard, {})
        for pair in moved:
            self._sync(pair)
        if moved:
            self.wake()

    # ---- loans: room for a request that this instance's share cannot take ----------------------

    def spare(self, pair: Pair) -> QuotaCounts | None:
        """How much more of `pair` this instance could at most get on the request path: what
        nobody holds, plus what live peers hold (peers that just lent nothing are left out for
        a moment). None: nothing, or not a kept pair."""
        limits = self.limits.get(pair)
        stored = self.books.get(pair)
        if limits is None or stored is None or pair in self._joining:
            return None
        book = stored.value
        g, u, p = book.free(limits)
        if self.ask_loan is not None:
            now = self._monotonic()
            for peer in self.membership.live():
                if peer == self.me or self._dry.get((pair, peer), 0.0) > now:
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
        limits = self.limits[pair]
        members = max(1, len(self.membership.live()))
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
                self.loans[source] += 1
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
        quota = self.ledger.pair_quota(pair) or Quota()
        use = self.ledger.pair_use(pair)
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
        limits = self.limits[pair]
        slack = self._slack(pair)

        def take_free(book: QuotaBook) -> tuple[QuotaBook, QuotaCounts] | None:
            free_g, free_u, free_p = book.free(limits)
            mine = book.quota(self.me)
            g = max(0, min(free_g, need.leases + slack.leases)) if need.leases else 0
            u = (
                max(0, min(free_u, need.unreserved + slack.unreserved, mine.g + g - mine.u))
                if need.unreserved
                else 0
            )
            p = max(0, min(free_p, need.pins + slack.pins)) if need.pins else 0
            if g == 0 and u == 0 and p == 0:
                return None  # nothing that helps is free
            use = self.ledger.pair_use(pair)
            entry = Quota(
                mine.g + g,
                mine.u + u,
                mine.p + p,
                max(mine.wg, min(limits.max_global_in_flight_request_slots, use.leases + g)),
                max(mine.wu, use.unreserved + u),
                max(mine.wp, min(limits.max_pinned_sessions, use.pins + p)),
                self._clock(),
            )
            return book.with_quota(self.me, entry), QuotaCounts(g, u, p)

        # Raising its own entry needs no lock (only lowering does: `_writing`); a write of the
        # keeper's in flight meanwhile makes one of the two CASes fail and read again.
        got = await self._cas(pair, take_free)
        self._sync(pair)
        left = need
        if got is not None:
            source = "free"
            left = need.less(got)
        if not any(left) or self.ask_loan is None:
            return source
        now = self._monotonic()
        book = self.books[pair].value
        peers = [
            (idle(book.quota(peer), slack), peer)
            for peer in self.membership.live()
            if peer != self.me and self._dry.get((pair, peer), 0.0) <= now
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
        if self.books[pair].revision >= revision:
            return
        fresh = await self.store.quota_book(*pair)
        if fresh.revision > self.books[pair].revision:
            self.books[pair] = fresh
            self._sync(pair)

    async def lend(self, borrower: str, pair: Pair, ask: QuotaCounts) -> tuple[QuotaCounts, int]:
        """A live peer asks for room this instance holds idle: move what it can spare (never
        what it uses or has set aside, `llmgw.core.quota.lendable`) to the peer, in one CAS of
        the book. Lowered here before the write is sent (nothing is granted into what is lent),
        as `adjust` does. Returns what moved and the book's revision (0: nothing moved)."""
        if pair not in self.limits or pair not in self.books or borrower == self.me:
            return NO_COUNTS, 0
        if borrower not in self.membership.live():
            return NO_COUNTS, 0

        try:  # the keeper may be busy with a handover's transfer: then lend nothing
            await asyncio.wait_for(self._lock.acquire(), _LEND_LOCK_WAIT)
        except TimeoutError:
            return NO_COUNTS, 0
        try:
            for _ in range(_MAX_CAS):
                stored = self.books[pair]
                entry = stored.value.quota(self.me)
                spendable = self.ledger.pair_quota(pair) or Quota()
                use = self.ledger.pair_use(pair)
                theirs = stored.value.quota(borrower)
                g, u, p = lendable(entry, spendable, use.counts, ask, theirs)
                if (
                    p < ask.pins
                    and self.evict_idle is not None
                    and self.evict_idle(pair, ask.pins - p)
                ):
                    use = self.ledger.pair_use(pair)  # fewer pins held now: lend what they had
                    g, u, p = lendable(entry, spendable, use.counts, ask, theirs)
                if g == 0 and u == 0 and p == 0:
                    return NO_COUNTS, 0
                book = stored.value.lend(self.me, borrower, g, u, p, at=self._clock())
                revision = await self._write_own(pair, stored, book)
                if revision is not None:
                    self.lent += 1
                    self.wake()
                    return QuotaCounts(g, u, p), revision
        finally:
            self._lock.release()
        return NO_COUNTS, 0

    async def leave(self) -> None:
        """Stopping: give back everything not in use (the entry stays if something is)."""
        with contextlib.suppress(Exception):
            await self.adjust(stopping=True)


@dataclass(slots=True)
class _Round(Generic[T]):
    """One borrowing round of a pair: what its requests need together, and how to place each
    (`QuotaKeeper.borrow`)."""

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


@dataclass(frozen=True, slots=True)
class _Incoming:
    """Quota moving in for a shard; ``source``: the giver whose earmark is being taken."""

    counts: QuotaCounts
    source: str | None = None


def _held(want: Quota, mine: Quota, fit: Fits) -> Quota:
    """`want`, but no count raised above `mine` where `fit` says it does not fit (yet)."""
    g = want.g if fit.leases else min(want.g, mine.g)
    u = want.u if fit.leases else min(want.u, mine.u)
    p = want.p if fit.pins else min(want.p, mine.p)
    return Quota(g, min(g, u), p, want.wg, want.wu, want.wp, want.at)


def _toward(current: int, target: int, *, floor: int, free: int) -> int:
    """`target`, but never below `floor` (what is in use), and rising only by what is free."""
    wanted = max(target, floor, 0)
    if wanted >= current:
        return current + max(0, min(wanted - current, free))
    return wanted
