"""Which pairs this instance keeps a quota of, as that changes while it runs.

An API key's pair is kept from the first request or shard that brings it (`QuotaJoins.track`).
An applied config changes which pairs have limits (`change_limits`, `keep`, `release`;
`llmgw.core.pairs`): a pair that starts to have them is granted on from a quota only once its
book holds every live instance's first entry (what runs there) and fits the limits, leases and
pins apart; until then this instance only gives back, and evicts idle pins it holds above its
share. A pair that stops having them is no longer counted at once; this instance's entry leaves
its book.

It changes the keeper's table of limits and caps and reads and writes the books only through
the keeper (`QuotaKeeper.sync`, `write_own`, `adjust_pair`); what the ledger may spend of a
joining pair is the keeper's to show (`QuotaJoins.gate`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from llmgw.core.apikeys import KeyLimits
from llmgw.core.pairs import NOT_JOINED, Fits, first_entry, joined
from llmgw.core.quota import Quota, QuotaBook, scaled_quota

if TYPE_CHECKING:
    from llmgw.core.ledger import LeaseRecord
    from llmgw.core.quota import PairLimits
    from llmgw.services.admission.quotas import QuotaKeeper
    from llmgw.state.store import Stored

log = logging.getLogger("llmgw.admission.quotas")

Pair = tuple[str, str]
_MAX_CAS = 20
_SLOW_JOIN = 10.0  # seconds a pair given limits may take to join before it is logged


class QuotaJoins:
    """The pairs added, changed and removed at run time, and the joining of their books."""

    def __init__(
        self,
        keeper: QuotaKeeper,
        *,
        monotonic: Callable[[], float],
    ) -> None:
        self.keeper = keeper
        # Evicts up to n idle pins of a pair (as a new pin would), returns how many: pins held
        # above a new limit are sessions between requests. Set by the service as it starts.
        self.evict_idle: Callable[[Pair, int], int] | None = None
        self._monotonic = monotonic
        self._tracking: dict[Pair, asyncio.Future[None]] = {}  # pairs added at run time
        # Pairs whose limits an applied config started to be kept (`keep`): no grant until the
        # book has joined (`llmgw.core.pairs.joined`); `_entered`: this instance's first entry
        # is written.
        self._joining: dict[Pair, Fits] = {}  # what of each has joined so far
        self._entered: set[Pair] = set()
        self._joins: dict[Pair, asyncio.Task[None]] = {}
        self._joining_since: dict[Pair, float] = {}  # until it joined or was said to lag

    def joining(self, pair: Pair) -> bool:
        """Whether `pair` has not joined yet: nothing, or not all, is granted on it."""
        return pair in self._joining

    def entered(self, pair: Pair) -> bool:
        """Whether this instance's first entry in a joining pair's book is written."""
        return pair in self._entered

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._joins.values())

    # ---- API keys -----------------------------------------------------------------------------

    async def track(self, pair: Pair, limits: PairLimits) -> None:
        """Keep a quota of `pair` too, from now on (an API key's max_parallel_requests, first
        seen in a request or a shard taken in); a changed limit applies at once. The first call
        for a pair reads its book and takes a first share: the caller waits for that."""
        keeper = self.keeper
        if pair in keeper.limits:
            if keeper.limits[pair] != limits:
                keeper.limits[pair] = limits
                keeper.ledger.limits[pair] = limits
                keeper.wake()
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
        keeper = self.keeper
        try:
            keeper.books[pair] = await keeper.store.quota_book(*pair)
            keeper.follow_book(pair)
            keeper.ledger.limits[pair] = limits
            keeper.limits[pair] = limits
            keeper.sync(pair)
            async with keeper.lock:
                await keeper.adjust_pair(pair, False)
        finally:
            self._tracking.pop(pair, None)

    # ---- an applied config --------------------------------------------------------------------

    def change_limits(self, pair: Pair, limits: PairLimits) -> None:
        """Hold `pair` to new limits from now on (an applied config changed them).

        Raised: the keeper takes its share of the new room at its next adjustment. Lowered:
        this instance stops granting above the new limits at once, before any book write: its
        quota is capped at its share scaled down by the ratio of new to old (floor), so all
        instances' caps together stay within the new limits (their entries summed within the
        old ones). Leases already granted are never revoked: they end as they would. The cap
        goes once the book itself fits the new limits (every instance gave back enough)."""
        keeper = self.keeper
        old = keeper.limits.get(pair)
        if old is None or old == limits:
            return
        if pair in self._joining:  # not granting yet: the new limits are what it joins under
            keeper.limits[pair] = limits
            keeper.ledger.limits[pair] = limits
            keeper.wake()
            return
        keeper.limits[pair] = limits
        keeper.ledger.limits[pair] = limits
        if pair in keeper.books:
            mine = keeper.books[pair].value.quota(keeper.me)
            current = keeper.caps.get(pair, mine)
            cap = scaled_quota(mine, old, limits)
            keeper.caps[pair] = Quota(
                min(cap.g, current.g), min(cap.u, current.u), min(cap.p, current.p)
            )
            keeper.sync(pair)
        keeper.wake()

    def keep(self, pair: Pair, limits: PairLimits) -> None:
        """Keep a quota of `pair` from now on: an applied config added it with limits, or gave
        it limits. No grant on it from this call on until its book has joined
        (`llmgw.core.pairs`): this instance writes what it runs there as its first entry, and
        grants again once every live instance has and the entries fit the limits."""
        keeper = self.keeper
        if pair in keeper.limits:
            self.change_limits(pair, limits)
            return
        keeper.limits[pair] = limits
        keeper.ledger.keep_limits(pair, limits)  # zero quota: nothing granted until joined
        self._joining[pair] = NOT_JOINED
        self._joining_since[pair] = self._monotonic()
        self._entered.discard(pair)
        keeper.caps.pop(pair, None)
        if pair not in self._joins:
            self._joins[pair] = asyncio.create_task(self._join(pair), name="quota-join")

    async def _join(self, pair: Pair) -> None:
        keeper = self.keeper
        try:
            stored = await keeper.store.quota_book(*pair)
            if pair not in keeper.limits:
                return  # released meanwhile
            if pair not in keeper.books or stored.revision > keeper.books[pair].revision:
                keeper.books[pair] = stored
            keeper.follow_book(pair)
            async with keeper.lock:
                await keeper.adjust_pair(pair, False)
            keeper.sync(pair)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("joining the quota book of %s failed; retried", pair, exc_info=True)
        finally:
            self._joins.pop(pair, None)
        keeper.wake()

    def release(self, pair: Pair) -> None:
        """Stop keeping a quota of `pair`: an applied config removed it, or its limits. Its
        leases stop counting against limits here at once (they end as they would); this
        instance's entry leaves the book soon after (a later `keep` starts from a clean one)."""
        keeper = self.keeper
        if keeper.limits.pop(pair, None) is None:
            return
        self._joining.pop(pair, None)
        self._joining_since.pop(pair, None)
        self._entered.discard(pair)
        keeper.caps.pop(pair, None)
        keeper.books.pop(pair, None)
        keeper.unfollow_book(pair)
        keeper.ledger.drop_limits(pair)
        keeper.spawn(self._leave(pair), "quota-leave")

    async def _leave(self, pair: Pair) -> None:
        """Drop this instance's entry from a book it no longer keeps (by CAS)."""
        keeper = self.keeper
        for _ in range(_MAX_CAS):
            if pair in keeper.limits or keeper.closed:
                return  # kept again meanwhile: its own first entry replaces the old one
            try:
                stored = await keeper.store.quota_book(*pair)
                if keeper.me not in stored.value.holders:
                    return
                book = stored.value.drop(keeper.me)
                if await keeper.store.write_quota_book(book, stored.revision) is not None:
                    return
            except Exception:
                log.warning("leaving the quota book of %s failed", pair, exc_info=True)
                return

    # ---- joining, as the keeper syncs and adjusts -----------------------------------------------

    def gate(self, pair: Pair, book: QuotaBook) -> Fits | None:
        """What of a joining pair whose first entry is written has joined, as `book` shows it
        now (None: not joining, or joined with this book)."""
        joining = self._joining.get(pair)
        if joining is None:
            return None
        keeper = self.keeper
        now = joining.join(joined(book, keeper.limits[pair], keeper.membership.live()))
        if now != joining:
            log.info("the quota book of %s/%s joined: %s", *pair, now)
            keeper.wake()
        self._joining[pair] = now
        if now.both:
            del self._joining[pair]
            return None
        return now

    async def enter(self, pair: Pair, stored: Stored[QuotaBook]) -> bool | None:
        """This instance's first entry in a joining pair's book, if not written yet: what runs
        here, whatever the book held. None: written already (adjust as usual, `want`); else
        whether the write landed."""
        if pair in self._entered:
            return None
        keeper = self.keeper
        use = keeper.ledger.pair_use(pair)
        entry = first_entry(use.leases, use.unreserved, use.pins, keeper.clock())
        if await keeper.write_own(pair, stored, stored.value.with_quota(keeper.me, entry)):
            self._entered.add(pair)
            return True
        return False

    def want(self, pair: Pair, book: QuotaBook, desired: Callable[[], Quota]) -> Quota:
        """Where this instance's entry of a joining pair should go: pins held above its limit
        evicted where idle first, then `desired` only given back, of what has not joined."""
        joining = self._joining[pair]
        if not joining.pins:
            self._evict_excess(pair, book)
        return held(desired(), book.quota(self.keeper.me), joining)

    def _evict_excess(self, pair: Pair, book: QuotaBook) -> None:
        """Pins held above P (taken while the pair had no limits): evict idle ones here, down
        to this instance's even share of P at most, so that the pins join (they are sessions
        between requests; the next request of each pins again)."""
        keeper = self.keeper
        limits = keeper.limits[pair]
        excess = book.totals().pins - limits.max_pinned_sessions
        if excess <= 0 or self.evict_idle is None:
            return
        share = limits.max_pinned_sessions // max(1, len(keeper.membership.live()))
        over = keeper.ledger.pair_use(pair).pins - share
        if over > 0:
            self.evict_idle(pair, min(excess, over))

    def after_adjust(self) -> None:
        """After an adjustment: a member that left may be all a joining pair waited for; a pair
        whose first read failed is read again; one that waits long is logged once."""
        keeper = self.keeper
        for pair in list(self._joining):
            if pair not in self._joins:
                if pair in keeper.books:
                    keeper.sync(pair)
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
        stored = self.keeper.books.get(pair)
        holders = set(stored.value.holders) if stored is not None else set()
        missing = sorted(set(self.keeper.membership.live()) - holders)
        log.warning(
            "the quota book of %s/%s has not joined after %.0f s (%s): nothing is granted on "
            "it until every live instance wrote its entry and the entries fit its limits",
            *pair,
            _SLOW_JOIN,
            f"no entry yet from {', '.join(missing)}" if missing else "its entries exceed them",
        )


def held(want: Quota, mine: Quota, fit: Fits) -> Quota:
    """`want`, but no count raised above `mine` where `fit` says it does not fit (yet)."""
    g = want.g if fit.leases else min(want.g, mine.g)
    u = want.u if fit.leases else min(want.u, mine.u)
    p = want.p if fit.pins else min(want.p, mine.p)
    return Quota(g, min(g, u), p, want.wg, want.wu, want.wp, want.at)
