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

The keeper is the book sync; three parts, each in a module of its own, work on the books
through it (`cas`, `write_own`, `sync`, under its `lock`):

- `QuotaJoins` (``joins.py``): the pairs kept, as API keys and applied configs add, change and
  remove them, and a new pair's book joining before anything is granted on it;
- `Earmarks` (``earmarks.py``): a shard's quota on the move in a handover or adoption (held
  out, earmarked, moved, taken in), kept on the shard's record;
- `Loans` (``loans.py``): room borrowed for a request this instance's share cannot take, and
  its idle quota lent to peers.

What of the entry may not be spent (`Earmarks.aside`) and what a loan got for its waiters
(`Loans.borrowing`) count as used when the keeper moves its entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from llmgw.core.keys import QUOTA_PREFIX, quota_key
from llmgw.core.pairs import fits
from llmgw.core.quota import (
    NO_QUOTA,
    Quota,
    QuotaBook,
    QuotaError,
    fair_targets,
    headroom,
)
from llmgw.services.admission.earmarks import Earmarks
from llmgw.services.admission.joins import QuotaJoins, held
from llmgw.services.admission.loans import Loans
from llmgw.tasks import cancel_and_wait

if TYPE_CHECKING:
    from llmgw.core.apikeys import KeyLimits
    from llmgw.core.ledger import Ledger
    from llmgw.core.quota import PairLimits
    from llmgw.services.admission.membership import Membership
    from llmgw.state.store import RoutingStore, Stored

log = logging.getLogger("llmgw.admission.quotas")

Pair = tuple[str, str]
_MAX_CAS = 20


class QuotaKeeper:
    """This instance's entry in every kept pair's book, and what the ledger may spend of it."""

    def __init__(
        self,
        store: RoutingStore,
        ledger: Ledger,
        membership: Membership,
        limits: Mapping[Pair, PairLimits | None],
        *,
        interval: float,
        clock: Callable[[], float],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.membership = membership
        self.limits = {pair: lim for pair, lim in limits.items() if lim is not None}
        self.interval = interval
        self.clock = clock
        self.books: dict[Pair, Stored[QuotaBook]] = {}
        self._by_key: dict[str, Pair] = {}
        self._wake = asyncio.Event()
        self.lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._writing: dict[Pair, Quota] = {}  # this instance's entry while its write flies
        self.caps: dict[Pair, Quota] = {}  # limits lowered: the most it grants until the book fits
        self.writes = 0
        self.conflicts = 0
        self.joins = QuotaJoins(self, monotonic=monotonic)
        self.earmarks = Earmarks(self)
        self.loans = Loans(self, monotonic=monotonic)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def me(self) -> str:
        return self.membership.instance

    async def start(self) -> None:
        for pair in self.limits:
            self.follow_book(pair)
            self.books[pair] = await self.store.quota_book(*pair)
            self.sync(pair)
        await self.adjust()
        self._tasks.append(asyncio.create_task(self._follow(), name="quota-watch"))
        self._tasks.append(asyncio.create_task(self._loop(), name="quota-keeper"))

    async def stop(self) -> None:
        self._closed = True
        await cancel_and_wait([*self._tasks, *self.joins.tasks()])
        self._tasks.clear()

    def follow_book(self, pair: Pair) -> None:
        """Follow `pair`'s book in the watch from now on."""
        self._by_key[quota_key(*pair)] = pair

    def unfollow_book(self, pair: Pair) -> None:
        self._by_key.pop(quota_key(*pair), None)

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """A task of the keeper's, cancelled when it stops."""
        self._tasks.append(asyncio.create_task(work, name=name))

    async def track(self, pair: Pair, limits: KeyLimits) -> None:
        """Keep a quota of an API key's pair too (`QuotaJoins.track`)."""
        await self.joins.track(pair, limits)

    def wake(self) -> None:
        """Something changed (use, members): adjust soon."""
        self._wake.set()

    def sync(self, pair: Pair) -> None:
        """Show the ledger this instance's entry of the book, less what is on its way out; while
        a smaller entry is being written, the smaller of the two. Nothing while a pair whose
        limits started to be kept has not joined (`keep`)."""
        stored = self.books.get(pair)
        if stored is None:
            return
        book = stored.value
        if self.joins.joining(pair) and not self.joins.entered(pair):
            self.ledger.set_quota(pair, NO_QUOTA)  # nothing until its first entry is written
            return
        joining = self.joins.gate(pair, book)
        quota = book.quota(self.me)
        cap = self.caps.get(pair)
        if cap is not None:  # limits lowered (`change_limits`): until the book fits them
            try:
                book.check(self.limits[pair])
            except QuotaError:
                g = min(quota.g, cap.g)
                quota = Quota(g, min(g, quota.u, cap.u), min(quota.p, cap.p))
            else:
                del self.caps[pair]
        lowering = self._writing.get(pair)
        if lowering is not None:
            g = min(quota.g, lowering.g)
            quota = Quota(g, min(g, quota.u, lowering.u), min(quota.p, lowering.p))
        aside = self.earmarks.aside(pair)
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

    async def cas(
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
            self.sync(pair)
        return None

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
                    self.sync(pair)
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
        got = self.loans.borrowing(pair)  # room a loan got for its waiters
        use = self.ledger.pair_use(pair).counts.plus(self.earmarks.aside(pair)).plus(got)
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
        async with self.lock:
            for pair in list(self.limits):  # track() may add pairs meanwhile
                await self.adjust_pair(pair, stopping)
        self.joins.after_adjust()

    async def adjust_pair(self, pair: Pair, stopping: bool) -> None:
        for _ in range(_MAX_CAS):
            stored = self.books.get(pair)
            if stored is None or pair not in self.limits:
                return  # released meanwhile, or its book not read yet (`keep`)
            book = stored.value
            mine = book.quota(self.me)
            if self.joins.joining(pair):
                entered = await self.joins.enter(pair, stored)  # what runs here, at first
                if entered is not None:
                    if entered:
                        return
                    continue
                want = self.joins.want(
                    pair, book, functools.partial(self.desired, pair, book, stopping)
                )
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
            entry = Quota(want.g, want.u, want.p, want.wg, want.wu, want.wp, self.clock())
            new_book = book.with_quota(self.me, entry)
            try:
                new_book.check(limits)
            except QuotaError:
                # A limit lowered under what is held (an API key's, pins held while a pair had
                # no limits): giving back is still safe, and so is raising a count that fits.
                entry = held(entry, mine, fits(new_book, limits))
                new_book = book.with_quota(self.me, entry)
            if await self.write_own(pair, stored, new_book) is not None:
                return

    async def write_own(self, pair: Pair, stored: Stored[QuotaBook], book: QuotaBook) -> int | None:
        """Write `book`, which changes this instance's own entry, over `stored` (under the
        keeper's lock). A lower entry takes effect here before the write (nothing is granted
        into the part given back or lent while the write is in flight); a higher one only once
        it has landed. Returns the new revision, or None after a conflict (the book read
        again)."""
        from llmgw.state.store import Stored

        self._writing[pair] = book.quota(self.me)
        self.sync(pair)
        try:
            revision = await self.store.write_quota_book(book, stored.revision)
        finally:
            del self._writing[pair]
        if revision is not None:
            self.books[pair] = Stored(book, revision)
            self.sync(pair)
            self.writes += 1
            return revision
        self.conflicts += 1
        self.books[pair] = await self.store.quota_book(*pair)
        self.sync(pair)
        return None

    async def leave(self) -> None:
        """Stopping: give back everything not in use (the entry stays if something is)."""
        with contextlib.suppress(Exception):
            await self.adjust(stopping=True)


def _toward(current: int, target: int, *, floor: int, free: int) -> int:
    """`target`, but never below `floor` (what is in use), and rising only by what is free."""
    wanted = max(target, floor, 0)
    if wanted >= current:
        return current + max(0, min(wanted - current, free))
    return wanted
