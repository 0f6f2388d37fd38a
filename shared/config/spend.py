"""`spend`: prices per provider and model, the currency, and how spend is gathered.

Prices are per million tokens with at most six decimals (`llmgw.core.spend.micros_of`), so every
cost is an exact integer; a negative or non-numeric price, an unknown currency or a price for a
provider or model the config does not have is an error naming the field (`spend_problems` checks
the references once the whole config is built).
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from llmgw.config.common import StrictModel
from llmgw.config.durations import PositiveDuration
from llmgw.core.budget import Budget
from llmgw.core.spend import MICROS, PriceBook, TokenPrices, micros_of

if TYPE_CHECKING:
    from llmgw.config.schema import Config

# ISO 4217 codes of the currencies a gateway is likely billed in; spend has one currency.
CURRENCIES = frozenset(
    "USD EUR GBP JPY CHF CAD AUD NZD CNY HKD SGD INR KRW SEK NOK DKK PLN CZK BRL MXN ZAR".split()
)


class PriceConfig(StrictModel):
    """One provider's prices for one model (``*``: each of its models not listed otherwise).

    Amounts are in `spend.currency` per million tokens, kept as integer micro-units."""

    provider: str = Field(min_length=1)
    model: str = "*"
    input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    cached_input: Decimal | None = None
    # Our own engines: what one endpoint of the provider costs an hour, spread over the tokens
    # the provider served (`llmgw spend`); only with model "*".
    endpoint_hour: Decimal | None = None

    @field_validator("input", "output", "cached_input", "endpoint_hour", mode="before")
    @classmethod
    def _amount(cls, value: Any) -> Decimal | None:
        if value is None:
            return None
        try:
            return Decimal(micros_of(value)) / MICROS
        except ValueError as exc:
            raise ValueError(f"price per million tokens: {exc}") from None

    @field_serializer("input", "output", "cached_input", "endpoint_hour")
    def _shown(self, value: Decimal | None) -> float | None:
        return None if value is None else float(value)  # at most 6 decimals: exact as shown

    def prices(self) -> TokenPrices:
        cached = self.cached_input
        return TokenPrices(
            input=micros_of(self.input),
            output=micros_of(self.output),
            cached_input=None if cached is None else micros_of(cached),
        )


class BudgetConfig(StrictModel):
    """One tenant's budget over a period; amounts in `spend.currency`."""

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]*$")
    period: Literal["daily", "monthly", "total"]
    max_spend: Decimal | None = None
    max_overflow_spend: Decimal | None = None

    @field_validator("max_spend", "max_overflow_spend", mode="before")
    @classmethod
    def _amount(cls, value: Any) -> Decimal | None:
        if value is None:
            return None
        return Decimal(micros_of(value)) / MICROS

    @field_serializer("max_spend", "max_overflow_spend")
    def _shown(self, value: Decimal | None) -> float | None:
        return None if value is None else float(value)

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetConfig:
        if self.max_spend is None and self.max_overflow_spend is None:
            raise ValueError("a budget needs max_spend, max_overflow_spend or both")
        return self

    def budget(self) -> Budget:
        def picos(value: Decimal | None) -> int | None:
            return None if value is None else micros_of(value) * MICROS

        return Budget(self.period, picos(self.max_spend), picos(self.max_overflow_spend))


class SpendConfig(StrictModel):
    """`spend`: off (no prices) unless prices are given; counting costs nothing per request
    beyond a dict update at the edge."""

    currency: str = "USD"
    prices: list[PriceConfig] = Field(default_factory=list)
    # How often each edge publishes its totals (one message per interval when they changed).
    interval: PositiveDuration = 1.0
    # The KV bucket that keeps every edge's totals per UTC day (written by admission).
    bucket: str = Field("llmgw_spend", pattern=r"^[A-Za-z0-9_-]+$")
    # Tell a client what its request cost: the `x-llmgw-cost` response header.
    cost_header: bool = False
    # Budgets per tenant (keys carry their own: docs/keys.md).
    budgets: list[BudgetConfig] = Field(default_factory=list)
    # Output tokens a request without max_tokens is estimated at, for its budget reservation.
    default_output_tokens: int = Field(1024, ge=1)
    # Cost-aware overflow: among third parties of equal priority the cheaper goes first while
    # its rate balancer weight is at least this fraction of the fastest one's (> 1: cost never
    # reorders them).
    cheaper_overflow_min_speed: float = Field(0.8, ge=0)

    @field_validator("currency", mode="before")
    @classmethod
    def _currency(cls, value: Any) -> str:
        if not isinstance(value, str) or value.strip().upper() not in CURRENCIES:
            known = ", ".join(sorted(CURRENCIES))
            raise ValueError(f"unknown currency {value!r}; expected an ISO 4217 code: {known}")
        return value.strip().upper()

    def endpoint_hours(self) -> dict[str, int]:
        """Micro-units per endpoint-hour by provider (the providers that have one)."""
        return {
            p.provider: micros_of(p.endpoint_hour)
            for p in self.prices
            if p.endpoint_hour is not None
        }

    def overflow_costs(
        self, config: Config
    ) -> tuple[dict[str, dict[str, int]], dict[str, int]] | None:
        """For cost-aware overflow: per model, each unlimited provider's price of a million
        input plus a million output tokens; and every provider's priority. None when no two
        unlimited providers share a priority (nothing to reorder)."""
        unlimited = [p for p in config.providers if not p.is_managed]
        priorities = [p.priority for p in unlimited]
        if len(priorities) == len(set(priorities)):
            return None
        book = self.price_book(config.resolve_model)
        costs: dict[str, dict[str, int]] = {}
        for model in config.models:
            for provider in unlimited:
                prices = book.for_pair(provider.id, model.name)
                if prices is not None:
                    costs.setdefault(model.name, {})[provider.id] = prices.input + prices.output
        return costs, {p.id: p.priority for p in config.providers}

    def price_book(self, resolve: Callable[[str], str | None] = lambda name: name) -> PriceBook:
        """The prices by (provider, canonical model): `resolve` maps an alias to its model
        (`Config.resolve_model`)."""
        return PriceBook(
            {
                (p.provider, p.model if p.model == "*" else resolve(p.model) or p.model): p.prices()
                for p in self.prices
            }
        )


def spend_problems(config: Config) -> list[tuple[tuple[str | int, ...], str]]:
    """Prices name configured providers and models those providers serve, each pair once."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    served = {p.id: {m.name for m in p.models} for p in config.providers}
    canonical_of = {n: m.name for m in config.models for n in (m.name, *m.aliases)}
    seen: dict[tuple[str, str], int] = {}
    for index, price in enumerate(config.spend.prices):
        where = ("spend", "prices", index)
        if price.provider not in served:
            problems.append(((*where, "provider"), f"unknown provider {price.provider!r}"))
            continue
        if price.endpoint_hour is not None and price.model != "*":
            problems.append(
                (
                    (*where, "endpoint_hour"),
                    "an endpoint-hour prices the provider's endpoints, not one model: give it "
                    'with model "*"',
                )
            )
        if price.model != "*":
            canonical = canonical_of.get(price.model)
            if canonical is None or canonical not in served[price.provider]:
                problems.append(
                    (
                        (*where, "model"),
                        f"provider {price.provider!r} does not serve model {price.model!r}",
                    )
                )
                continue
        pair = (price.provider, price.model)
        if pair in seen:
            problems.append(
                (where, f"duplicate price for {pair} (also spend.prices[{seen[pair]}])")
            )
        seen.setdefault(pair, index)
    tenants: dict[str, int] = {}
    for index, budget in enumerate(config.spend.budgets):
        if budget.tenant in tenants:
            problems.append(
                (
                    ("spend", "budgets", index, "tenant"),
                    f"tenant {budget.tenant!r} has a budget already (spend.budgets"
                    f"[{tenants[budget.tenant]}])",
                )
            )
        tenants.setdefault(budget.tenant, index)
    return problems
