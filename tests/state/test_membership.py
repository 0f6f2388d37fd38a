"""Fencing of an admission instance's membership, on both stores (NATS: a real server).

An instance decides only while its last renewal is younger than `fence_after`; once fenced it
must never resume with what it held (others may have claimed its shards and moved its quota):
its next heartbeat reports it lost, and its member key is gone so its shards can be claimed.
"""

from __future__ import annotations

import asyncio
import time

from timing import SteppedClock

from llmgw.core.keys import MemberValue
from llmgw.services.admission.membership import Membership
from llmgw.state.store import RoutingStore


class SlowStore(RoutingStore):
    """A store whose renewals land `delay` seconds (of the injected clock) after they start."""

    def __init__(self, kv, clock: SteppedClock) -> None:  # type: ignore[no-untyped-def]
        super().__init__(kv)
        self.clock = clock
        self.delay = 0.0

    async def renew_member(self, member, revision):  # type: ignore[no-untyped-def]
        result = await super().renew_member(member, revision)
        self.clock.now += self.delay
        return result


async def joined(kv_store, ttl: float = 15.0) -> tuple[Membership, SlowStore, SteppedClock]:  # type: ignore[no-untyped-def]
    clock = SteppedClock(1000.0)
    store = SlowStore(kv_store, clock)
    membership = Membership(store, "adm-1", heartbeat=1.0, ttl=ttl, clock=clock, monotonic=clock)
    await membership.join()
    return membership, store, clock


async def members(store: RoutingStore) -> list[str]:
    return [stored.value.instance for stored in await store.members()]


async def test_heartbeats_within_the_fence_keep_it_serving(kv_store):
    membership, store, clock = await joined(kv_store)
    try:
        for _ in range(5):
            clock.now += 11.0  # just inside fence_after (15 - 3 = 12)
            assert await membership.renew_now()
            assert membership.can_serve()
        assert await members(store) == ["adm-1"]
    finally:
        await membership.leave()


async def test_a_fenced_instance_is_lost_and_leaves_its_key(kv_store):
    membership, store, clock = await joined(kv_store)
    try:
        assert membership.fence_after == 12.0
        clock.now += 12.5  # paused (or cut off from NATS) past the fence
        assert not membership.can_serve()
        assert not await membership.renew_now()  # lost: never resumes with what it held
        assert not membership.can_serve()
        assert membership.fenced_at == 1012.0  # it stopped deciding at its fence
        assert await members(store) == []  # its shards can be claimed at once
    finally:
        await membership.leave()


async def test_a_renewal_that_lands_after_the_fence_does_not_unfence_it(kv_store):
    membership, store, clock = await joined(kv_store)
    try:
        clock.now += 10.0  # starts inside the fence ...
        store.delay = 5.0  # ... but lands 15 s after the last renewal: others may have claimed
        assert not await membership.renew_now()
        assert not membership.can_serve()
        assert membership.fenced_at == 1012.0  # at its fence, learnt 3 s later
        assert await members(store) == []
    finally:
        await membership.leave()


async def test_a_heartbeat_whose_key_changed_hands_stops_it_deciding_at_once(kv_store):
    """The CAS fails inside the fence (the key was removed or rewritten by another process):
    the instance decides nothing more from that moment, not from its fence's."""
    membership, store, clock = await joined(kv_store)
    try:
        clock.now += 5.0
        [stored] = await store.members()
        assert await store.remove_member("adm-1", stored.revision)  # taken for dead
        assert not await membership.renew_now()
        assert not membership.can_serve()
        assert membership.fenced_at == 1005.0
    finally:
        await membership.leave()


class SlowListing(RoutingStore):
    """A store whose member listing waits for `go` (a loaded host's slow join)."""

    def __init__(self, kv) -> None:  # type: ignore[no-untyped-def]
        super().__init__(kv)
        self.go = asyncio.Event()

    async def members(self):  # type: ignore[no-untyped-def]
        await self.go.wait()
        return await super().members()


async def test_a_joining_instance_beats_while_it_lists_the_members(kv_store):
    """The heartbeat starts once the member key exists, not after the view is read: a listing
    slower than the fence neither lets the key go stale nor fences the newcomer."""
    store, plain = SlowListing(kv_store), RoutingStore(kv_store)
    # fence_after 1 s: a worker starved for most of a second (a parallel run on 2 cores)
    # still beats in time
    membership = Membership(store, "adm-1", heartbeat=0.1, ttl=2.0)
    join = asyncio.create_task(membership.join())
    try:
        renewals: list[float] = []
        started = time.monotonic()
        deadline = started + 4 * membership.fence_after
        # Two renewals seen in the bucket, and the listing held past the fence.
        while len(renewals) < 3 or time.monotonic() - started < 1.2 * membership.fence_after:
            assert time.monotonic() < deadline, (
                f"member key writes seen (the first: its creation): {renewals}"
            )
            stored = await plain.members()
            if stored and (not renewals or stored[0].value.renewed_at > renewals[-1]):
                renewals.append(stored[0].value.renewed_at)
            await asyncio.sleep(0.005)
        assert not join.done()  # still listing
        assert membership.can_serve()
        store.go.set()
        await join
        assert membership.can_serve()
        assert await members(plain) == ["adm-1"]
    finally:
        store.go.set()
        await join
        await membership.leave()


class AnswerLost(SlowStore):
    """A store whose next renewal is written, and then the renewing task is cancelled before
    it reads the answer (the instance stops while a heartbeat is in flight)."""

    lose_next = False

    async def renew_member(self, member, revision):  # type: ignore[no-untyped-def]
        result = await super().renew_member(member, revision)
        if self.lose_next:
            self.lose_next = False
            raise asyncio.CancelledError
        return result


async def test_leaving_deletes_the_key_a_renewal_cancelled_in_flight_rewrote(kv_store):
    """The renewal landed but its revision was never read: the delete at the revision the
    instance knows conflicts, and the key must still go (left, the peers would keep a share
    of every quota for an instance that is gone until its TTL ran out)."""
    clock = SteppedClock(1000.0)
    store = AnswerLost(kv_store, clock)
    membership = Membership(store, "adm-1", heartbeat=1.0, ttl=15.0, clock=clock, monotonic=clock)
    await membership.join()
    store.lose_next = True
    try:
        await membership.renew_now()
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the renewal's answer was not lost")
    [stored] = await store.members()
    assert stored.revision > 1  # it was written
    await membership.leave()
    assert await members(store) == []


async def test_leaving_spares_a_later_incarnations_key(kv_store):
    """The re-read deletes the key only if it is still this incarnation's (same joined_at)."""
    membership, store, clock = await joined(kv_store)
    [stored] = await store.members()
    assert await store.remove_member("adm-1", stored.revision)
    clock.now += 1.0
    await store.join(MemberValue("adm-1", clock.now, clock.now))  # another process, same id
    await membership.leave()
    [left] = await store.members()
    assert left.value.joined_at == clock.now


async def test_two_renewals_at_once_both_land(kv_store):
    """The heartbeat and announce_leaving renew at the same moment: serialized, neither is
    refused at a stale revision (which would make the instance think itself lost)."""
    membership, store, _clock = await joined(kv_store)
    try:
        for _ in range(5):
            assert await asyncio.gather(membership.renew_now(), membership.renew_now()) == [
                True,
                True,
            ]
            assert membership.can_serve()
    finally:
        await membership.leave()
    assert await members(store) == []
