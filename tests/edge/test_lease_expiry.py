"""The edge's own lease expiry (`EdgeLeases.expired`), on a clock the test steps: a lease not
confirmed for lease_timeout is lost (its request is ended at once); an unclaimed local grant
depends on no owner and never expires. No NATS: the store is not started (no renewals)."""

from __future__ import annotations

from timing import SteppedClock

from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.services.edge.leases import LOCAL_LEASE_PREFIX, EdgeLeases

LEASE_TIMEOUT = 3.0


def record(lease_id: str) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lease_id,
        provider="iris",
        model="m1",
        kind=LeaseKind.TEMPORARY,
        unreserved=False,
        shard=0,
        edge="edge-test",
        granted_at=0.0,
        renewed_at=0.0,
    )


def leases(clock: SteppedClock) -> EdgeLeases:
    return EdgeLeases(
        None,  # type: ignore[arg-type]  # never started: no renewals, no NATS
        "edge-test",
        lease_timeout=LEASE_TIMEOUT,
        request_timeout=0.5,
        monotonic=clock,
    )


def test_a_lease_not_confirmed_for_lease_timeout_is_lost_and_ends_its_request() -> None:
    clock = SteppedClock(100.0)
    store = leases(clock)
    hold = store.hold(record("l-1"))
    ended = []
    hold.on_lost = lambda: ended.append("l-1")
    clock.now += LEASE_TIMEOUT - 0.01
    assert not store.expired(hold) and not hold.lost and ended == []
    clock.now += 0.01
    assert store.expired(hold) and hold.lost
    assert ended == ["l-1"] and store.lost == 1
    assert store.expired(hold) and ended == ["l-1"]  # lost once, ended once
    store.end(hold)
    assert not store.held


def test_an_unclaimed_local_grant_never_expires() -> None:
    clock = SteppedClock(100.0)
    store = leases(clock)
    hold = store.hold(record(f"{LOCAL_LEASE_PREFIX}edge-test-1"))
    clock.now += 100 * LEASE_TIMEOUT
    assert not store.expired(hold) and not hold.lost
    # An owner takes it in a renewal round (which confirms it): from then on it is renewed, or
    # it expires like any other.
    hold.claimed, hold.confirmed_at = True, clock.monotonic()
    assert not store.expired(hold)
    clock.now += LEASE_TIMEOUT
    assert store.expired(hold) and hold.lost
