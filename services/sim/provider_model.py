"""The third-party provider model (pure): rate drift, token-bucket rate limit, token pacing.

Unlike an engine, a provider paces each request on its own (no batching, no KV cache):
first token after base_latency + prompt_tokens / input_tokens_per_second, then one token every
1 / rate(t) seconds, where rate(t) follows the drift schedule (t = seconds since the provider
started). A rate of 0 means "no pacing": the tokens are due at once.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from llmgw.services.sim.params import ProviderParams

__all__ = ["ConcurrencyLimit", "RateLimited", "RateSchedule", "TokenBucket", "token_times"]


class RateLimited(Exception):
    """Over the provider's limits; `retry_after` is the advised wait in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateSchedule:
    """Output tokens/s as a function of seconds since start (`ProviderParams.drift`)."""

    def __init__(self, params: ProviderParams) -> None:
        self.base = params.tokens_per_second
        self.times = [point.at for point in params.drift]
        self.rates = [point.tokens_per_second for point in params.drift]
        self.linear = params.drift_mode == "linear"
        self.period = params.drift_period

    def rate_at(self, elapsed: float) -> float:
        if not self.times:
            return self.base
        if self.period is not None:
            elapsed %= self.period
        index = bisect.bisect_right(self.times, elapsed) - 1
        if index < 0:
            # Before the first point: the base rate (linear mode ramps from it, starting at 0 s).
            if self.linear and self.times[0] > 0:
                return self.base + (self.rates[0] - self.base) * elapsed / self.times[0]
            return self.base
        if not self.linear or index + 1 >= len(self.times):
            return self.rates[index]
        t0, t1 = self.times[index], self.times[index + 1]
        r0, r1 = self.rates[index], self.rates[index + 1]
        return r0 + (r1 - r0) * (elapsed - t0) / (t1 - t0) if t1 > t0 else r1


def token_times(schedule: RateSchedule, origin: float, first_at: float, count: int) -> list[float]:
    """Absolute due times of `count` tokens; the first at `first_at`, then paced by the schedule."""
    times = [first_at] * count
    at = first_at
    for index in range(1, count):
        rate = schedule.rate_at(at - origin)
        if rate > 0:
            at += 1.0 / rate
        times[index] = at
    return times


@dataclass(slots=True)
class TokenBucket:
    """`rate` requests/s refill, at most `capacity` stored; starts full."""

    rate: float
    capacity: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> TokenBucket:
        return cls(rate=rate, capacity=capacity, tokens=capacity, updated=now)

    def try_take(self, now: float) -> float:
        """Take one token; returns 0 on success, else the seconds until one is available."""
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(slots=True)
class ConcurrencyLimit:
    """At most `limit` requests in flight (None: unlimited)."""

    limit: int | None
    in_flight: int = 0

    def try_acquire(self) -> bool:
        if self.limit is not None and self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1


def retry_after_header(seconds: float, floor: int) -> int:
    """Whole seconds for ``Retry-After``: at least `floor`, rounded up."""
    return max(floor, math.ceil(seconds))
