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

Adoption and handover move counts between instances in one CAS (`transfer`), made by the
receiver just before it takes the shard's leases and pins in. The giver sets them aside first
(`hold_out`: removed from its ledger, still in its entry, not spendable) until the receiver has
moved them (`settle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.core.apikeys import KeyLimits
from llmgw.core.keys import QUOTA_PREFIX
from llmgw.core.quota import Quota, QuotaBook, QuotaError, fair_targets, headroom
from llmgw.tasks import cancel_and_wait

if TYPE_CHECKING:
    from llmgw.core.ledger import LeaseRecord, Ledger
    from llmgw.core.quota import PairLimits
    from llmgw.services.admission.membership import Membership
    from llmgw.state.store import RoutingStore, Stored

log = logging.getLogger("llmgw.admission.quotas")

Pair = tuple[str, str]
_MAX_CAS = 20


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
        # ledger, not yet out of this instance's book entry. Never spendable meanwhile.
        self._outgoing: dict[Pair, tuple[int, int, int]] = {}
        self._writing: dict[Pair, Quota] = {}  # this instance's entry while its write flies
        self._tracking: dict[Pair, asyncio.Future[None]] = {}  # pairs added at run time
        self.writes = 0
        self.conflicts = 0

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
        await cancel_and_wait(self._tasks)
        self._tasks.clear()

    def wake(self) -> None:
        """Something changed (use, members): adjust soon."""
        self._wake.set()

    def _sync(self, pair: Pair) -> None:
        """Show the ledger this instance's entry of the book, less what is on its way out; while
        a smaller entry is being written, the smaller of the two."""
        quota = self.books[pair].value.quota(self.me)
        lowering = self._writing.get(pair)
        if lowering is not None:
            g = min(quota.g, lowering.g)
            quota = Quota(g, min(g, quota.u, lowering.u), min(quota.p, lowering.p))
        out = self._outgoing.get(pair)
        if out is not None:
            g = max(0, quota.g - out[0])
            quota = Quota(g, min(g, max(0, quota.u - out[1])), max(0, quota.p - out[2]))
        self.ledger.set_quota(pair, quota)

    def hold_out(self, counts: Mapping[Pair, tuple[int, int, int]]) -> None:
        """Before a shard leaves the ledger: its use stays unspendable here until its receiver
        has moved the quota to itself (`settle` then), else a grant could slip into the gap."""
        for pair, (g, u, p) in counts.items():
            if pair not in self.limits:
                continue
            og, ou, op = self._outgoing.get(pair, (0, 0, 0))
            self._outgoing[pair] = (og + g, ou + u, op + p)
            self._sync(pair)

    def settle(self, counts: Mapping[Pair, tuple[int, int, int]]) -> None:
        """What `hold_out` set aside has arrived (the receiver moved its quota) or never will."""
        for pair, (g, u, p) in counts.items():
            og, ou, op = self._outgoing.get(pair, (0, 0, 0))
            left = (max(0, og - g), max(0, ou - u), max(0, op - p))
            if left == (0, 0, 0):
                self._outgoing.pop(pair, None)
            else:
                self._outgoing[pair] = left
            if pair in self.books:
                self._sync(pair)

    async def _follow(self) -> None:
        from llmgw.state.store import Stored

        while not self._closed:
            try:
                async for entry in self.store.watch(QUOTA_PREFIX):
                    pair = self._by_key.get(entry.key)
                    if pair is None or entry.deleted:
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
        use = self.ledger.pair_use(pair)
        og, ou, op = self._outgoing.get(pair, (0, 0, 0))
        use = _Use(use.leases + og, use.unreserved + ou, use.pins + op)
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

    async def _adjust(self, pair: Pair, stopping: bool) -> None:
        for _ in range(_MAX_CAS):
            stored = self.books[pair]
            book = stored.value
            mine = book.quota(self.me)
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
                # A limit lowered under what is held (an API key's): giving back is still safe.
                if entry.g > mine.g or entry.u > mine.u or entry.p > mine.p:
                    raise
            # Lowering takes effect here before the write (nothing granted into the part given
            # back while the write is in flight); raising only once the write has landed.
            self._writing[pair] = entry
            self._sync(pair)
            try:
                revision = await self.store.write_quota_book(new_book, stored.revision)
            finally:
                del self._writing[pair]
            if revision is not None:
                from llmgw.state.store import Stored

                self.books[pair] = Stored(new_book, revision)
                self._sync(pair)
                self.writes += 1
                return
            self.conflicts += 1
            self.books[pair] = await self.store.quota_book(*pair)
            self._sync(pair)

    # ---- transfers ----------------------------------------------------------------------------

    async def transfer(
        self, source: str, target: str, counts: Mapping[Pair, tuple[int, int, int]]
    ) -> dict[Pair, tuple[int, int, int]]:
        """Move (leases, unreserved, pins) of each pair from `source` to `target`; returns what
        moved (at most what `source` held). The receiver of a shard calls it, in the same
        step as it takes the shard's state in (handover or adoption)."""
        moved: dict[Pair, tuple[int, int, int]] = {}
        async with self._lock:
            for pair, (g, u, p) in counts.items():
                if pair not in self.limits:
                    continue
                await self._transfer_one(pair, source, target, (g, u, p), moved)
                self._sync(pair)
        return moved

    async def _transfer_one(
        self,
        pair: Pair,
        source: str,
        target: str,
        counts: tuple[int, int, int],
        moved: dict[Pair, tuple[int, int, int]],
    ) -> None:
        from llmgw.state.store import Stored

        g, u, p = counts
        for _ in range(_MAX_CAS):
            stored = self.books[pair]
            have = stored.value.quota(source)
            step = (min(g, have.g), min(u, have.u, g), min(p, have.p))
            new_book = stored.value.transfer(source, target, *step, at=self._clock())
            revision = await self.store.write_quota_book(new_book, stored.revision)
            if revision is not None:
                self.books[pair] = Stored(new_book, revision)
                moved[pair] = step
                return
            self.conflicts += 1
            self.books[pair] = await self.store.quota_book(*pair)
            self._sync(pair)

    async def leave(self) -> None:
        """Stopping: give back everything not in use (the entry stays if something is)."""
        with contextlib.suppress(Exception):
            await self.adjust(stopping=True)


@dataclass(frozen=True, slots=True)
class _Use:
    leases: int
    unreserved: int
    pins: int


def _toward(current: int, target: int, *, floor: int, free: int) -> int:
    """`target`, but never below `floor` (what is in use), and rising only by what is free."""
    wanted = max(target, floor, 0)
    if wanted >= current:
        return current + max(0, min(wanted - current, free))
    return wanted
