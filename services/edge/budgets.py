"""Budgets at the edge: reserve a request's estimated cost before admission, settle it at its end.

A request of a tenant with a budget (`spend.budgets`) reserves, before each attempt asks
admission, its estimated cost in each of its accounts (`llmgw.core.budget`): prompt tokens
estimated from the body (scaled to how the providers counted recent prompts), output tokens
from ``max_tokens`` (or ``max_completion_tokens``,
else `spend.default_output_tokens`), priced at the dearest provider that may serve it (for
`max_spend`) or the dearest third party (for `max_overflow_spend`). The reservation is taken
from this edge's grant, in memory; when the grant cannot fit it, the edge asks admission for a
larger one (`BudgetGrantRequest`: one CAS of the account, shared by the requests that wait for
it) and the request waits for the answer, like a first quota share. When the account's room
is held by other edges, the edge asks them for a loan (`BudgetLoanAsk`, most held first): each
gives back what it holds idle, and the edge asks the account again. A request whose grant
fits makes no NATS call.

- `max_spend` cannot fit the estimate, but fits it at our engines' prices (the dearest managed
  provider that may serve it): the attempt reserves that and is admitted with ``no_overflow``.
- `max_spend` cannot fit even that (or no managed provider serves the model): 429
  ``insufficient_quota``, before admission (no lease, nothing spent).
- `max_overflow_spend` cannot fit it: the attempt is admitted with ``no_overflow``, so it never
  goes to a third party (its endpoints are excluded) and waits for our engines in its band.
- An attempt placed on our engines (or kept to them) needs no more than our engines' price:
  its overflow reservation goes back at once, its spend reservation shrinks to that price;
  every attempt settles its real cost (`SpendBook`'s price) when it ends, and the reservation
  is released.

Every `spend.interval` the edge reports each account's spend and shrinks its grant to what it
has spent and reserved (plus a few requests' worth while the account has room), so grants
follow use and an idle edge holds nothing. Tolerance: settled spend plus reservations never pass
the limit; the real cost of requests in flight may exceed their estimates (a prompt longer than
estimated): that difference is what the spend can end above the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmgw.clock import SYSTEM, Clock
from llmgw.core.budget import (
    Budget,
    BudgetKind,
    Period,
    Purse,
    account_key,
    loan_order,
    period_id,
)
from llmgw.core.spend import (
    PriceBook,
    TokenPrices,
    TokenUse,
    estimate_input_tokens,
    estimated_output,
)
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    BUDGET_GRANT_SUBJECT,
    BudgetGrantReply,
    BudgetGrantRequest,
    BudgetLoan,
    BudgetLoanAsk,
    budget_lend_subject,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.services.edge.spend import SpendMetrics

log = logging.getLogger("llmgw.edge.budgets")

_SPARE_REQUESTS = 4  # a grant asks room for this many more like the last, while room is ample
_AMPLE = 16  # ... i.e. while the account's room is at least this many such requests
_ROUNDS = 8  # asks one request may wait for while others take what each brought
_IDLE_PERIODS = 3  # intervals without use before an account is forgotten (grant returned)
_MAX_LENDERS = 4  # holders one ask borrows from at most, one after the other


class BudgetUnavailable(Exception):
    """The budget accounts could not be reached (no admission instance answered)."""


@dataclass(slots=True)
class _Account:
    key: str
    kind: BudgetKind
    limit: int
    purse: Purse = field(default_factory=Purse)
    pending: asyncio.Future[bool] | None = None
    reported: int = -1  # spent as last reported
    demand: int = 0  # estimates of the requests waiting here for a larger grant
    used_at: float = 0.0  # monotonic time of the last reservation
    lenders: dict[str, int] = field(default_factory=dict)  # as the account last said


@dataclass(slots=True)
class BudgetHold:
    """One attempt's reservations; `no_overflow`: a budget could not fit it at a third party's
    price, so it is kept to our engines. `home`: its estimate at our engines' prices (None: no
    managed provider serves its model)."""

    parts: list[tuple[_Account, int]] = field(default_factory=list)
    no_overflow: bool = False
    home: int | None = None
    done: bool = False

    def stay_home(self) -> None:
        """Kept off third parties from now on: what only a third party would cost goes back."""
        self.no_overflow = True
        self._home_only()

    def admitted(self, *, third_party: bool) -> None:
        """Placed: on our engines, the overflow reservation and what the spend reservation
        holds beyond our engines' price are not needed."""
        if not third_party:
            self._home_only()

    def _home_only(self) -> None:
        kept = []
        for account, estimate in self.parts:
            if account.kind == "overflow":
                account.purse.release(estimate)
                continue
            if self.home is not None and estimate > self.home:
                account.purse.release(estimate - self.home)
                estimate = self.home
            kept.append((account, estimate))
        self.parts = kept

    def settle(self, picos: int, *, third_party: bool) -> None:
        """The attempt ended having cost `picos`."""
        if self.done:
            return
        self.done = True
        for account, estimate in self.parts:
            cost = picos if account.kind == "spend" or third_party else 0
            account.purse.settle(estimate, cost)

    def release(self) -> None:
        """The attempt never ran."""
        self.settle(0, third_party=False)


class BudgetGuard:
    def __init__(
        self,
        nc: NATS | None,
        edge_id: str,
        config: Config,
        *,
        metrics: SpendMetrics | None = None,
        scale: Callable[[str, int], int] = lambda model, tokens: tokens,
        clock: Clock = SYSTEM,
    ) -> None:
        self._nc = nc
        self._metrics = metrics
        self._scale = scale  # estimated prompt tokens as providers count them (SpendBook)
        self.edge_id = edge_id
        self._clock = clock.wall  # names the period
        self._monotonic = clock.monotonic  # an account's idleness
        self.interval = config.spend.interval
        self.request_timeout = config.nats.request_timeout
        self._accounts: dict[str, _Account] = {}
        self._periods: dict[str, tuple[int, str]] = {}
        self._keys: dict[tuple[str, str, str], str] = {}
        self._task: asyncio.Task[None] | None = None
        self._lend_sub: Subscription | None = None
        self.follow(config)

    def follow(self, config: Config, draining: frozenset[str] = frozenset()) -> None:
        """Reserve by `config`'s budgets and prices from the next request on (at start, then
        each applied config and fleet change). Reservations made before settle as they were
        made; an account takes a tenant's new limit at its next reservation."""
        self.default_output = config.spend.default_output_tokens
        self.tenants: dict[str, Budget] = {b.tenant: b.budget() for b in config.spend.budgets}
        book = config.spend.price_book(config.resolve_model)
        # per model: the third parties' endpoints (draining ones too: a request kept off
        # third parties must not reach one that still serves)
        self.third_party_endpoints: dict[str, tuple[str, ...]] = {}
        self._worst: dict[str, TokenPrices] = {}
        self._worst_third: dict[str, TokenPrices] = {}
        self._worst_home: dict[str, TokenPrices] = {}  # models some managed provider serves
        for model in config.models:
            names = [model.name, *(config.resolve_model(f) or f for f in model.fallbacks)]
            serving = [p for p in config.providers if any(p.model(n) for n in names)]
            self._worst[model.name] = _dearest(book, [p.id for p in serving], names)
            third = [p.id for p in serving if not p.is_managed]
            self._worst_third[model.name] = _dearest(book, third, names)
            home = [p.id for p in serving if p.is_managed]
            if home:
                self._worst_home[model.name] = _dearest(book, home, names)
            self.third_party_endpoints[model.name] = tuple(
                e.id for e in config.endpoints if e.provider in third
            )

    @property
    def active(self) -> bool:
        """Whether any tenant has a budget (keys' budgets are checked in any case)."""
        return bool(self.tenants)

    async def start(self) -> None:
        # Always: a tenant's budget may come with an applied config, and keys carry their own.
        if self._nc is not None:
            self._lend_sub = await self._nc.subscribe(
                budget_lend_subject(self.edge_id), cb=self._on_lend
            )
            self._task = asyncio.create_task(self._sync_loop(), name="budget-sync")

    async def stop(self) -> None:
        if self._lend_sub is not None:
            sub, self._lend_sub = self._lend_sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        with contextlib.suppress(Exception):
            await self._sync(final=True)

    # ---- the request path -----------------------------------------------------------------------

    async def reserve(
        self,
        tenant: str | None,
        model: str,
        body: dict[str, Any],
        *,
        key: str | None = None,
        key_budget: Budget | None = None,
    ) -> BudgetHold | None:
        """The attempt's reservations in its tenant's and its key's accounts (None: no budget
        applies). Raises `BudgetRefused` when a `max_spend` cannot fit it (what was reserved
        is released), `BudgetUnavailable` when no grant could be asked for."""
        budgets: list[tuple[str, str, Budget]] = []
        tenant_budget = self.tenants.get(tenant) if tenant is not None else None
        if tenant_budget is not None:
            budgets.append((f"tenant-{tenant}", f"tenant '{tenant}'", tenant_budget))
        if key_budget is not None and key is not None:
            budgets.append((f"key-{key}", f"API key {key}", key_budget))
        if not budgets:
            return None
        prompt = self._scale(model, estimate_input_tokens(body))
        use = TokenUse(input=prompt, output=self._output(body))
        home = self._worst_home.get(model)
        hold = BudgetHold(home=home.cost(use) if home is not None else None)
        try:
            for scope, whose, budget in budgets:
                await self._reserve_in(hold, scope, whose, budget, model, use)
        except BaseException:
            hold.release()
            raise
        return hold

    async def _reserve_in(
        self, hold: BudgetHold, scope: str, whose: str, budget: Budget, model: str, use: TokenUse
    ) -> None:
        period = self._period(budget.period)
        if budget.max_spend is not None:
            home = hold.home
            estimate = self._worst.get(model, _NO_PRICE).cost(use)
            if hold.no_overflow and home is not None:
                estimate = home
            account = self._account("spend", scope, period, budget.max_spend)
            if await self._reserve(account, estimate):
                hold.parts.append((account, estimate))
                self._count("spend", "reserved")
            elif home is not None and home < estimate and await self._reserve(account, home):
                # A third party's price does not fit, our engines' does: run home.
                hold.parts.append((account, home))
                hold.stay_home()
                self._count("spend", "kept_home")
            else:
                self._count("spend", "refused")
                raise BudgetRefused(
                    f"The budget of {whose} ({budget.period}) is used up: this request would "
                    "take its spend past max_spend."
                )
        if budget.max_overflow_spend is not None and not hold.no_overflow:
            estimate = self._worst_third.get(model, _NO_PRICE).cost(use)
            account = self._account("overflow", scope, period, budget.max_overflow_spend)
            try:
                fits = await self._reserve(account, estimate)
            except BudgetUnavailable:
                fits = False  # unknown: keep to our engines
            if fits:
                hold.parts.append((account, estimate))
            else:
                hold.stay_home()
            self._count("overflow", "reserved" if fits else "kept_home")

    def _count(self, kind: str, decision: str) -> None:
        if self._metrics is not None:
            self._metrics.budget.labels(kind, decision).inc()

    def _period(self, period: Period) -> str:
        """`period_id` now, named once a second (a day or month turns at a second)."""
        now = self._clock()
        second = int(now)
        cached = self._periods.get(period)
        if cached is not None and cached[0] == second:
            return cached[1]
        name = period_id(period, now)
        self._periods[period] = (second, name)
        return name

    def _output(self, body: dict[str, Any]) -> int:
        return estimated_output(body, self.default_output)

    def _account(self, kind: BudgetKind, scope: str, period: str, limit: int) -> _Account:
        key = self._keys.get((kind, scope, period))
        if key is None:
            if len(self._keys) > 10_000:
                self._keys.clear()
            key = self._keys[(kind, scope, period)] = account_key(kind, scope, period)
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = _Account(key, kind, limit)
        if account.limit != limit:
            account.limit = limit
            account.purse.elsewhere = -1  # what was heard of the account bounds the old limit
        return account

    async def _reserve(self, account: _Account, estimate: int) -> bool:
        """Reserve `estimate`, asking for a larger grant (and loans) while the account may fit
        it: refused when, as last heard, the account cannot (every holder's spend; no ask
        then), or when an ask of this request's brought nothing (the others' grants are
        reserved, not idle)."""
        account.used_at = self._monotonic()
        purse = account.purse
        if purse.reserve(estimate):
            return True
        if not purse.may_fit(estimate):
            return False
        account.demand += estimate  # what the requests waiting here need, asked together
        try:
            for _ in range(_ROUNDS):
                spare = estimate * _SPARE_REQUESTS if purse.room >= estimate * _AMPLE else 0
                before = purse.grant
                asked = await self._regrant(
                    account,
                    purse.want(account.demand, spare),
                    need=purse.want(account.demand, 0),
                )
                if purse.reserve(estimate):
                    return True
                if not purse.may_fit(estimate) or (asked and purse.grant <= before):
                    return False
            return False
        finally:
            account.demand -= estimate

    async def _regrant(self, account: _Account, want: int, need: int = 0) -> bool:
        """Ask for a grant of `want` in all, and loans up to `need` if the account has less room;
        requests that need one meanwhile share the ask. False: an ask in flight was shared."""
        if account.pending is not None:
            await asyncio.shield(account.pending)
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        account.pending = future
        try:
            await self._ask(account, want)
            if need > account.purse.grant and account.lenders:
                if await self._borrow(account, need - account.purse.grant):
                    await self._ask(account, want)  # take what the lenders gave back
            future.set_result(True)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            future.exception()  # retrieved: the waiters get it through shield
            raise
        finally:
            account.pending = None
        return True

    async def _borrow(self, account: _Account, short: int) -> int:
        """Ask the holders that hold more than they spent, most first, to give back what they
        hold idle, until `short` came back; returns what did."""
        assert self._nc is not None  # an ask was answered
        lent = 0
        for lender in loan_order(account.lenders)[:_MAX_LENDERS]:
            ask = BudgetLoanAsk(borrower=self.edge_id, account=account.key, want=short - lent)
            try:
                msg = await self._nc.request(
                    budget_lend_subject(lender),
                    ask.model_dump_json().encode(),
                    timeout=self.request_timeout,
                )
                lent += BudgetLoan.model_validate_json(msg.data).lent
            except Exception as exc:  # gone, or slow: the next one may have it
                log.debug("budget loan from %s: %s", lender, exc)
            if lent >= short:
                break
        return lent

    async def _on_lend(self, msg: Msg) -> None:
        """Another holder is short: give back what this edge holds idle of the account, unless
        its own requests wait for a grant of it (it is not idle then). An ask in flight that no
        request waits on (the periodic sync's) is let finish first."""
        lent = 0
        try:
            ask = BudgetLoanAsk.model_validate_json(msg.data)
        except ValueError:
            return
        account = self._accounts.get(ask.account)
        if account is not None and account.pending is not None and account.demand == 0:
            # An ask in flight with no request waiting on it: the periodic sync's. What it
            # writes is this edge's own grant; once it is written, lend from what is idle then
            # (answering 0 now would refuse the borrower's request while the account has room).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(account.pending), self.request_timeout)
        if account is not None and account.pending is None and account.demand == 0:
            lent = account.purse.lend(ask.want)  # lowered here before the write is sent
            if lent:
                try:
                    await self._regrant(account, account.purse.grant)
                except BudgetUnavailable:
                    lent = 0  # not written: the account still holds it (the next sync writes)
        with contextlib.suppress(Exception):
            await msg.respond(BudgetLoan(lent=lent).model_dump_json().encode())

    async def _ask(self, account: _Account, want: int) -> None:
        if self._nc is None:
            raise BudgetUnavailable("no NATS connection")
        purse = account.purse
        purse.lower(want)  # a smaller grant applies before the account hears of it
        request = BudgetGrantRequest(
            edge=self.edge_id,
            account=account.key,
            limit=account.limit,
            spent=purse.spent,
            want=want,
        )
        try:
            msg = await self._nc.request(
                BUDGET_GRANT_SUBJECT,
                request.model_dump_json().encode(),
                timeout=self.request_timeout,
            )
            reply = BudgetGrantReply.model_validate_json(msg.data)
        except Exception as exc:
            raise BudgetUnavailable(f"the budget accounts did not answer: {exc}") from None
        if not reply.ok:
            raise BudgetUnavailable(reply.error or "the budget account was not written")
        purse.grant = reply.grant
        purse.room = reply.room
        account.lenders = dict(reply.lenders)
        purse.elsewhere = sum(account.lenders.values())
        # An account this edge forgot while idle and uses again: what it spent there stays
        # spent (the account kept it), so its new purse starts from it.
        purse.spent = max(purse.spent, reply.mine)
        account.reported = max(request.spent, reply.mine)

    # ---- housekeeping ---------------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._sync()
            except Exception as exc:
                log.debug("budget sync: %s", exc)

    async def _sync(self, *, final: bool = False) -> None:
        """Report every account's spend; shrink grants to what is spent and reserved (plus
        spare while in use and the account has room); forget idle accounts of past periods."""
        now = self._monotonic()
        for key, account in list(self._accounts.items()):
            purse = account.purse
            idle = now - account.used_at > self.interval * _IDLE_PERIODS
            base = purse.spent + purse.reserved
            if final or idle:
                want = base
            else:
                want = max(base, min(purse.grant, base + purse.room // _AMPLE))
            if want == purse.grant and purse.spent == account.reported:
                if idle and purse.reserved == 0:
                    del self._accounts[key]  # its grant is what it spent: nothing held
                continue
            if account.pending is not None:
                continue
            with contextlib.suppress(BudgetUnavailable):
                await self._regrant(account, want)


class BudgetRefused(Exception):
    """`max_spend` cannot fit the request: 429 insufficient_quota (the message says whose)."""


_NO_PRICE = TokenPrices()


def _dearest(book: PriceBook, providers: list[str], models: list[str]) -> TokenPrices:
    worst = TokenPrices()
    for model in models:
        candidate = book.most_per_token(providers, model)
        worst = TokenPrices(
            input=max(worst.input, candidate.input), output=max(worst.output, candidate.output)
        )
    return worst
