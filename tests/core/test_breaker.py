"""Cooldowns and circuit breakers: open after failures, one half-open probe, jittered recovery."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.breaker import BreakerBoard, BreakerSettings, BreakerState

SETTINGS = BreakerSettings(failure_threshold=3, cooldown=10, jitter=0.2, probe_timeout=5)


def board(seed: int = 1) -> BreakerBoard:
    return BreakerBoard(SETTINGS, random.Random(seed).random)


def test_consecutive_failures_open_the_breaker_and_a_success_resets_the_count():
    b = board()
    b.record("e", False, 0)
    b.record("e", False, 1)
    b.record("e", True, 2)
    b.record("e", False, 3)
    b.record("e", False, 4)
    assert b.state("e", 4) is BreakerState.CLOSED and b.available("e", 4)
    b.record("e", False, 5)
    assert b.state("e", 5) is BreakerState.OPEN and not b.available("e", 5)


def test_after_the_cooldown_exactly_one_probe_goes_and_its_success_closes():
    b = board()
    for t in range(3):
        b.record("e", False, t)
    assert not b.available("e", 11)  # opened at 2: closed again at 12..14 at the earliest
    later = 15
    assert b.state("e", later) is BreakerState.HALF_OPEN and b.available("e", later)
    b.take("e", later)
    assert not b.available("e", later + 1)  # the probe is out: nobody else
    b.record("e", True, later + 2)
    assert b.state("e", later + 2) is BreakerState.CLOSED


def test_a_failed_probe_doubles_the_cooldown():
    b = board()
    for t in range(3):
        b.record("e", False, t)
    b.take("e", 15)
    b.record("e", False, 15)
    assert not b.available("e", 15 + 19)  # 20 s x jitter >= 20
    assert b.available("e", 15 + 24.1)


def test_a_lost_probe_frees_the_slot_after_probe_timeout():
    b = board()
    for t in range(3):
        b.record("e", False, t)
    b.take("e", 15)
    assert not b.available("e", 19)
    assert b.available("e", 20)


def test_retry_after_opens_at_once_for_at_least_that_long():
    b = board()
    b.record("e", False, 0, retry_after=30)
    assert not b.available("e", 29.9)
    assert b.available("e", 36.1)


def test_jitter_spreads_the_recovery_of_breakers_opened_together():
    rng = random.Random(4)
    b = BreakerBoard(SETTINGS, rng.random)
    for endpoint in range(50):
        for t in range(3):
            b.record(f"e{endpoint}", False, t)
    reopen = sorted(
        next(t / 10 for t in range(100, 200) if b.available(f"e{n}", t / 10)) for n in range(50)
    )
    assert reopen[0] >= 12 and reopen[-1] <= 14.1
    assert reopen[-1] - reopen[0] > 1.0  # not all at once


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 5)), max_size=60))
def test_never_more_than_one_probe_at_a_time(events):
    b = board()
    now = 0.0
    for ok, step in events:
        now += step
        if b.available("e", now):
            if b.state("e", now) is BreakerState.HALF_OPEN:
                b.take("e", now)
                assert not b.available("e", now)
            b.record("e", ok, now)


def test_bad_settings():
    with pytest.raises(ValueError):
        BreakerSettings(failure_threshold=0)


def test_a_refused_connection_opens_the_breaker_at_once_then_recovers_like_any_other():
    b = board()
    b.record("e", False, 0, at_once=True)
    assert b.state("e", 0) is BreakerState.OPEN and not b.available("e", 9.9)
    assert b.state("e", 15) is BreakerState.HALF_OPEN and b.available("e", 15)
    b.take("e", 15)
    b.record("e", True, 16)
    assert b.state("e", 16) is BreakerState.CLOSED
