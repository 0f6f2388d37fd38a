"""Provider/model pairs that an applied config adds, removes, limits or frees, and when an
instance may grant on a pair whose limits it has just started to keep (ADR 0005, "A pair added
or removed").

A pair's limits start being kept when an applied config adds it with limits or gives limits to
a pair that had none. Requests may already run on it then (granted while it had none, at any
instance), so its quota book must learn them before anyone grants from it:

1. each instance, on the change, stops granting on the pair at once (its quota is zero) and
   writes its *first entry*: exactly what it runs there (`first_entry`), above the limits if
   that is what runs;
2. it grants again only once the book has *joined* (`joined`): every live instance holds an
   entry, and the entries fit the limits; leases and pins join apart (`Fits`): pins held on
   the pair while it had none may stay above P long after its leases fit.

Entries never drop below use (the quota keeper's rule), so once the book has joined the
requests running at every live instance, old and new, sum within the limits: no grant takes
the pair above them, whichever instance applied the change first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from llmgw.core.quota import PairLimits, Quota, QuotaBook

__all__ = ["NOT_JOINED", "Fits", "PairChanges", "first_entry", "fits", "joined", "pair_changes"]

Pair = tuple[str, str]  # (provider, model)
L = TypeVar("L")


@dataclass(frozen=True, slots=True)
class PairChanges(Generic[L]):
    """What a new pair table changes against the running one. Every pair of either table is
    in at most one of `kept`, `released` and `changed`; the others keep what they had."""

    kept: Mapping[Pair, L]  # limits kept from now on: added with limits, or limits gained
    released: frozenset[Pair]  # limits no longer kept: removed, or limits lost
    changed: Mapping[Pair, L]  # limits before and after, other ones
    added: frozenset[Pair]  # new pairs (with limits or not)
    removed: frozenset[Pair]  # pairs gone (with limits or not)


def pair_changes(old: Mapping[Pair, L | None], new: Mapping[Pair, L | None]) -> PairChanges[L]:
    """Compare two pair tables ((provider, model) -> limits, None: no limits)."""
    kept: dict[Pair, L] = {}
    changed: dict[Pair, L] = {}
    for pair, limits in new.items():
        before = old.get(pair)
        if limits is None:
            continue
        if before is None:
            kept[pair] = limits
        elif before != limits:
            changed[pair] = limits
    released = frozenset(p for p, lim in old.items() if lim is not None and new.get(p) is None)
    return PairChanges(
        kept,
        released,
        changed,
        frozenset(p for p in new if p not in old),
        frozenset(p for p in old if p not in new),
    )


def first_entry(leases: int, unreserved: int, pins: int, at: float) -> Quota:
    """An instance's first entry in the book of a pair whose limits it starts to keep: what it
    runs there (its leases, of which unreserved: new-pin and temporary ones; its pins), and
    what it asks for no more than that."""
    return Quota(leases, unreserved, pins, leases, unreserved, pins, at)


class Fits(NamedTuple):
    """Which counts of a quota book are within their limits: leases (Σg <= G and
    Σu <= G - R) and pins (Σp <= P). The two are independent: a grant of a lease never needs
    pin quota beyond what a pin's own check asks."""

    leases: bool
    pins: bool

    @property
    def both(self) -> bool:
        return self.leases and self.pins

    def join(self, other: Fits) -> Fits:
        return Fits(self.leases or other.leases, self.pins or other.pins)


NOT_JOINED = Fits(False, False)


def fits(book: QuotaBook, limits: PairLimits) -> Fits:
    """Which of the book's counts are within `limits`."""
    g, u, p = book.totals()
    total = limits.max_global_in_flight_request_slots
    reserved = min(limits.global_in_flight_request_slots_reserved_for_pinned_sessions, total)
    return Fits(g <= total and u <= total - reserved, p <= limits.max_pinned_sessions)


def joined(book: QuotaBook, limits: PairLimits, live: Iterable[str]) -> Fits:
    """Which counts instances may grant from again after `book` started to be kept: none until
    every `live` instance holds an entry (wrote its first one); then each count whose entries
    fit `limits` (pins held on the pair while it had no limits may keep its pins over P long
    after its leases fit)."""
    if not set(live) <= set(book.holders):
        return NOT_JOINED
    return fits(book, limits)
