"""The probabilistic rate balancer: pick the deployment most likely to deliver a good token
rate.

Pure: samples, ``now`` and the randomness (a `random.Random`) come from the caller.

Per deployment, a sliding window (``window`` seconds) of per-request samples. A sample's
*effective rate* is (output tokens + input tokens / input_to_output_token_ratio) / latency; a
failed request is a sample with zero tokens (rate 0). On each choice:

- SLA = the ``greediness`` percentile of all deployments' rates in the window;
- weight of a deployment = P(rate > SLA) under a normal fit of its own rates;
- one deployment is drawn at random with those weights.

The edge cases, and the choices made there (docs/architecture.md, "Rate balancer"):

- ``window`` 0 or ``greediness`` 0: unordered round robin (equal weights);
- *exploration instead of a global bootstrap*: a global bootstrap gives every deployment equal
  weight while any one lacks samples (forgetting what was learned), and a deployment that went
  quiet is never sampled again, so it can never win its traffic back. Here a
  deployment without samples in the window (new, or ignored for longer than the window because it
  was slow or failing) is explored: it gets the best learned weight, so it is tried again soon,
  while the others keep their learned weights, but only ``max_exploring`` requests at a time go
  to it until its first sample returns (no herd onto an unknown, possibly slow deployment). A
  deployment that degraded stops being chosen within a few samples; one that recovered is found
  again within one window;
- *no NaN*: a window whose rates are all equal has no spread (a normal fit would divide by
  zero); it is taken as a point mass: weight 1 if its rate is above the SLA, else 0. If every
  weight is 0, all deployments share equally;
- rates are learned from every edge's traffic: edges publish per-request samples on NATS and
  every admission instance feeds them here (``services/admission/balancing.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BalancerSettings",
    "RateSample",
    "RateWindows",
    "choose",
    "effective_rate",
    "weights",
]

EPSILON_RATE = 1e-10  # keeps a sample's rate strictly positive
_MIN_LATENCY = 1e-6


@dataclass(frozen=True, slots=True)
class BalancerSettings:
    """``window`` seconds >= 0; ``input_to_output_token_ratio`` > 0; 0 <= ``greediness`` <= 1.

    The warnings for extreme greediness (below 0.2: close to unordered round robin; above 0.95:
    may stick to a local maximum for a whole window) are the config's (`balancer`).
    """

    window: float = 120.0
    input_to_output_token_ratio: float = 250.0
    greediness: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window) and self.window >= 0):
            raise ValueError(f"window must be a finite number >= 0, got {self.window}")
        if not (
            math.isfinite(self.input_to_output_token_ratio) and self.input_to_output_token_ratio > 0
        ):
            raise ValueError(
                f"input_to_output_token_ratio must be > 0, got {self.input_to_output_token_ratio}"
            )
        if not 0 <= self.greediness <= 1:
            raise ValueError(f"greediness must be between 0 and 1, got {self.greediness}")

    @property
    def round_robin(self) -> bool:
        return self.window == 0 or self.greediness == 0


@dataclass(frozen=True, slots=True)
class RateSample:
    """One finished request: when it ended, how long it took, and the tokens it moved.

    A failed request has zero tokens (its rate is then EPSILON_RATE).
    """

    at: float
    latency: float
    output_tokens: int = 0
    input_tokens: int = 0


def effective_rate(sample: RateSample, input_to_output_token_ratio: float) -> float:
    tokens = sample.output_tokens + sample.input_tokens / input_to_output_token_ratio
    return tokens / max(sample.latency, _MIN_LATENCY) + EPSILON_RATE


class RateWindows:
    """The samples of each deployment within the sliding window (oldest first)."""

    def __init__(self, settings: BalancerSettings) -> None:
        self.settings = settings
        self._samples: dict[str, deque[tuple[float, float]]] = {}  # id -> (at, rate)

    def add(self, deployment: str, sample: RateSample) -> None:
        rate = effective_rate(sample, self.settings.input_to_output_token_ratio)
        samples = self._samples.setdefault(deployment, deque())
        if samples and sample.at < samples[-1][0]:  # a late report: keep the deque ordered
            ordered = sorted([*samples, (sample.at, rate)])
            samples.clear()
            samples.extend(ordered)
        else:
            samples.append((sample.at, rate))

    def rates(self, deployment: str, now: float) -> list[float]:
        """The deployment's rates still inside the window at ``now``."""
        samples = self._samples.get(deployment)
        if not samples:
            return []
        while samples and now - samples[0][0] >= self.settings.window:
            samples.popleft()
        return [rate for _, rate in samples]

    def snapshot(self, deployments: Iterable[str], now: float) -> dict[str, list[float]]:
        return {d: self.rates(d, now) for d in deployments}


def _probability_above(rates: Sequence[float], sla: float) -> float:
    mu = math.fsum(rates) / len(rates)
    sigma = math.sqrt(math.fsum((x - mu) ** 2 for x in rates) / len(rates))
    if sigma <= 1e-12 * max(1.0, abs(mu)):  # no spread: a point mass, P(X > sla), never NaN
        return 1.0 if mu > sla else 0.0
    # The normal survival function, P(X > sla) for X ~ N(mu, sigma): math, not scipy, whose
    # import alone costs a second or more at every service's start.
    return 0.5 * math.erfc((sla - mu) / (sigma * math.sqrt(2.0)))


def _percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, q in 0..1."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def weights(
    rates: Mapping[str, Sequence[float]],
    settings: BalancerSettings,
    exploring: Mapping[str, int] | None = None,
    max_exploring: int = 1,
) -> dict[str, float]:
    """Each deployment's weight (>= 0, finite, at least one > 0), from its rates in the window.

    A deployment without samples is explored with the best learned weight, but only while fewer
    than `max_exploring` requests are already on their way to it (``exploring``: in-flight
    requests per deployment): otherwise one unexplored deployment would take nearly every
    concurrent pick until its first sample returns (a herd onto what may be the slowest one).
    Beyond the cap it weighs 0 while any other deployment has weight.
    """
    if not rates:
        return {}
    if settings.round_robin:
        return dict.fromkeys(rates, 1.0)
    known = {d: r for d, r in rates.items() if r}
    if not known:
        return dict.fromkeys(rates, 1.0)
    everything = [rate for r in known.values() for rate in r]
    sla = _percentile(everything, settings.greediness)
    learned = {d: _probability_above(r, sla) for d, r in known.items()}
    best = max(learned.values())
    busy = exploring or {}
    result = {
        d: learned[d] if d in learned else (best if busy.get(d, 0) < max_exploring else 0.0)
        for d in rates
    }
    if not any(w > 0 for w in result.values()):
        return dict.fromkeys(rates, 1.0)
    return result


class WeightedChoice(Protocol):
    """What `choose` needs of its randomness (`random.Random` has it)."""

    def choices(self, population: Sequence[str], weights: Sequence[float]) -> list[str]: ...


def choose(weighted: Mapping[str, float], rng: WeightedChoice) -> str:
    """A deployment drawn with probability proportional to its weight."""
    if not weighted:
        raise ValueError("no deployment to choose from")
    ids = list(weighted)
    return rng.choices(ids, [weighted[d] for d in ids])[0]
