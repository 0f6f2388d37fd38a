"""Capacity quotas: how a provider/model pair's limits are shared by the admission instances.

A pair with limits (`providers[].models[].limits`) has G global in-flight request slots, R of
them reserved for pinned sessions, and P pins at most. Instead of one key per slot written on
every request, each admission instance holds a *quota* of the pair, and grants request leases
and pins from it in memory (the shape of YouTube's Doorman capacity leases):

- ``g``: how many leases it may have live at once;
- ``u`` <= ``g``: how many of those may be unpinned, new-pin or temporary (the rest need a pin:
  that is how the reserve R holds);
- ``p``: how many pins it may hold.

All quotas of a pair are one small value in the routing bucket (`QuotaBook`, key
``quota.<provider>.<mk>``), changed by compare-and-swap only, and a change is valid only if
afterwards Σg <= G, Σu <= G - R and Σp <= P. An instance grants within its own quota, so across
all instances at every moment: live leases <= G, unreserved leases <= G - R, pins <= P (I2).

Quotas follow demand: each instance states what it wants (``wg``, ``wu``, ``wp``: what it uses
plus headroom) and every instance computes the same max-min fair split of each limit from the
book (`fair_targets`); an instance above its target gives back what it does not use, one below
takes what is free. An instance only ever lowers its own quota down to what it uses, so a
quota change never takes capacity away from a granted lease. A dead instance's quota stays in
the book until the instances that adopted its leases and pins move those counts to themselves
(`transfer`), and what is left is dropped after a grace period (`drop`).

A live instance handing a shard over *earmarks* the quota the shard uses (`earmark`: a note in
the book, ``handing``, naming the giver, the shard and the counts; the counts stay in the
giver's entry). The receiver moves exactly the earmark to itself (`take`), or the giver takes
it back (`unmark`) once it no longer expects the receiver to; both are CAS writes of this one
value, so exactly one of them happens, whatever the timing: the giver never spends what the
receiver has taken, and nobody takes what the giver has taken back.

Pure: values in, values out, no clock or I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from llmgw.core.codec import decode_versioned

__all__ = [
    "NO_COUNTS",
    "NO_QUOTA",
    "QUOTA_VERSION",
    "Earmark",
    "PairLimits",
    "Quota",
    "QuotaBook",
    "QuotaCounts",
    "QuotaError",
    "fair_targets",
    "headroom",
    "idle",
    "lendable",
    "max_min_share",
    "reclaimable",
    "scaled_quota",
]

QUOTA_VERSION = 2


class PairLimits(Protocol):
    """Capacity of one provider/model pair (the config's `Limits` satisfies it)."""

    max_pinned_sessions: int
    max_global_in_flight_request_slots: int
    global_in_flight_request_slots_reserved_for_pinned_sessions: int
    max_per_session_in_flight_request_slots: int


class QuotaError(ValueError):
    """A quota book that does not decode, or a change that would break the limits."""


@dataclass(frozen=True, slots=True)
class Quota:
    """One instance's share of a pair, and what it asks for. All >= 0; ``u`` <= ``g``."""

    g: int = 0
    u: int = 0
    p: int = 0
    wg: int = 0
    wu: int = 0
    wp: int = 0
    at: float = 0.0  # when its holder last wrote it (the holder's clock)

    def __post_init__(self) -> None:
        for name in ("g", "u", "p", "wg", "wu", "wp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise QuotaError(f"quota field {name} must be an integer >= 0, got {value!r}")
        if self.u > self.g:
            raise QuotaError(f"unreserved quota u={self.u} exceeds the lease quota g={self.g}")

    @property
    def counts(self) -> QuotaCounts:
        """(g, u, p) by name: what it may hold of leases, unreserved leases and pins."""
        return QuotaCounts(self.g, self.u, self.p)

    def as_json(self) -> dict[str, Any]:
        return {
            "g": self.g,
            "u": self.u,
            "p": self.p,
            "wg": self.wg,
            "wu": self.wu,
            "wp": self.wp,
            "at": self.at,
        }


NO_QUOTA = Quota()  # what an instance holds before it is granted anything


class QuotaCounts(NamedTuple):
    """Counts of one pair, in a quota's order: leases (``g``), unreserved leases (``u``) and
    pins (``p``). What a shard uses, an earmark sets aside, a transfer moves, a loan asks for.
    A tuple (it unpacks as ``g, u, p``), but read by name; the book's JSON keeps g/u/p."""

    leases: int = 0
    unreserved: int = 0
    pins: int = 0

    def plus(self, other: QuotaCounts) -> QuotaCounts:
        return QuotaCounts(self.leases + other[0], self.unreserved + other[1], self.pins + other[2])

    def less(self, other: QuotaCounts) -> QuotaCounts:
        """Each count less `other`'s, never below 0."""
        return QuotaCounts(
            max(0, self.leases - other[0]),
            max(0, self.unreserved - other[1]),
            max(0, self.pins - other[2]),
        )


NO_COUNTS = QuotaCounts()


@dataclass(frozen=True, slots=True)
class Earmark:
    """Part of `source`'s quota set aside for the receiver of `shard` (a handover)."""

    source: str
    shard: int
    g: int
    u: int
    p: int

    @property
    def counts(self) -> QuotaCounts:
        return QuotaCounts(self.g, self.u, self.p)

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source, "shard": self.shard, "g": self.g, "u": self.u, "p": self.p}


@dataclass(frozen=True, slots=True)
class QuotaBook:
    """Every instance's quota of one pair. Invariant (checked by `check`): Σg <= G,
    Σu <= G - R, Σp <= P for the pair's limits. ``handing``: earmarks of handovers in flight,
    by (source, shard); their counts are part of their source's entry, not extra."""

    provider: str
    model: str
    holders: Mapping[str, Quota] = field(default_factory=dict)
    handing: Mapping[tuple[str, int], Earmark] = field(default_factory=dict)

    # ---- reading ----------------------------------------------------------------------------

    def quota(self, instance: str) -> Quota:
        return self.holders.get(instance, NO_QUOTA)

    def totals(self) -> QuotaCounts:
        """(Σg, Σu, Σp)."""
        holders = self.holders.values()
        return QuotaCounts(
            sum(q.g for q in holders), sum(q.u for q in holders), sum(q.p for q in holders)
        )

    def free(self, limits: PairLimits) -> QuotaCounts:
        """What nobody holds: (G - Σg, (G - R) - Σu, P - Σp); never negative in a valid book."""
        g, u, p = self.totals()
        return QuotaCounts(
            _total(limits) - g,
            _unreserved(limits) - u,
            limits.max_pinned_sessions - p,
        )

    def check(self, limits: PairLimits) -> None:
        """Raise QuotaError naming the limit a book breaks."""
        g, u, p = self.totals()
        if g > _total(limits):
            raise QuotaError(f"lease quotas Σg={g} exceed G={_total(limits)}")
        if u > _unreserved(limits):
            raise QuotaError(f"unreserved quotas Σu={u} exceed G-R={_unreserved(limits)}")
        if p > limits.max_pinned_sessions:
            raise QuotaError(f"pin quotas Σp={p} exceed P={limits.max_pinned_sessions}")

    # ---- changing ---------------------------------------------------------------------------

    def with_quota(self, instance: str, quota: Quota) -> QuotaBook:
        holders = dict(self.holders)
        holders[instance] = quota
        return replace(self, holders=holders)

    def drop(self, instance: str) -> QuotaBook:
        holders = {i: q for i, q in self.holders.items() if i != instance}
        handing = {k: e for k, e in self.handing.items() if e.source != instance}
        return replace(self, holders=holders, handing=handing)

    # ---- handovers --------------------------------------------------------------------------

    def earmarked(self, source: str) -> QuotaCounts:
        """Σ (g, u, p) of `source`'s earmarks: its entry, less these, is what it may spend."""
        marks = [e for e in self.handing.values() if e.source == source]
        return QuotaCounts(
            sum(e.g for e in marks), sum(e.u for e in marks), sum(e.p for e in marks)
        )

    def earmark(self, source: str, shard: int, g: int, u: int, p: int) -> QuotaBook:
        """Set (g, u, p) of `source`'s entry aside for `shard`'s receiver (replacing an older
        earmark of that shard). Totals do not change."""
        handing = dict(self.handing)
        handing[(source, shard)] = Earmark(source, shard, g, u, p)
        return replace(self, handing=handing)

    def unmark(self, source: str, shard: int) -> QuotaBook:
        """The giver takes its earmark back (nobody will take it now). Totals do not change."""
        handing = {k: e for k, e in self.handing.items() if k != (source, shard)}
        return replace(self, handing=handing)

    def take(
        self, source: str, shard: int, target: str, at: float
    ) -> tuple[QuotaBook, QuotaCounts]:
        """The receiver of `shard` moves `source`'s earmark for it to itself (at most what
        `source` holds) and removes the earmark; without one, nothing moves."""
        mark = self.handing.get((source, shard))
        if mark is None:
            return self, NO_COUNTS
        book = self.unmark(source, shard)
        have = book.quota(source)
        step = QuotaCounts(min(mark.g, have.g), min(mark.u, have.u, mark.g), min(mark.p, have.p))
        return book.transfer(source, target, *step, at=at), step

    def transfer(self, source: str, target: str, g: int, u: int, p: int, at: float) -> QuotaBook:
        """Move (g, u, p) of `source`'s quota to `target` (an adopter of its leases and pins).

        Moves at most what `source` holds of each; totals never change, so a valid book stays
        valid. The source's wants are cleared (it is dead or leaving).
        """
        have = self.quota(source)
        g, p = min(g, have.g), min(p, have.p)
        # u moves with g as far as needed for the source to keep u <= g, never beyond g.
        u = min(max(u, have.u - (have.g - g)), have.u, g)
        left = Quota(have.g - g, have.u - u, have.p - p, 0, 0, 0, have.at)
        got = self.quota(target)
        moved = replace(got, g=got.g + g, u=got.u + u, p=got.p + p, at=at)
        return self.with_quota(source, left).with_quota(target, moved)

    def lend(self, source: str, target: str, g: int, u: int, p: int, at: float) -> QuotaBook:
        """Move exactly (g, u, p) of live `source`'s quota to live `target` (a loan asked for
        on the request path, `lendable`). Totals never change, so a valid book stays valid;
        unlike `transfer`, both keep their wants. Raises QuotaError if `source` does not hold
        that much or would be left with u > g."""
        have = self.quota(source)
        if g > have.g or u > have.u or p > have.p or min(g, u, p) < 0:
            raise QuotaError(f"{source} cannot lend g={g} u={u} p={p} from {have}")
        left = replace(have, g=have.g - g, u=have.u - u, p=have.p - p)  # checks u <= g
        got = self.quota(target)
        moved = replace(got, g=got.g + g, u=got.u + u, p=got.p + p, at=at)
        return self.with_quota(source, left).with_quota(target, moved)

    # ---- codec ------------------------------------------------------------------------------

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "v": QUOTA_VERSION,
            "provider": self.provider,
            "model": self.model,
            "holders": {i: q.as_json() for i, q in sorted(self.holders.items())},
        }
        if self.handing:
            body["handing"] = [e.as_json() for _, e in sorted(self.handing.items())]
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> QuotaBook:
        body = decode_versioned(raw, QUOTA_VERSION, "quota book", QuotaError)
        holders = body.get("holders")
        if not isinstance(holders, dict):
            raise QuotaError("quota book without a holders object")
        try:
            decoded = {
                str(i): Quota(
                    **{k: q[k] for k in ("g", "u", "p", "wg", "wu", "wp") if k in q},
                    at=float(q.get("at", 0.0)),
                )
                for i, q in holders.items()
            }
        except (TypeError, AttributeError) as exc:
            raise QuotaError(f"quota book holder does not decode: {exc}") from None
        marks = body.get("handing", [])
        try:
            handing = {
                (str(m["source"]), int(m["shard"])): Earmark(
                    str(m["source"]), int(m["shard"]), int(m["g"]), int(m["u"]), int(m["p"])
                )
                for m in marks
            }
        except (TypeError, KeyError, ValueError) as exc:
            raise QuotaError(f"quota book earmark does not decode: {exc}") from None
        return cls(str(body.get("provider", "")), str(body.get("model", "")), decoded, handing)


def _total(limits: PairLimits) -> int:
    return limits.max_global_in_flight_request_slots


def _unreserved(limits: PairLimits) -> int:
    reserved = min(
        limits.global_in_flight_request_slots_reserved_for_pinned_sessions,
        limits.max_global_in_flight_request_slots,
    )
    return limits.max_global_in_flight_request_slots - reserved


def max_min_share(
    capacity: int, wants: Mapping[str, int], *, spread: bool = True
) -> dict[str, int]:
    """Split `capacity` among `wants` by max-min fairness, then (with `spread`) share what is
    left equally.

    Nobody gets more than it wants until everybody has what it wants; what no one wants is
    split evenly (remainders to the lexicographically first ids) with `spread`, so a lone
    instance holds the whole limit and never has to ask on the request path; without it, what
    no one wants is left to nobody (several instances: it stays free in the book, where any of
    them takes it by one CAS when its share runs short). Integers; with `spread`, Σ result ==
    capacity whenever wants is non-empty. Deterministic: every instance computes the same split.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    ids = sorted(wants)
    if not ids:
        return {}
    share = dict.fromkeys(ids, 0)
    left = capacity
    pending = [i for i in ids if wants[i] > 0]
    while left > 0 and pending:
        level = left // len(pending)
        if level == 0:  # fewer units than claimants: one each, in id order
            for i in pending[:left]:
                share[i] += 1
            left = 0
            break
        for i in pending:
            give = min(level, wants[i] - share[i])
            share[i] += give
            left -= give
        pending = [i for i in pending if share[i] < wants[i]]
    if left > 0 and spread:  # nobody wants more: the rest is split evenly
        each, extra = divmod(left, len(ids))
        for index, i in enumerate(ids):
            share[i] += each + (1 if index < extra else 0)
    return share


def fair_targets(book: QuotaBook, limits: PairLimits, live: Sequence[str]) -> dict[str, Quota]:
    """The quota each live instance should hold, from everybody's wants in `book`.

    Targets for g and p are `max_min_share` of G and P over the live instances' wants; u is
    the max-min share of G - R, capped by the instance's g target. A lone instance's target is
    the whole limit; several get what they want (their use plus headroom) as far as the limit
    goes, and the rest stays free in the book for whichever runs short first (`QuotaBook.free`,
    taken on the request path: `llmgw.services.admission.loans.Loans.borrow`). Instances
    not in `live` get nothing (their quota is adopted or dropped, not rebalanced).
    """
    wants_g = {i: book.quota(i).wg for i in live}
    wants_u = {i: book.quota(i).wu for i in live}
    wants_p = {i: book.quota(i).wp for i in live}
    spread = len(live) <= 1
    g = max_min_share(_total(limits), wants_g, spread=spread)
    u = max_min_share(_unreserved(limits), wants_u, spread=spread)
    p = max_min_share(limits.max_pinned_sessions, wants_p, spread=spread)
    return {i: Quota(g[i], min(u[i], g[i]), p[i]) for i in live}


def headroom(limit: int, members: int) -> int:
    """Spare quota an instance asks for beyond what it uses: a tenth of its fair share, >= 1."""
    if limit <= 0:
        return 0
    return max(1, math.ceil(limit / max(1, members) / 10))


def lendable(
    entry: Quota,
    spendable: Quota,
    used: QuotaCounts,
    ask: QuotaCounts,
    borrower: Quota = NO_QUOTA,
) -> QuotaCounts:
    """What an instance can lend now of what `ask` (leases, unreserved, pins) asks for: never
    what it uses, never what it may not spend (``spendable``: its entry less what is set aside,
    as its ledger sees it), and never so much that its `entry` would be left with u > g (then
    more u goes with the g than was asked, as far as it does not use that u).

    Unreserved quota moves without lease quota as far as the `borrower`'s entry has lease
    quota above its unreserved (``borrower.g - borrower.u``): an instance whose leases are all
    taken by pinned sessions may still hold idle unreserved quota, and a borrower with idle
    lease quota lacks only that (the two limits are one pool to a lone instance).

    Returns (g, u, p) with 0 <= each <= `entry`'s, u <= g + (borrower.g - borrower.u), and
    after lending: spendable.g - g >= leases used, spendable.u - u >= unreserved used,
    spendable.p - p >= pins used; both entries keep u <= g.
    """
    leases, unreserved, pins = used
    ask_g, ask_u, ask_p = (max(0, a) for a in ask)
    room_u = max(0, borrower.g - borrower.u)  # unreserved the borrower can take without g
    p = max(0, min(ask_p, spendable.p - pins, entry.p))
    cap_u = max(0, min(spendable.u - unreserved, entry.u))
    g = max(0, min(max(ask_g, ask_u - room_u), spendable.g - leases, entry.g))
    while g > 0 and entry.u - (entry.g - g) > cap_u:  # u that must go with g, beyond what is idle
        g -= 1
    u = min(cap_u, g + room_u, max(ask_u, entry.u - (entry.g - g)))
    return QuotaCounts(g, max(0, u), p)


def idle(entry: Quota, slack: QuotaCounts) -> QuotaCounts:
    """How much of a peer's quota is probably idle, from its book entry alone: what it holds
    beyond what it wants less its headroom (`slack`: the headroom it asks for). A guess (its
    wants are as old as its last write); the peer itself decides what it lends (`lendable`)."""
    hg, hu, hp = slack
    return QuotaCounts(
        max(0, entry.g - max(0, entry.wg - hg)),
        max(0, entry.u - max(0, entry.wu - hu)),
        max(0, entry.p - max(0, entry.wp - hp)),
    )


def reclaimable(book: QuotaBook, live: Mapping[str, object], now: float, grace: float) -> list[str]:
    """Holders of `book` that are not `live` and whose entry is older than `grace`: what they
    still hold was adopted by now if it ever will be (their leases' edges answered the new
    owners' roll calls, or lost them), so the reaper may drop it. A live holder is never
    reclaimable, however old its entry."""
    return sorted(i for i, q in book.holders.items() if i not in live and now - q.at >= grace)


def scaled_quota(quota: Quota, old: PairLimits, new: PairLimits) -> Quota:
    """An instance's share when a pair's limits change from `old` to `new`: each of g, u, p
    scaled down by how much its limit shrank (floor), as it is where the limit grew. Shares
    that summed within `old` sum within `new` once each is scaled, so every instance may cap
    itself at once, without asking the others (lowering limits under load never over-admits)."""

    def scale(value: int, before: int, after: int) -> int:
        if after >= before:
            return value
        return (value * after) // before if before > 0 else 0

    g = scale(quota.g, _total(old), _total(new))
    u = scale(quota.u, _unreserved(old), _unreserved(new))
    p = scale(quota.p, old.max_pinned_sessions, new.max_pinned_sessions)
    return Quota(g, min(g, u), p)
