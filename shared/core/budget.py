"""Budgets: money as a limit held across every edge, the way capacity quotas are held.

A budget (`Budget`) caps what one tenant or key may spend in a period (a UTC day, a UTC month,
or in total): `max_spend` everything, `max_overflow_spend` only what third-party (unlimited)
providers cost. Each (budget kind, scope, period) is one **account** (`Account`), a small value
changed only by compare-and-swap, in which every edge that spends from it is a **holder** with a
*grant* (what it may commit) and what it has *spent*. The invariant a write must keep:

    closed + sum over holders of max(grant, spent) <= limit

(`closed`: what holders that are gone had spent). An edge commits money only within its own
grant, in memory (`Purse`): a request *reserves* its estimated cost before it is admitted and
*settles* its real cost when it ends. So, across every edge at every moment, settled spend plus
reservations stay within the limit; what can pass it is only the difference between the real
and the estimated cost of the requests in flight (an estimate that was too low). `regrant` is
the one change of an account: a holder reports what it spent, and asks for a new grant; it is
given what it asks for as far as the other holders leave room, never less than it spent. A
holder not heard from for `ttl` is gone: its spent moves to `closed` and its grant is free.

Grants move to where the requests are. A holder whose grant cannot fit a request while the
account's room is held by others (`Account.lenders`: what each holds beyond its spend) asks
them to *lend*: a lender gives back what it holds idle (`Purse.lend`: never what it spent or
reserved), lowering its grant in memory before it writes the account, and the borrower then
asks the account again. Only a holder lowers its own grant, so a loan is two ordinary
`regrant` writes and the invariant holds through it. The same rule keeps any shrinking write
safe (`Purse.lower`): the lower grant applies in memory before the write is sent, so nothing
is reserved meanwhile into what the account is told is free.

Pure: values in, values out, no clock or I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from llmgw.core.codec import decode_versioned
from llmgw.core.spend import period_of

__all__ = [
    "ACCOUNT_VERSION",
    "Account",
    "AccountError",
    "Budget",
    "BudgetKind",
    "Holding",
    "Period",
    "Purse",
    "account_key",
    "loan_order",
    "period_id",
    "regrant",
]

ACCOUNT_VERSION = 1
Period = Literal["daily", "monthly", "total"]
BudgetKind = Literal["spend", "overflow"]  # max_spend / max_overflow_spend
_ACCOUNT_PREFIX = "budget."


class AccountError(ValueError):
    """An account value that does not decode."""


@dataclass(frozen=True, slots=True)
class Budget:
    """Limits in picos (None: no limit of that kind) over `period`."""

    period: Period
    max_spend: int | None = None
    max_overflow_spend: int | None = None

    def limit(self, kind: BudgetKind) -> int | None:
        return self.max_spend if kind == "spend" else self.max_overflow_spend


def period_id(period: Period, now: float) -> str:
    """The account's period at `now`: ``2026-12-03`` (daily), ``2026-12`` (monthly), ``total``."""
    if period == "daily":
        return period_of(now, "day")
    if period == "monthly":
        return period_of(now, "month")
    return "total"


def account_key(kind: BudgetKind, scope: str, period: str) -> str:
    """The KV key of an account: ``budget.<kind>.<scope>.<period>``; `scope` is
    ``tenant-<tenant>`` or ``key-<key id>`` (tenants may hold dots, which the key escapes)."""
    return f"{_ACCOUNT_PREFIX}{kind}.{scope.replace('.', '_')}.{period}"


@dataclass(frozen=True, slots=True)
class Holding:
    """One holder's part: what it may commit (`grant`) and what it has spent, as of `at`."""

    grant: int = 0
    spent: int = 0
    at: float = 0.0

    @property
    def committed(self) -> int:
        return max(self.grant, self.spent)


@dataclass(frozen=True, slots=True)
class Account:
    limit: int
    closed: int = 0
    holders: Mapping[str, Holding] = field(default_factory=dict)

    def committed(self, *, without: str | None = None) -> int:
        return self.closed + sum(h.committed for k, h in self.holders.items() if k != without)

    @property
    def spent(self) -> int:
        """Everything spent from this account, as far as its holders have told."""
        return self.closed + sum(h.spent for h in self.holders.values())

    @property
    def room(self) -> int:
        """What no holder may commit yet (never negative)."""
        return max(0, self.limit - self.committed())

    def lenders(self, holder: str) -> dict[str, int]:
        """What each holder but `holder` holds beyond what it has spent, as of its last write
        (those that hold nothing beyond are left out): the most it could lend. An upper bound,
        not a promise: what it has reserved since is known to it only."""
        return {
            name: held.grant - held.spent
            for name, held in self.holders.items()
            if name != holder and held.grant > held.spent
        }

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "v": ACCOUNT_VERSION,
                "limit": self.limit,
                "closed": self.closed,
                "holders": {k: [h.grant, h.spent, h.at] for k, h in sorted(self.holders.items())},
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Account:
        body: dict[str, Any] = decode_versioned(
            raw, ACCOUNT_VERSION, "budget account", AccountError
        )
        try:
            holders = {
                str(k): Holding(int(v[0]), int(v[1]), float(v[2]))
                for k, v in dict(body.get("holders") or {}).items()
            }
            return cls(int(body["limit"]), int(body.get("closed", 0)), holders)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise AccountError(f"budget account does not decode: {exc}") from None


def regrant(
    account: Account | None,
    *,
    holder: str,
    limit: int,
    spent: int,
    want: int,
    now: float,
    ttl: float,
) -> tuple[Account, int]:
    """The account after `holder` reported `spent` and asked for a grant of `want` (both
    totals: what it spent and may commit in all, not increments); and the grant it got.

    Holders not heard from for `ttl` are closed first. The grant is `want` as far as the room
    the others leave allows, and never less than `spent` (money spent is spent: committing it
    may take the account past its limit, by the estimate error the holder overshot with).
    `limit` is the budget's current value (a changed config applies to the next write)."""
    holders: dict[str, Holding] = {}
    closed = account.closed if account is not None else 0
    if account is not None:
        for name, holding in account.holders.items():
            if name != holder and holding.at < now - ttl:
                closed += holding.spent
            else:
                holders[name] = holding
    mine = holders.get(holder)
    spent = max(spent, mine.spent if mine is not None else 0)  # totals never go back
    others = closed + sum(h.committed for k, h in holders.items() if k != holder)
    grant = max(spent, min(want, limit - others))
    holders[holder] = Holding(grant, spent, now)
    return Account(limit, closed, holders), grant


def loan_order(lenders: Mapping[str, int]) -> list[str]:
    """Whom to ask for a loan first: who holds the most beyond its spend (then by name)."""
    return sorted(lenders, key=lambda name: (-lenders[name], name))


@dataclass(slots=True)
class Purse:
    """One holder's side of one account, in memory: its grant, what it spent and what its
    requests in flight have reserved. Invariants while no request overshot its estimate:
    spent + reserved <= grant, and grant <= the holder's grant in the account (a larger grant
    applies here only once the account was written with it; a smaller one at once, `lower`)."""

    grant: int = 0
    spent: int = 0
    reserved: int = 0
    room: int = 0  # the account's room when last heard (how generous to ask)
    # what the other holders held beyond their spend when last heard (-1: not heard yet)
    elsewhere: int = -1

    @property
    def idle(self) -> int:
        """What the grant has that is neither spent nor reserved."""
        return max(0, self.grant - self.spent - self.reserved)

    def may_fit(self, estimate: int) -> bool:
        """Whether the account may still fit `estimate` more here, as last heard: this idle
        grant, the account's room and what the others hold beyond their spend (loans). What
        was heard is an upper bound: spend only grows, and grants moving between holders or
        to the room keep the sum. So a no, however old, needs no ask (until the limit
        changes: `elsewhere` is then -1 again); a yes is worth one."""
        if self.elsewhere < 0:
            return True
        return self.idle + self.room + self.elsewhere >= estimate

    def lower(self, want: int) -> None:
        """Before asking the account for a grant of `want` in all: a smaller grant applies here
        at once (never below what is spent and reserved), so nothing is reserved meanwhile
        into what the account is about to call free. What is given back counts as the
        account's room (as it will be), so `may_fit` says the same as before."""
        self._give_back(max(0, self.grant - max(want, self.spent + self.reserved)))

    def lend(self, ask: int) -> int:
        """Give up to `ask` of the idle grant back (a loan to another holder; the caller then
        writes the account with the lowered grant). Returns what was given: 0 <= it <= `ask`,
        and spent + reserved <= grant still holds."""
        amount = max(0, min(ask, self.idle))
        self._give_back(amount)
        return amount

    def _give_back(self, amount: int) -> None:
        self.grant -= amount
        self.room += amount

    def reserve(self, estimate: int) -> bool:
        if self.spent + self.reserved + estimate > self.grant:
            return False
        self.reserved += estimate
        return True

    def release(self, estimate: int) -> None:
        self.reserved = max(0, self.reserved - estimate)

    def settle(self, estimate: int, cost: int) -> None:
        self.release(estimate)
        self.spent += cost

    def want(self, estimate: int, spare: int) -> int:
        """The grant to ask for to fit `estimate` more, with `spare` beyond it."""
        return self.spent + self.reserved + estimate + spare
