"""When to restart a crashed child of `llmgw up` (pure: the caller passes the time).

Policy: a child that exits after it became ready is restarted after an exponential
backoff (0.5 s, 1 s, 2 s, ... capped). If it exits `max_exits` times within
`window` seconds it is considered broken (a crash loop, not a blip) and the whole
cluster stops with exit code 1: a local cluster with a silently missing engine or
edge would mislead whoever benchmarks or demos with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DEFAULT_MAX_EXITS = 5
DEFAULT_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """What to do after an exit: `restart` after `delay` seconds, or give up."""

    restart: bool
    exits_in_window: int
    max_exits: int
    delay: float


class RestartPolicy:
    """Counts one child's exits in a sliding window. Invariant: delays never exceed `max_delay`."""

    def __init__(
        self,
        max_exits: int = DEFAULT_MAX_EXITS,
        window: float = DEFAULT_WINDOW_S,
        base_delay: float = 0.5,
        max_delay: float = 10.0,
    ) -> None:
        if max_exits < 1:
            raise ValueError(f"max_exits must be >= 1, got {max_exits}")
        self.max_exits = max_exits
        self.window = window
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._exits: deque[float] = deque()

    def record_exit(self, now: float) -> RestartDecision:
        """Register an exit at monotonic time `now` and decide."""
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.window:
            self._exits.popleft()
        count = len(self._exits)
        if count >= self.max_exits:
            return RestartDecision(False, count, self.max_exits, 0.0)
        delay = min(self.base_delay * 2 ** (count - 1), self.max_delay)
        return RestartDecision(True, count, self.max_exits, delay)
