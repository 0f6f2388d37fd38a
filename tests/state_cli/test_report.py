"""The `llmgw state` report from a bucket whose content is known, built through RoutingState on
the in-memory store with a stepped clock: every count, the top sessions, the pins, and the
text and JSON forms."""

from __future__ import annotations

import json
import random

import pytest
from state_cli_helpers import IRIS, LOCAL_CONFIG, MODEL, OTHER_MODEL, TENSORX, session_id

from llmgw.config import Config, load_config
from llmgw.core.leasekeys import LEASE_PREFIX, PIN_PREFIX, PIN_SLOT_PREFIX, PinValue
from llmgw.core.leases import AdmissionResult, Lease, ReleaseResult
from llmgw.services.state.report import (
    PairReport,
    StateReport,
    build_report,
    format_report,
    report_json,
)
from llmgw.state import MemoryKV
from llmgw.state.routing_state import RoutingState
from llmgw.state.setup import limits_from_config

T0 = 10_000.0


class SteppedClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def config() -> Config:
    return load_config(LOCAL_CONFIG, env={})  # lease timeout 30s, pin inactivity 5m


async def _known_bucket(config: Config) -> tuple[MemoryKV, RoutingState, SteppedClock]:
    """iris/llama: pins A (1 lease), B (2 leases, one pinned), C (idle since T0+10); three
    temporary leases, one of them expired; tensorx/llama: pin D (1 lease, no limits)."""
    kv, clock = MemoryKV(), SteppedClock(T0)
    state = RoutingState(
        kv,
        limits_from_config(config),
        clock=clock,
        rng=random.Random(5),
        lease_timeout=config.pinning.lease_timeout,
        pin_inactivity_timeout=config.pinning.pin_inactivity_timeout,
    )
    await state.start()

    async def admitted(coro: object) -> Lease:
        admission = await coro  # type: ignore[misc]
        assert admission.result == AdmissionResult.ADMITTED and admission.lease is not None
        return admission.lease

    await admitted(state.try_admit_request_without_pin(IRIS, MODEL))  # will expire
    clock.now = T0 + 10
    await admitted(state.try_admit_unpinned_session_request(IRIS, MODEL, session_id(0xA)))
    await admitted(state.try_admit_unpinned_session_request(IRIS, MODEL, session_id(0xB)))
    await admitted(state.try_admit_pinned_session_request(MODEL, session_id(0xB)))
    idle = await admitted(state.try_admit_unpinned_session_request(IRIS, MODEL, session_id(0xC)))
    assert await state.release_request_lease(idle, refresh_pin=True) == ReleaseResult.RELEASED
    await admitted(state.try_admit_unpinned_session_request(TENSORX, MODEL, session_id(0xD)))
    clock.now = T0 + 35  # the first lease (renewed_at T0, timeout 30s) has expired, not others
    for _ in range(2):
        await admitted(state.try_admit_request_without_pin(IRIS, MODEL))
    return kv, state, clock


async def _report(kv: MemoryKV, config: Config, now: float) -> StateReport:
    return build_report(
        bucket="llmgw_routing",
        pin_slots=await kv.list(PIN_SLOT_PREFIX),
        leases=await kv.list(LEASE_PREFIX),
        pins=await kv.list(PIN_PREFIX),
        limits=limits_from_config(config),
        now=now,
        lease_timeout=config.pinning.lease_timeout,
        pin_inactivity_timeout=config.pinning.pin_inactivity_timeout,
    )


def _pair(report: StateReport, provider: str, model: str = MODEL) -> PairReport:
    return next(p for p in report.pairs if (p.provider, p.model) == (provider, model))


async def test_counts_pins_leases_reserve_and_expired_leases_per_pair(config: Config) -> None:
    kv, state, clock = await _known_bucket(config)
    report = await _report(kv, config, clock.now)

    iris = _pair(report, IRIS)
    assert (iris.pins, iris.max_pins, iris.pin_slots_taken) == (3, 200, 3)
    assert (iris.leases, iris.live_leases, iris.expired_leases, iris.max_leases) == (6, 5, 1, 64)
    assert (iris.reserved_taken, iris.reserved_slots) == (1, 16)  # B's pinned lease
    assert iris.leases_by_kind == {"pinned": 1, "new_pin": 2, "temporary": 3}
    assert [(u.session, u.leases) for u in iris.top_sessions] == [
        (session_id(0xB), 2),
        (session_id(0xA), 1),
    ]

    tensorx = _pair(report, TENSORX)
    assert (tensorx.pins, tensorx.max_pins, tensorx.leases, tensorx.max_leases) == (
        1,
        None,
        1,
        None,
    )
    assert tensorx.reserved_slots is None
    # Pairs of the config without any use are listed too, at zero.
    assert _pair(report, IRIS, OTHER_MODEL).pins == 0

    # The same counts as the routing state's own usage view.
    usage = await state.usage(clock.now)
    for pair in usage.pairs:
        mine = _pair(report, pair.provider, pair.model)
        assert (mine.pins, mine.pin_slots_taken, mine.leases, mine.expired_leases) == (
            pair.pins,
            pair.pin_slots_taken,
            pair.leases,
            pair.expired_leases,
        )
    await state.close()


async def test_lists_pins_with_their_leases_and_idle_countdown(config: Config) -> None:
    kv, state, clock = await _known_bucket(config)
    report = await _report(kv, config, clock.now)
    pins = {p.session: p for p in report.pins}
    assert {s: (p.provider, p.leases) for s, p in pins.items()} == {
        session_id(0xA): (IRIS, 1),
        session_id(0xB): (IRIS, 2),
        session_id(0xC): (IRIS, 0),
        session_id(0xD): (TENSORX, 1),
    }
    idle = pins[session_id(0xC)]
    assert (idle.idle_for, idle.expires_in) == (25.0, 275.0)
    assert (pins[session_id(0xA)].idle_for, pins[session_id(0xA)].expires_in) == (None, None)

    later = await _report(kv, config, T0 + 10 + 301)  # past C's inactivity timeout, unreaped
    assert next(p for p in later.pins if p.session == session_id(0xC)).expires_in == 0.0
    await state.close()


async def test_text_and_json_forms(config: Config) -> None:
    kv, state, clock = await _known_bucket(config)
    report = await _report(kv, config, clock.now)

    text = format_report(report, with_pins=True)
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in text.splitlines() if line}
    assert rows[(IRIS, MODEL)] == [
        "3/200",
        "5/64",
        "1/16",
        "1",
        "pinned=1",
        "new_pin=2",
        "temporary=3",
    ]
    assert rows[(TENSORX, MODEL)] == ["1", "1", "-", "0", "new_pin=1"]
    assert f"{IRIS}/{MODEL}: {session_id(0xB)} 2/4, {session_id(0xA)} 1/4" in text
    assert any(
        line.split() == [session_id(0xC), MODEL, IRIS, "active", "0", "25s", "4m35s"]
        for line in text.splitlines()
    )
    assert "pins (" not in format_report(report, with_pins=False)

    data = json.loads(json.dumps(report_json(report, with_pins=True)))
    assert data["v"] == 1 and data["at"] == clock.now
    iris = next(p for p in data["pairs"] if p["provider"] == IRIS and p["model"] == MODEL)
    assert iris["live_leases"] == 5 and iris["top_sessions"][0] == {
        "session": session_id(0xB),
        "leases": 2,
    }
    assert len(data["pins"]) == 4
    assert "pins" not in report_json(report, with_pins=False)
    await state.close()


async def test_a_pending_pin_is_shown_apart_and_counts_against_nothing(config: Config) -> None:
    kv, state, clock = await _known_bucket(config)
    # An admission creating session E's pin wrote it pending 10s ago, then stalled.
    pending = PinValue(
        "00000000000000ee", IRIS, MODEL, session_id(0xE), None, {}, clock.now - 10, pending=True
    )
    await kv.create(pending.key, pending.to_json())
    report = await _report(kv, config, clock.now)

    iris = _pair(report, IRIS)
    assert (iris.pins, iris.pending_pins, iris.pin_slots_taken) == (3, 1, 3)
    pin = next(p for p in report.pins if p.session == session_id(0xE))
    assert (pin.pending, pin.idle_for, pin.expires_in) == (True, None, 20.0)  # lease timeout 30s
    text = format_report(report, with_pins=True)
    assert any(line.split()[:3] == [IRIS, MODEL, "3/200+1"] for line in text.splitlines())
    assert any(
        line.split() == [session_id(0xE), MODEL, IRIS, "pending", "0", "-", "20s"]
        for line in text.splitlines()
    )
    await state.close()


async def test_entries_outside_the_layout_are_counted_not_fatal(config: Config) -> None:
    kv, state, clock = await _known_bucket(config)
    await kv.create("pin.0123456789abcdef.ffff", b"not json")
    await kv.create("lease.iris.0123456789abcdef.1", b'{"v": 2, "state": "taken"}')
    report = await _report(kv, config, clock.now)
    assert report.unreadable == 2
    assert "2 entries do not follow the routing-state layout" in format_report(
        report, with_pins=False
    )
    await state.close()
