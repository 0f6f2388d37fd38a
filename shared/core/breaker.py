"""Cooldowns and circuit breakers per endpoint: keep traffic away from one that is failing.

Pure: outcomes, ``now`` and the randomness for jitter come from the caller.

Per endpoint, three states:

- **closed**: traffic flows; consecutive failures are counted, a success resets the count;
- **open**: after ``failure_threshold`` consecutive failures, or at once when the endpoint
  answered 429/503 with Retry-After or refused the connection (``at_once``: nothing serves
  there, so every request sent before the threshold would fail too), no traffic until the
  cooldown ends: ``cooldown`` (or the Retry-After, if longer) times a jitter in [1, 1 + jitter),
  so breakers opened together (one bad minute seen by every instance) do not all close in the
  same instant: no thundering herd;
- **half open**: after the cooldown, exactly one request (the probe) may go; its success closes
  the breaker, its failure opens it again for a doubled cooldown (capped at 8x). A probe that
  never reports frees the slot after ``probe_timeout``.

``failure_threshold`` 1 is pure cooldown behaviour (router.failure_threshold).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["BreakerBoard", "BreakerSettings", "BreakerState"]

MAX_BACKOFF = 8


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 3
    cooldown: float = 15.0
    jitter: float = 0.2
    probe_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if self.cooldown < 0 or self.jitter < 0 or self.probe_timeout <= 0:
            raise ValueError("cooldown and jitter must be >= 0, probe_timeout > 0")


@dataclass(slots=True)
class _Endpoint:
    failures: int = 0
    open_until: float | None = None
    backoff: int = 1
    probe_since: float | None = field(default=None)


class BreakerBoard:
    """Breaker state of every endpoint; unknown endpoints are closed."""

    def __init__(self, settings: BreakerSettings, jitter: Callable[[], float]) -> None:
        """``jitter()`` returns a number in [0, 1) (e.g. `random.Random.random`)."""
        self.settings = settings
        self._jitter = jitter
        self._endpoints: dict[str, _Endpoint] = {}

    def state(self, endpoint: str, now: float) -> BreakerState:
        e = self._endpoints.get(endpoint)
        if e is None or e.open_until is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < e.open_until else BreakerState.HALF_OPEN

    def available(self, endpoint: str, now: float) -> bool:
        """May a request go there now? (Does not take the half-open probe: see `take`.)"""
        e = self._endpoints.get(endpoint)
        if e is None or e.open_until is None:  # closed (`state`, read inline: every request)
            return True
        if now < e.open_until:  # open
            return False
        return e.probe_since is None or now - e.probe_since >= self.settings.probe_timeout

    def take(self, endpoint: str, now: float) -> None:
        """A request was sent there: in half open, it is the probe."""
        e = self._endpoints.get(endpoint)
        if e is not None and self.state(endpoint, now) is BreakerState.HALF_OPEN:
            e.probe_since = now

    def record(
        self,
        endpoint: str,
        ok: bool,
        now: float,
        retry_after: float | None = None,
        *,
        at_once: bool = False,
    ) -> None:
        """A finished request's outcome (from any instance's traffic). ``at_once``: a failure
        that opens the breaker without waiting for the threshold (the connection was refused)."""
        e = self._endpoints.setdefault(endpoint, _Endpoint())
        if ok:
            self._endpoints[endpoint] = _Endpoint()
            return
        half_open = self.state(endpoint, now) is BreakerState.HALF_OPEN
        e.failures += 1
        if (
            retry_after is None
            and not at_once
            and e.failures < self.settings.failure_threshold
            and not half_open
        ):
            return
        if half_open:
            e.backoff = min(e.backoff * 2, MAX_BACKOFF)
        cooldown = max(self.settings.cooldown * e.backoff, retry_after or 0.0)
        e.open_until = now + cooldown * (1 + self.settings.jitter * self._jitter())
        e.probe_since = None

    def open_endpoints(self, now: float) -> list[str]:
        return [e for e in self._endpoints if self.state(e, now) is not BreakerState.CLOSED]
