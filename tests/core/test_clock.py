"""`llmgw.clock`: one object for wall and monotonic time; a stepped one for tests."""

from __future__ import annotations

import time

import pytest

from llmgw.clock import SYSTEM, Clock, SteppedClock, monotonic_of, wall_of


def test_the_system_clock_reads_the_hosts_clocks() -> None:
    before_wall, before_monotonic = time.time(), time.monotonic()
    wall, monotonic = SYSTEM.wall(), SYSTEM.monotonic()
    assert before_wall <= wall <= time.time()
    assert before_monotonic <= monotonic <= time.monotonic()
    assert isinstance(SYSTEM, Clock)


def test_a_stepped_clock_moves_only_when_told_and_never_back() -> None:
    clock = SteppedClock(500.0)
    assert (clock.wall(), clock.monotonic()) == (500.0, 500.0)
    assert (clock.wall(), clock.monotonic()) == (500.0, 500.0)  # no time passes by itself
    clock.advance(2.5)
    assert (clock.wall(), clock.monotonic()) == (502.5, 502.5)
    with pytest.raises(ValueError):
        clock.advance(-1.0)
    ticking = SteppedClock(0.0, tick=1.0)
    assert [ticking.wall(), ticking.monotonic(), ticking.wall()] == [1.0, 2.0, 3.0]


def test_a_bare_reader_is_its_own_reader_and_a_clock_gives_its_own() -> None:
    clock = SteppedClock(7.0)
    assert wall_of(clock)() == 7.0 and monotonic_of(clock)() == 7.0
    clock.advance(1.0)
    assert wall_of(clock)() == 8.0  # bound to the clock, not a copy of its time
    assert wall_of(time.time) is time.time and monotonic_of(time.monotonic) is time.monotonic
    assert wall_of(SYSTEM) is time.time and monotonic_of(SYSTEM) is time.monotonic
