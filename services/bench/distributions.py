"""Integer length distributions written as short strings (pure; the caller passes the rng).

Grammar (whitespace ignored):

- ``fixed:N`` or just ``N``: always N;
- ``uniform:A-B`` or just ``A-B``: an integer in A..B inclusive, each equally likely;
- ``lognormal:mean=M,sigma=S[,min=A][,max=B]``: ``round(X)`` for a lognormal X whose mean is M
  before clipping (mu = ln M - S^2/2), then clipped to A..B (A defaults to 1, B to no bound).

Invariants: every `Distribution` draws integers within ``low..high`` (``high`` None: unbounded),
``low >= 1``; `parse_distribution` of a distribution's `spec` gives an equal distribution; the
draws depend only on the rng's state.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = [
    "Distribution",
    "DistributionError",
    "Fixed",
    "LogNormal",
    "Uniform",
    "parse_distribution",
]


class DistributionError(ValueError):
    """A distribution string that does not follow the grammar (the message says why)."""


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        if self.value < 1:
            raise DistributionError(f"fixed value must be >= 1, got {self.value}")

    @property
    def low(self) -> int:
        return self.value

    @property
    def high(self) -> int:
        return self.value

    @property
    def mean(self) -> float:
        return float(self.value)

    @property
    def spec(self) -> str:
        return f"fixed:{self.value}"

    def sample(self, rng: random.Random) -> int:
        return self.value


@dataclass(frozen=True, slots=True)
class Uniform:
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise DistributionError(f"uniform needs 1 <= A <= B, got {self.low}-{self.high}")

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    @property
    def spec(self) -> str:
        return f"uniform:{self.low}-{self.high}"

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class LogNormal:
    mean_value: float
    sigma: float
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean_value) and self.mean_value > 0):
            raise DistributionError(f"lognormal mean must be > 0, got {self.mean_value}")
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise DistributionError(f"lognormal sigma must be > 0, got {self.sigma}")
        if self.low < 1:
            raise DistributionError(f"lognormal min must be >= 1, got {self.low}")
        if self.high is not None and self.high < self.low:
            raise DistributionError(f"lognormal max ({self.high}) is below min ({self.low})")

    @property
    def mean(self) -> float:
        """The mean before clipping (what ``mean=`` says)."""
        return self.mean_value

    @property
    def spec(self) -> str:
        text = f"lognormal:mean={_number(self.mean_value)},sigma={_number(self.sigma)}"
        if self.low != 1:
            text += f",min={self.low}"
        if self.high is not None:
            text += f",max={self.high}"
        return text

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean_value) - self.sigma * self.sigma / 2
        value = round(rng.lognormvariate(mu, self.sigma))
        value = max(self.low, value)
        return value if self.high is None else min(self.high, value)


Distribution = Fixed | Uniform | LogNormal


def parse_distribution(text: str) -> Distribution:
    """The distribution a string describes (see the module docstring); DistributionError if bad."""
    compact = "".join(text.split())
    kind, sep, rest = compact.partition(":")
    if not sep:
        kind, rest = ("uniform" if "-" in compact else "fixed"), compact
    kind = kind.lower()
    if kind == "fixed":
        return Fixed(_int(rest, text))
    if kind == "uniform":
        low, dash, high = rest.partition("-")
        if not dash:
            raise DistributionError(f"{text!r}: uniform needs A-B, e.g. uniform:64-512")
        return Uniform(_int(low, text), _int(high, text))
    if kind == "lognormal":
        return _lognormal(rest, text)
    raise DistributionError(
        f"{text!r}: unknown distribution {kind!r} (use fixed:N, uniform:A-B or "
        "lognormal:mean=M,sigma=S[,min=A][,max=B])"
    )


def _lognormal(rest: str, text: str) -> LogNormal:
    fields: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("mean", "sigma", "min", "max") or key in fields:
            raise DistributionError(
                f"{text!r}: lognormal takes mean=M,sigma=S[,min=A][,max=B] once each"
            )
        fields[key] = value
    missing = [key for key in ("mean", "sigma") if key not in fields]
    if missing:
        raise DistributionError(f"{text!r}: lognormal needs {' and '.join(missing)}")
    return LogNormal(
        mean_value=_float(fields["mean"], text),
        sigma=_float(fields["sigma"], text),
        low=_int(fields["min"], text) if "min" in fields else 1,
        high=_int(fields["max"], text) if "max" in fields else None,
    )


def _number(value: float) -> str:
    """Shortest text that parses back to exactly `value` (``200``, ``0.6``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _int(value: str, text: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistributionError(f"{text!r}: {value!r} is not an integer") from None


def _float(value: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise DistributionError(f"{text!r}: {value!r} is not a number") from None
