"""Spend at the edge: what each attempt that reached a provider cost, counted where it ended.

`SpendBook.attempt_ended` prices one attempt (`llmgw.core.spend`: exact integer picos) and adds
it to the edge's totals of the current UTC day per (key, tenant, provider, model), and to the
``llmgw_spend_*`` metrics. An attempt is counted once, when it ends (`AttemptEnd.finish` runs
once per attempt), so a retry or a fallback is one more attempt, never the same one twice.

What an attempt's tokens are (`llmgw.core.spend.billed_use`): its provider's usage when the
response carried one; for a stream cut short before its usage (the client left, the stream
broke), the data events the edge relayed as output and the prompt estimated from its text,
scaled by how the provider counted the prompts of its recent streams that had a usage
(`PromptCalibration`, per provider and model); nothing for an attempt that delivered no output
(an error, a refused connection).

Every `spend.interval` the edge publishes its day's totals (`SpendTotalsReport` on
``llmgw.v1.spend.totals``) when they changed; admission writes them down (one KV put per edge
per interval, never one per request: `llmgw.services.admission.spend`). A totals message
replaces the previous one of the same edge and day, so a lost message is repaired by the next.
Totals of the day before are published once more when the day turns, then dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.spend import (
    PICOS,
    PriceBook,
    PromptCalibration,
    SpendTotals,
    TokenUse,
    billed_use,
    format_money,
    period_of,
)
from llmgw.tasks import cancel_and_wait
from llmgw.wire import SPEND_TOTALS_SUBJECT, SpendTotalsReport

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config
    from llmgw.core.usage import Usage

log = logging.getLogger("llmgw.edge.spend")

_DAY = 86_400.0
_MAX_CHILDREN = 10_000  # label sets whose metric children are kept (tenants are bounded too)
_REFRESH = 10.0  # seconds between publications of unchanged totals (late listeners)


class SpendMetrics:
    """``llmgw_spend_*``: spend in the currency's unit by tenant, provider and model; the part
    spent on third parties by the route that sent it there."""

    def __init__(self, registry: CollectorRegistry, tenant: Callable[[str | None], str]) -> None:
        self.tenant = tenant
        self.spend = Counter(
            "llmgw_spend_cost",
            "Spend of the attempts that reached a provider, in spend.currency, by tenant, "
            "provider and model (tokens x prices from docs/config.md, spend).",
            ["tenant", "provider", "model"],
            registry=registry,
        )
        self.tokens = Counter(
            "llmgw_spend_tokens",
            "Tokens priced, by tenant, provider, model and kind (input, cached_input, output).",
            ["tenant", "provider", "model", "kind"],
            registry=registry,
        )
        self.overflow = Counter(
            "llmgw_spend_overflow_cost",
            "Spend on third-party (unlimited) providers, in spend.currency, by tenant and the "
            "route that sent the attempt there (reason: overflow, new_pin, temporary, ...).",
            ["tenant", "reason"],
            registry=registry,
        )
        self.budget = Counter(
            "llmgw_spend_budget_decisions",
            "Budget checks of attempts by kind (spend: max_spend, overflow: max_overflow_spend) "
            "and decision (reserved; refused: 429 insufficient_quota; kept_home: no third party).",
            ["kind", "decision"],
            registry=registry,
        )


class SpendBook:
    """The edge's spend of the current day; one per edge process."""

    def __init__(
        self,
        nc: NATS | None,
        edge_id: str,
        config: Config,
        metrics: SpendMetrics | None = None,
        *,
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self._nc = nc
        self.edge_id = edge_id
        self.currency = config.spend.currency
        self.interval = config.spend.interval
        self._metrics = metrics
        self._clock = wall_of(clock)
        self.day = period_of(self._clock())
        self._day_ends = 0.0
        self.totals = SpendTotals()
        self._previous: tuple[str, SpendTotals] | None = None  # the day before, not yet sent
        self._dirty = False
        self._task: asyncio.Task[None] | None = None
        self._calibration: dict[tuple[str, str], PromptCalibration] = {}
        self._children: dict[tuple[str | None, str, str, str | None], tuple[Any, ...]] = {}
        self.third_party: frozenset[str] = frozenset()
        self.follow(config)

    def follow(self, config: Config, draining: frozenset[str] = frozenset()) -> None:
        """Price by `config`'s prices from the next attempt on (at start, then each applied
        config): an attempt that ended before is counted at the prices it ended under."""
        self.prices: PriceBook = config.spend.price_book(config.resolve_model)
        third_party = frozenset(p.id for p in config.providers if not p.is_managed)
        if third_party != self.third_party:
            self._children.clear()  # which providers count as overflow changed
        self.third_party = third_party

    async def start(self) -> None:
        if self._nc is not None:
            self._task = asyncio.create_task(self._publish_loop(), name="spend-totals")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self.publish()  # what changed since the last interval

    # ---- the request path -----------------------------------------------------------------------

    def attempt_ended(
        self,
        *,
        key: str | None,
        tenant: str | None,
        provider: str,
        model: str,
        usage: Usage | None,
        relayed: int = 0,
        body: Mapping[str, object] | None = None,
        chat: bool = False,
        route: str | None = None,
    ) -> int:
        """Count one attempt's tokens (`billed_use`: its usage, else what a stream relayed);
        its cost in picos."""
        calibration = self._calibration.get((provider, model))
        if calibration is None:
            calibration = self._calibration[(provider, model)] = PromptCalibration()
        use = billed_use(usage, relayed, body or {}, chat, calibration)
        if use.input == 0 and use.output == 0:
            return 0
        now = self._clock()
        if now >= self._day_ends:  # the day is named once a day, not per attempt
            day = period_of(now)
            self._day_ends = (now // _DAY + 1) * _DAY
            if day != self.day:
                self._previous = (self.day, self.totals)
                self.day, self.totals = day, SpendTotals()
        picos = self.prices.cost(provider, model, use)
        self.totals.add((key or "", tenant or "", provider, model), use, picos)
        self._dirty = True
        if self._metrics is not None:
            self._count(tenant, provider, model, route, use, picos)
        return picos

    def _count(
        self,
        tenant: str | None,
        provider: str,
        model: str,
        route: str | None,
        use: TokenUse,
        picos: int,
    ) -> None:
        """The metrics of one attempt; children looked up once per label set (labels()
        parses its arguments on every call)."""
        metrics = self._metrics
        assert metrics is not None
        where = (tenant, provider, model, route)
        children = self._children.get(where)
        if children is None:
            label = metrics.tenant(tenant)
            children = (
                metrics.spend.labels(label, provider, model),
                metrics.tokens.labels(label, provider, model, "input"),
                metrics.tokens.labels(label, provider, model, "cached_input"),
                metrics.tokens.labels(label, provider, model, "output"),
                metrics.overflow.labels(label, route or "none")
                if provider in self.third_party
                else None,
            )
            if len(self._children) < _MAX_CHILDREN:
                self._children[where] = children
        cost = picos / PICOS
        children[0].inc(cost)
        children[1].inc(use.input - use.cached)
        children[2].inc(use.cached)
        children[3].inc(use.output)
        if children[4] is not None:
            children[4].inc(cost)

    def scaled_input(self, model: str, estimated: int) -> int:
        """`estimated` prompt tokens of `model` as the provider that counts most would count
        them (`PromptCalibration`): what a budget reservation assumes."""
        scaled = [c.scale(estimated) for (_, m), c in self._calibration.items() if m == model]
        return max(scaled, default=estimated)

    def usage_fields(self, provider: str, model: str) -> Callable[[Usage], dict[str, object]]:
        """For a stream's usage chunk (spend.cost_header): ``cost`` (six decimals) and
        ``cost_currency`` of an attempt on (provider, model) with that usage."""

        def fields(usage: Usage) -> dict[str, object]:
            use = TokenUse(usage.input_tokens, usage.cached_tokens, usage.output_tokens)
            picos = self.prices.cost(provider, model, use)
            return {"cost": format_money(picos, 6), "cost_currency": self.currency}

        return fields

    def cost_header(self, picos: int) -> str:
        """The `x-llmgw-cost` value: the amount to six decimals and the currency."""
        return f"{format_money(picos, 6)} {self.currency}"

    # ---- gossip ---------------------------------------------------------------------------------

    async def publish(self) -> None:
        """Send the day's totals (and the day before's, once) now."""
        if self._nc is None:
            return
        if self._previous is not None:
            day, totals = self._previous
            if await self._send(day, totals):
                self._previous = None
        self._dirty = False
        if self.totals.rows and not await self._send(self.day, self.totals):
            self._dirty = True

    async def _send(self, day: str, totals: SpendTotals) -> bool:
        assert self._nc is not None
        report = SpendTotalsReport(
            edge=self.edge_id, day=day, currency=self.currency, rows=totals.to_wire()
        )
        try:
            await self._nc.publish(SPEND_TOTALS_SUBJECT, report.model_dump_json().encode())
        except Exception as exc:
            log.debug("spend totals not published: %s", exc)
            return False
        return True

    async def _publish_loop(self) -> None:
        quiet = 0.0
        while True:
            await asyncio.sleep(self.interval)
            quiet += self.interval
            if (
                self._dirty
                or self._previous is not None
                or (self.totals.rows and quiet >= _REFRESH)
            ):
                quiet = 0.0
                await self.publish()
