"""Prices and spend: what a request's tokens cost, in exact integer money.

Money is an integer count of **picos** (10^-12 of the currency's unit, e.g. of a dollar), never a
float: a price is given per million tokens with at most six decimals, i.e. an integer number of
micro-units per million tokens, and micro-units per million tokens times tokens is picos per
token times tokens, exactly. Sums of picos are exact, so "to the cent" is a rounding at the end
(`format_money`), never an accumulated error.

What is priced (`TokenPrices`): input tokens not read from the provider's prefix cache, cached
input tokens (``prompt_tokens_details.cached_tokens``; the input price when not given) and output
tokens. `PriceBook` finds the prices of a (provider, model) pair: the pair's own entry, else the
provider's ``*`` entry, else none (free: our own engines without an endpoint-hour cost).

`SpendTotals` adds attempts up per (key, tenant, provider, model): requests, tokens and picos.
`period_of` names the day or month a timestamp falls in (UTC), the unit spend is kept per. In the
spend bucket each edge's totals of a day are the entry ``spend.<day>.<edge>`` (`spend_key`),
written by admission and read by `llmgw spend` and `llmgw keys`.

Pure: no clock (timestamps are passed in), no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any, Protocol, TypeVar

__all__ = [
    "MICROS",
    "PICOS",
    "SPEND_KEY_PREFIX",
    "PriceBook",
    "PromptCalibration",
    "SpendRow",
    "SpendTotals",
    "TokenPrices",
    "TokenUse",
    "billed_use",
    "cheaper_first",
    "estimate_input_tokens",
    "estimated_output",
    "fleet_cost",
    "format_money",
    "micros_of",
    "money_of",
    "period_of",
    "periods_between",
    "spend_key",
    "spread_fleet_cost",
]

MICROS = 1_000_000  # micro-units per unit: prices are micro-units per million tokens
PICOS = 1_000_000_000_000  # picos per unit: what a cost is counted in
_TOKENS_PER_PRICE = 1_000_000  # a price is per million tokens
_MAX_DECIMALS = 6
SPEND_KEY_PREFIX = "spend."  # the spend bucket's entries of every edge's daily totals


def spend_key(day: str, edge: str) -> str:
    """The spend bucket's entry of one edge's totals of one day."""
    return f"{SPEND_KEY_PREFIX}{day}.{edge}"


def micros_of(value: object) -> int:
    """A non-negative amount given in units (a number or a decimal string) as micro-units.

    Raises ValueError (the message says why) for a negative, non-numeric, non-finite amount or one
    with more than six decimals; a bool is not an amount.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        # A float goes through its shortest repr: 0.6 is 0.6, not 0.59999999999999997779.
        amount = Decimal(repr(value)) if isinstance(value, float) else Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"expected a number, got {value!r}") from None
    if not amount.is_finite():
        raise ValueError(f"expected a finite number, got {value!r}")
    if amount < 0:
        raise ValueError(f"expected a number >= 0, got {value!r}")
    scaled = amount * MICROS
    if scaled != scaled.to_integral_value():
        raise ValueError(f"at most {_MAX_DECIMALS} decimals, got {value!r}")
    return int(scaled)


def money_of(picos: int) -> Decimal:
    """Picos as an exact Decimal amount of the currency's unit."""
    return Decimal(picos) / PICOS


def format_money(picos: int, places: int = 2) -> str:
    """Picos rounded half up to `places` decimals ("12.35"): the one rounding spend gets."""
    quantum = Decimal(1).scaleb(-places)
    return str(money_of(picos).quantize(quantum, rounding=ROUND_HALF_UP))


@dataclass(frozen=True, slots=True)
class TokenUse:
    """Tokens of one attempt, as its provider counted them (or as the edge estimated them for a
    stream cut short before its usage). `cached` is the part of `input` read from a cache."""

    input: int = 0
    cached: int = 0
    output: int = 0

    def __post_init__(self) -> None:
        if min(self.input, self.cached, self.output) < 0:
            raise ValueError("token counts are >= 0")


@dataclass(frozen=True, slots=True)
class TokenPrices:
    """Micro-units per million tokens. `cached_input` None: cached tokens cost `input`."""

    input: int = 0
    output: int = 0
    cached_input: int | None = None

    def cost(self, use: TokenUse) -> int:
        """Picos of `use`, exactly (micro-units per million tokens x tokens = picos)."""
        cached = min(use.cached, use.input)
        cached_price = self.input if self.cached_input is None else self.cached_input
        return self.input * (use.input - cached) + cached_price * cached + self.output * use.output

    @property
    def free(self) -> bool:
        return self.input == 0 and self.output == 0 and not self.cached_input


@dataclass(frozen=True, slots=True)
class PriceBook:
    """Prices by (provider, model); a provider's ``*`` model prices its models not listed."""

    prices: Mapping[tuple[str, str], TokenPrices] = field(default_factory=dict)

    def for_pair(self, provider: str, model: str) -> TokenPrices | None:
        found = self.prices.get((provider, model))
        if found is None:
            found = self.prices.get((provider, "*"))
        return found

    def cost(self, provider: str, model: str, use: TokenUse) -> int:
        prices = self.for_pair(provider, model)
        return prices.cost(use) if prices is not None else 0

    def most_per_token(self, providers: Iterable[str], model: str) -> TokenPrices:
        """The highest input and output prices among `providers` for `model` (an estimate's
        worst case before placement decides where a request runs)."""
        worst_in = worst_out = 0
        for provider in providers:
            prices = self.for_pair(provider, model)
            if prices is not None:
                worst_in = max(worst_in, prices.input)
                worst_out = max(worst_out, prices.output)
        return TokenPrices(input=worst_in, output=worst_out)


# ---- aggregation ---------------------------------------------------------------------------------

SpendKey = tuple[str, str, str, str]  # (key id or "", tenant or "", provider, model)


@dataclass(slots=True)
class SpendRow:
    """One (key, tenant, provider, model)'s attempts and what they cost."""

    requests: int = 0
    input: int = 0
    cached: int = 0
    output: int = 0
    picos: int = 0
    fleet: int = 0  # of `picos`: its part of our engines' endpoint-hours (reports only)

    def add(self, use: TokenUse, picos: int, requests: int = 1) -> None:
        self.requests += requests
        self.input += use.input
        self.cached += use.cached
        self.output += use.output
        self.picos += picos

    def merge(self, other: SpendRow) -> None:
        self.requests += other.requests
        self.input += other.input
        self.cached += other.cached
        self.output += other.output
        self.picos += other.picos
        self.fleet += other.fleet

    def as_list(self) -> list[int]:
        return [self.requests, self.input, self.cached, self.output, self.picos]

    @classmethod
    def from_list(cls, values: Iterable[int]) -> SpendRow:
        requests, input_, cached, output, picos = (int(v) for v in values)
        if min(requests, input_, cached, output, picos) < 0:
            raise ValueError("spend counts are >= 0")
        return cls(requests, input_, cached, output, picos)


@dataclass(slots=True)
class SpendTotals:
    """Rows by (key, tenant, provider, model). Totals, not deltas: a later copy of one
    writer's totals replaces the earlier one, so a lost or repeated copy does no harm."""

    rows: dict[SpendKey, SpendRow] = field(default_factory=dict)

    def add(self, where: SpendKey, use: TokenUse, picos: int) -> None:
        row = self.rows.get(where)
        if row is None:
            row = self.rows[where] = SpendRow()
        row.add(use, picos)

    def merge(self, other: SpendTotals) -> None:
        for where, row in other.rows.items():
            mine = self.rows.get(where)
            if mine is None:
                mine = self.rows[where] = SpendRow()
            mine.merge(row)

    def __iter__(self) -> Iterator[tuple[SpendKey, SpendRow]]:
        return iter(self.rows.items())

    @property
    def picos(self) -> int:
        return sum(row.picos for row in self.rows.values())

    def grouped(self, *fields: str) -> dict[tuple[str, ...], SpendRow]:
        """Rows summed by some of ``key``, ``tenant``, ``provider``, ``model``."""
        index = {"key": 0, "tenant": 1, "provider": 2, "model": 3}
        positions = [index[f] for f in fields]
        out: dict[tuple[str, ...], SpendRow] = {}
        for where, row in self.rows.items():
            group = tuple(where[p] for p in positions)
            target = out.get(group)
            if target is None:
                target = out[group] = SpendRow()
            target.merge(row)
        return out

    def to_wire(self) -> list[list[str | int]]:
        return [[*where, *row.as_list()] for where, row in sorted(self.rows.items())]

    @classmethod
    def from_wire(cls, rows: Iterable[Iterable[object]]) -> SpendTotals:
        totals = cls()
        for raw in rows:
            values = list(raw)
            if len(values) != 9:
                raise ValueError("a spend row has 9 fields")
            key, tenant, provider, model = (str(v) for v in values[:4])
            totals.rows[(key, tenant, provider, model)] = SpendRow.from_list(values[4:])  # type: ignore[arg-type]
        return totals


# ---- our fleet's cost, spread over the tokens it served -------------------------------------------


def spread_fleet_cost(totals: SpendTotals, fleet: Mapping[str, int]) -> dict[SpendKey, int]:
    """Each row's part of its provider's fleet cost (`fleet`: picos per provider, e.g. a day of
    its endpoints' hours), in proportion to the tokens (input + output) the row was served;
    exact: the parts of a provider sum to its cost (largest remainders get the odd picos). A
    provider that served no tokens spreads nothing."""
    parts: dict[SpendKey, int] = {}
    for provider, cost in fleet.items():
        rows = [(w, r.input + r.output) for w, r in totals.rows.items() if w[2] == provider]
        served = sum(tokens for _, tokens in rows)
        if served <= 0 or cost <= 0:
            continue
        shares = [(w, cost * tokens // served, cost * tokens % served) for w, tokens in rows]
        left = cost - sum(share for _, share, _ in shares)
        ranked = sorted(shares, key=lambda s: (-s[2], s[0]))
        for index, (where, share, _) in enumerate(ranked):
            parts[where] = share + (1 if index < left else 0)
    return parts


def fleet_cost(micros_per_hour: int, endpoints: int, seconds: float) -> int:
    """Picos of `endpoints` endpoints at `micros_per_hour` for `seconds`."""
    return micros_per_hour * 1_000_000 * endpoints * round(seconds) // 3600


# ---- periods -------------------------------------------------------------------------------------


def period_of(timestamp: float, period: str = "day") -> str:
    """The UTC day (``2026-12-03``) or month (``2026-12``) `timestamp` falls in."""
    parts = datetime.fromtimestamp(math.floor(timestamp), UTC)
    if period == "day":
        return f"{parts.year:04d}-{parts.month:02d}-{parts.day:02d}"
    if period == "month":
        return f"{parts.year:04d}-{parts.month:02d}"
    raise ValueError(f"period: expected day or month, got {period!r}")


def periods_between(first: float, last: float) -> list[str]:
    """Every UTC day from `first` to `last` (inclusive), oldest first."""
    days: list[str] = []
    at = math.floor(first / 86_400) * 86_400
    while at <= last:
        days.append(period_of(at))
        at += 86_400
    return days


# ---- what an attempt is billed for ---------------------------------------------------------------

_WARM = 32  # observations before only streams calibrate (an estimate per request costs ~1 us)
_PIECE = re.compile(r"\w{1,4}|[^\w\s]")
_TOKENS_PER_MESSAGE = 4  # a chat template's role markers around each message


def estimate_input_tokens(body: Mapping[str, object]) -> int:
    """Prompt tokens of a chat, completions or embeddings body, estimated from its text: a
    token is a run of at most four letters or digits, or one other visible character (about
    what a BPE vocabulary makes of English), plus a chat template's few per message; no
    tokenizer (`PromptCalibration` scales it to a provider's)."""
    tokens = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            tokens += _TOKENS_PER_MESSAGE
            if isinstance(message, Mapping):
                tokens += _text_tokens(message.get("content"))
    for name in ("prompt", "input"):
        tokens += _text_tokens(body.get(name))
    return tokens


def estimated_output(body: Mapping[str, object], default: int) -> int:
    """Output tokens a request may produce: its ``max_completion_tokens`` or ``max_tokens``,
    else `default`."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def _text_tokens(value: object) -> int:
    if isinstance(value, str):
        return len(_PIECE.findall(value))
    if isinstance(value, list):
        total = 0
        for item in value:
            if isinstance(item, str):
                total += len(_PIECE.findall(item))
            elif isinstance(item, Mapping) and isinstance(item.get("text"), str):
                total += len(_PIECE.findall(item["text"]))
            elif isinstance(item, int):  # a prompt given as token ids
                total += 1
        return total
    return 0


@dataclass(slots=True)
class PromptCalibration:
    """How a provider's tokenizer counts prompts against `estimate_input_tokens`: the ratio of
    real to estimated prompt tokens over its recent requests with a usage (each observation
    weighs `1 - decay` of the sums, so the ratio follows a change of traffic)."""

    real: float = 0.0
    estimated: float = 0.0
    decay: float = 0.98
    seen: int = 0

    @property
    def warm(self) -> bool:
        """Enough observations that non-streamed requests need not add theirs."""
        return self.seen >= _WARM

    def observe(self, estimated: int, real: int) -> None:
        if estimated <= 0:
            return
        self.seen += 1
        self.real = self.real * self.decay + real
        self.estimated = self.estimated * self.decay + estimated

    def scale(self, estimated: int) -> int:
        if self.estimated <= 0:
            return estimated
        return round(estimated * self.real / self.estimated)


def billed_use(
    usage: object,
    relayed: int,
    body: Mapping[str, object],
    chat: bool,
    calibration: PromptCalibration | None = None,
) -> TokenUse:
    """The tokens an attempt is billed for: its provider's usage (an object with
    ``input_tokens``, ``output_tokens``, ``cached_tokens``) when it had one; else, for a stream
    cut short after `relayed` data events, those events as output (a chat stream's first event
    carries the role, no token) and the body's estimated prompt, scaled by `calibration`; else
    nothing. A stream's usage calibrates the estimate of the streams that will have none."""
    if usage is not None:
        real = usage.input_tokens  # type: ignore[attr-defined]
        if calibration is not None and (relayed > 0 or not calibration.warm):
            calibration.observe(estimate_input_tokens(body), real)
        return TokenUse(
            input=real,
            cached=getattr(usage, "cached_tokens", 0),
            output=usage.output_tokens,  # type: ignore[attr-defined]
        )
    output = relayed - 1 if chat else relayed
    if output <= 0:
        return TokenUse()
    estimated = estimate_input_tokens(body)
    if calibration is not None:
        estimated = calibration.scale(estimated)
    return TokenUse(input=estimated, output=output)


# ---- cost-aware overflow ---------------------------------------------------------------------------


class _Provider(Protocol):
    """What `cheaper_first` reads of a placement provider (`llmgw.core.placement.ProviderState`)."""

    @property
    def id(self) -> str: ...

    @property
    def managed(self) -> bool: ...

    @property
    def endpoints(self) -> Sequence[Any]: ...


P = TypeVar("P", bound=_Provider)


def cheaper_first(
    providers: Sequence[P],
    cost: Mapping[str, int],
    priority: Mapping[str, int],
    min_speed: float,
) -> tuple[P, ...]:
    """`providers` with each run of unlimited providers of equal `priority` ordered cheapest
    first (`cost`: a provider's price of a million input plus a million output tokens of the
    model; unpriced: 0), except that a provider the rate balancer finds too slow goes after the
    fast enough: its best endpoint's ``rate_weight`` (the probability of beating the SLA) below
    `min_speed` x the best of the run. Unknown weights count as fast enough (the balancer
    explores them). Managed providers and every other order stay as they are; ties keep the
    config's order. `min_speed` 0: always the cheaper; above 1: cost never reorders."""
    if min_speed > 1:
        return tuple(providers)
    out = list(providers)
    start = 0
    while start < len(out):
        end = start + 1
        head = out[start]
        if not head.managed:
            while (
                end < len(out)
                and not out[end].managed
                and priority.get(out[end].id) == priority.get(head.id)
            ):
                end += 1
        if end - start > 1:
            out[start:end] = _by_cost(out[start:end], cost, min_speed)
        start = end
    return tuple(out)


def _by_cost(run: list[P], cost: Mapping[str, int], min_speed: float) -> list[P]:
    speeds = {p.id: _speed(p) for p in run}
    best = max((s for s in speeds.values() if s is not None), default=None)

    def rank(p: P) -> tuple[bool, int]:
        speed = speeds[p.id]
        slow = best is not None and speed is not None and speed < min_speed * best
        return (slow, cost.get(p.id, 0))

    return sorted(run, key=rank)  # stable: ties keep the config's order


def _speed(provider: _Provider) -> float | None:
    weights = [
        e.rate_weight
        for e in provider.endpoints
        if getattr(e, "usable", True) and getattr(e, "rate_weight", None) is not None
    ]
    return max(weights) if weights else None
