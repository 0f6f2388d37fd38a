"""Time, injected: one object carries the wall clock and the monotonic clock.

A decision or an expiry reads time from the `Clock` it was given, never from `time` directly, so
a test (or a simulation) steps time instead of sleeping through it.

- `wall()`: Unix seconds, for stamps other hosts or later runs read (records, periods, ages
  written to KV, events);
- `monotonic()`: seconds that never step back, for durations and deadlines inside one process
  (idle expiry, renew intervals, grace periods).

`SYSTEM` is the real clock; `SteppedClock` moves only when told (tests, simulations). Durations
measured for metrics (a histogram's latency) and deadlines of I/O waits on the event loop
(`loop.time()`, which `asyncio` itself sleeps by) are not decisions and stay on their own clocks.

Some constructors still take a bare reader (`time.time`, or a stepped clock's `wall`) where their
callers pass one; `wall_of` and `monotonic_of` turn either form into the reader they keep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = [
    "SYSTEM",
    "Clock",
    "SteppedClock",
    "SystemClock",
    "TimeSource",
    "monotonic_of",
    "wall_of",
]

TimeSource = Callable[[], float]
"""A bare reader of seconds (`time.time`, `time.monotonic`, or a `Clock`'s bound method)."""


@runtime_checkable
class Clock(Protocol):
    """Wall and monotonic seconds from one source. Neither call blocks nor raises."""

    def wall(self) -> float: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The host's clocks: `time.time` and `time.monotonic`, called directly (no wrapper)."""

    __slots__ = ()
    wall = staticmethod(time.time)
    monotonic = staticmethod(time.monotonic)


SYSTEM: Clock = SystemClock()


class SteppedClock:
    """Time that moves only when told: `advance(seconds)` (or `now = ...`, `now += ...`). The
    wall and the monotonic time are both `now` (one number, so a step moves both alike, with no
    rounding between them); `tick` moves it by that much at every read (an event log whose every
    entry needs a later stamp)."""

    def __init__(self, now: float = 1_000_000.0, *, tick: float = 0.0) -> None:
        self.now = now
        self.tick = tick

    def wall(self) -> float:
        self.now += self.tick
        return self.now

    def monotonic(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a stepped clock never steps back")
        self.now += seconds


def wall_of(clock: Clock | TimeSource) -> TimeSource:
    """The wall reader of `clock`; a bare reader (the older form) is itself the reader."""
    return clock.wall if isinstance(clock, Clock) else clock


def monotonic_of(clock: Clock | TimeSource) -> TimeSource:
    """The monotonic reader of `clock`; a bare reader (the older form) is itself the reader."""
    return clock.monotonic if isinstance(clock, Clock) else clock
