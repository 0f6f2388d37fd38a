"""The quota of a shard on the move between instances: held out, earmarked, moved, taken in.

A handover's giver sets the shard's use aside first (`Earmarks.hold_out`: removed from its
ledger, still in its entry, not spendable), then earmarks it in the book (`earmark`); the
receiver moves exactly the earmark (`transfer`), or the giver takes it back (`reclaim`) when it
no longer expects the receiver to. Which of the two happened is whatever the book says, so no
timing makes the same count spendable at both; the giver spends an earmark again only once its
book shows it is back (`llmgw.core.quota.QuotaBook.take`). At the receiver, what `transfer`
moves in is set aside for the shard (unspendable, never given back) until `take_in` adds the
shard's leases and pins to the ledger in the same step as it makes that quota spendable: the
receiver goes on deciding its own shards meanwhile (a transfer of several pairs awaits the
store between them), and a grant into that quota would leave the handed leases without room
(refused: their requests lost in a graceful handover).

The counts on the move are the shard's record's (`Shard.pending`, `Shard.incoming`); this room
keeps the records whose counts are on the move until they are settled, though a record may
have left the shard keeper by then (an earmark whose CAS failed stays held out until
`reclaim`). It writes the books only through the keeper (`QuotaKeeper.cas`, under its lock)
and touches nothing of the ledger but `take_in`'s `Ledger.add_shard`.

The sequences that call these operations, step by step, are `Handovers`' (``shards.py``; the
lifecycle: docs/adr/0002-admission-at-memory-speed.md, "Shard lifecycle").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.core.quota import QuotaBook, QuotaCounts

if TYPE_CHECKING:
    from llmgw.core.ledger import LeaseRecord, PinRecord, ShardState
    from llmgw.services.admission.quotas import QuotaKeeper
    from llmgw.services.admission.shards import Shard

Pair = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Incoming:
    """Quota moving in for a shard; ``source``: the giver whose earmark is being taken."""

    counts: QuotaCounts
    source: str | None = None


class Earmarks:
    """The handover operations on the quota books, and what of them is set aside."""

    def __init__(self, keeper: QuotaKeeper) -> None:
        self.keeper = keeper
        # Records whose quota is on the move (`pending` or `incoming` not empty), by identity.
        self._moving: set[Shard] = set()

    def aside(self, pair: Pair) -> QuotaCounts:
        """What of this instance's entry it may not spend (and counts as used): what is on its
        way out (its earmarks in the book, held out use whose earmark is not written yet) and
        what is on its way in (moved here for a shard not taken in yet)."""
        me = self.keeper.me
        book = self.keeper.books[pair].value
        aside = book.earmarked(me)
        for record in self._moving:
            held = record.pending.get(pair)
            if held is not None and (me, record.number) not in book.handing:
                aside = aside.plus(held)
            incoming = record.incoming.get(pair)
            if incoming is not None and (incoming.source, record.number) not in book.handing:
                aside = aside.plus(incoming.counts)
        return aside

    def _settled(self, record: Shard) -> None:
        if not record.pending and not record.incoming:
            self._moving.discard(record)

    # ---- the giver ----------------------------------------------------------------------------

    def hold_out(self, record: Shard, counts: Mapping[Pair, QuotaCounts]) -> None:
        """Before a shard leaves the ledger: its use stays unspendable here (else a grant could
        slip into the gap) until it is earmarked, and then until the book shows the earmark
        taken by the receiver or back (`reclaim`)."""
        keeper = self.keeper
        held = {pair: c for pair, c in counts.items() if pair in keeper.limits and any(c)}
        if held:
            record.pending = held
            self._moving.add(record)
        for pair in held:
            keeper.sync(pair)

    async def earmark(self, record: Shard) -> None:
        """Write the earmarks of what `hold_out` set aside for the shard (one CAS per pair)."""
        keeper = self.keeper
        me, shard = keeper.me, record.number
        async with keeper.lock:
            for pair, counts in list(record.pending.items()):

                def mark(book: QuotaBook, c: QuotaCounts = counts) -> tuple[QuotaBook, QuotaCounts]:
                    return book.earmark(me, shard, *c), c

                if await keeper.cas(pair, mark):
                    del record.pending[pair]  # the book's earmark stands for it now
                    keeper.sync(pair)
                # else left held out (never spendable) until `reclaim`
            self._settled(record)

    async def reclaim(self, record: Shard) -> None:
        """Take back what is still earmarked for the shard (its receiver did not take it, and
        is no longer expected to); whatever it took is gone from the book already."""
        keeper = self.keeper
        me, shard = keeper.me, record.number

        def unmark(book: QuotaBook) -> tuple[QuotaBook, bool] | None:
            if (me, shard) not in book.handing:
                return None
            return book.unmark(me, shard), True

        async with keeper.lock:
            record.pending = {}
            self._settled(record)
            for pair in list(keeper.books):
                await keeper.cas(pair, unmark)
                keeper.sync(pair)
        keeper.wake()

    def forget(self) -> None:
        """Joined again under a new id: the old id's earmarks are its receivers' to take."""
        for record in list(self._moving):
            record.pending = {}
            self._settled(record)

    # ---- the receiver -------------------------------------------------------------------------

    async def transfer(
        self,
        source: str,
        target: str,
        counts: Mapping[Pair, QuotaCounts],
        *,
        record: Shard,
        plain: bool,
    ) -> dict[Pair, QuotaCounts]:
        """Take the shard's quota from `source` to `target`; returns what moved (at most what
        `source` held). The receiver of a shard calls it, in the same step as it takes the
        shard's state in (handover or adoption). Where `source` earmarked the shard, exactly
        the earmark moves. Elsewhere `counts` move only if `plain` (`source` is dead: nobody
        spends its entry); from a live source without an earmark nothing moves (it took the
        earmark back, and spends it), and the receiver takes in what its own quota covers.
        What moves stays set aside for the shard until `take_in`."""
        keeper = self.keeper
        shard = record.number

        def take(book: QuotaBook) -> tuple[QuotaBook, QuotaCounts] | None:
            if (source, shard) not in book.handing:
                return None
            return book.take(source, shard, target, keeper.clock())

        def plain_move(book: QuotaBook, counts: QuotaCounts) -> tuple[QuotaBook, QuotaCounts]:
            have = book.quota(source)
            step = QuotaCounts(
                min(counts.leases, have.g),
                min(counts.unreserved, have.u, counts.leases),
                min(counts.pins, have.p),
            )
            return book.transfer(source, target, *step, at=keeper.clock()), step

        moved: dict[Pair, QuotaCounts] = {}
        async with keeper.lock:
            for pair in list(keeper.books):
                if pair not in keeper.limits:
                    continue
                if pair not in counts and (source, shard) not in keeper.books[pair].value.handing:
                    continue  # nothing of the shard's on it (what the giver earmarked there for
                    # leases that ended meanwhile, it takes back once answered)
                # Rare (handovers and adoptions): read the book, the watch may lag the earmark.
                fresh = await keeper.store.quota_book(*pair)
                if fresh.revision > keeper.books[pair].revision:
                    keeper.books[pair] = fresh
                # Set aside for the shard from the moment the book may show it here (the
                # watch can deliver the new book before the write's answer) until `take_in`.
                step = None
                mark = keeper.books[pair].value.handing.get((source, shard))
                self._moving.add(record)
                if mark is not None:
                    record.incoming[pair] = Incoming(mark.counts, source)
                    step = await keeper.cas(pair, take)  # None: taken back meanwhile
                elif plain and pair in counts:
                    record.incoming[pair] = Incoming(counts[pair])
                    step = await keeper.cas(
                        pair, functools.partial(plain_move, counts=counts[pair])
                    )
                if step is not None:
                    moved[pair] = step
                    record.incoming[pair] = Incoming(step)
                else:
                    record.incoming.pop(pair, None)
                self._settled(record)
                keeper.sync(pair)
        return moved

    def take_in(
        self, record: Shard, state: ShardState, now: float
    ) -> tuple[list[LeaseRecord], list[PinRecord]]:
        """Add a shard's pins and leases to the ledger (`Ledger.add_shard`) and make the quota
        `transfer` moved in for them spendable, in one step: until then no other request could
        take it (which would leave the shard's own leases without room: refused, their
        requests lost) and the keeper never gives it back. Returns what did not fit."""
        self.end_incoming(record)
        return self.keeper.ledger.add_shard(state, now)

    def end_incoming(self, record: Shard) -> None:
        """What moved in for the shard is this instance's to spend from now on: it is taken in
        (`take_in`), or taking it in failed (then called in a ``finally``; a no-op after
        `take_in`), so the quota is never left set aside for nothing."""
        moved, record.incoming = record.incoming, {}
        self._settled(record)
        for pair in moved:
            self.keeper.sync(pair)
        if moved:
            self.keeper.wake()
