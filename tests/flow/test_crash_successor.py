"""An admission instance that crashes and is succeeded: its shards and its capacity come back
within seconds, and nothing is granted twice (docs/adr/0002, "Changed (2026-12-03)").

The only instance holds the whole limit of a pair and three live leases (held by an edge's
lease keeper, which answers roll calls as an edge does). It is killed without a word; its
successor removes its member key (what `llmgw admission --supersedes` and a stable
`--instance-name` do), adopts its shards and leases by roll call, and then drops what is left
of the dead entry. Before, that rest stayed booked until the reaper's grace (49 s by default):
the successor's own quota covered only what it adopted, and every new request went to the third
party. The audit checker over both trails must find nothing.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from inproc import Admission
from nats.aio.msg import Msg
from rig import MODEL, open_rig, request_ended
from timing import eventually

from llmgw.core.shards import shard_of
from llmgw.services.admission.compose import open_admission
from llmgw.services.admission.successor import NameInUse, remove_exited_member
from llmgw.services.edge.leases import EdgeLeases, HeldLease
from llmgw.state.checker import ENDED_IN_TRANSIT, AuditLog, check_audit
from llmgw.state.setup import open_routing_store
from llmgw.wire import REQUEST_STATS_SUBJECT, RollCall

G = 6
LIMITS = {
    "max_pinned_sessions": G,
    "max_global_in_flight_request_slots": G,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
    "max_per_session_in_flight_request_slots": 4,
}
DEAD, SUCCESSOR = "admission-0", "admission-1"
BOUND = 3.0  # seconds from the successor's start to the dead instance's quota being back


def _sessions(shards: int, n: int, start: int = 0) -> list[str]:
    """`n` sessions in distinct shards (each lease its own shard: adopted one by one)."""
    found: list[str] = []
    used: set[int] = set()
    i = start
    while len(found) < n:
        session = f"conversation-{i}"
        if shard_of(session, shards) not in used:
            used.add(shard_of(session, shards))
            found.append(session)
        i += 1
    return found


async def _holders(store) -> set[str]:  # type: ignore[no-untyped-def]
    return {i for b in await store.quota_books() for i in b.value.holders if b.value.holders[i].g}


async def _until_dropped(store, instance: str) -> None:  # type: ignore[no-untyped-def]
    """Until no quota book holds an entry of `instance`, within `BOUND`."""

    async def dropped() -> bool:
        return instance not in {i for b in await store.quota_books() for i in b.value.holders}

    await eventually(dropped, BOUND, f"{instance}'s quota no longer booked", interval=0.05)


async def _providers(rig, sessions: list[str], edge: EdgeLeases) -> list[str]:  # type: ignore[no-untyped-def]
    """Where one request of each session goes, one after another; `edge` holds their leases."""
    providers = []
    for session in sessions:
        reply = await rig.ask(session=session)
        assert reply.target is not None, reply
        providers.append(reply.target.provider)
        if reply.lease is not None:
            edge.hold(reply.lease)
    return providers


@pytest.fixture
async def rig(nats_url, unique_id):
    audit = AuditLog()
    rig = await open_rig(nats_url, unique_id, limits=LIMITS, observer_for=audit.observer)
    rig.audit = audit  # type: ignore[attr-defined]
    edge = EdgeLeases(rig.nc, "edge-test", lease_timeout=30.0, request_timeout=2.0)
    await edge.start()
    rig.edge = edge  # type: ignore[attr-defined]
    yield rig
    await edge.stop()
    await rig.close()


async def test_a_successor_takes_the_dead_instances_shards_and_capacity_back_at_once(rig):
    shards = rig.config.admission.shards
    await rig.report_all(running=0, capacity=16)
    sessions = _sessions(shards, G + 1)
    for session in sessions[:3]:  # three requests running when the instance dies
        reply = await rig.ask(session=session)
        assert reply.target is not None and reply.target.provider == "iris", reply
        rig.edge.hold(reply.lease)
    store = await open_routing_store(rig.nc, rig.config)
    assert await _holders(store) == {DEAD}  # the lone instance holds the whole limit

    dead = rig.cluster.admissions[0]
    await dead.kill()
    rig.audit.crash(DEAD)
    started = time.monotonic()
    assert await remove_exited_member(store, DEAD)  # what --supersedes does before joining
    successor = (await rig.cluster.add_admission(SUCCESSOR)).service
    await rig.cluster.settled()
    assert successor.shards.adopted_leases == 3  # every running request's lease adopted

    await _until_dropped(store, DEAD)
    back = time.monotonic() - started
    await eventually(
        lambda: (
            successor.ledger.quota.get(("iris", MODEL)) is not None
            and successor.ledger.quota[("iris", MODEL)].g == G
        ),
        timeout=BOUND,
        what="the successor's quota of the whole limit",
    )
    assert back < BOUND, back

    await rig.report_all(running=3, capacity=16)  # fresh reports: nothing stale
    providers = await _providers(rig, sessions[3:], rig.edge)
    # Three more on our engines (G in all, the adopted three included), the next one beyond.
    assert providers == ["iris", "iris", "iris", "tensorx"], providers
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])


class _EndsAfterTheRollCall(EdgeLeases):
    """An edge whose request ends just after it answered a roll call with the request's lease:
    the end reaches the adopting instance before the shard is taken in."""

    ending: HeldLease | None = None

    async def on_rollcall(self, msg: Msg) -> None:
        await super().on_rollcall(msg)
        hold = self.ending
        if hold is None or hold.record.shard not in RollCall.model_validate_json(msg.data).shards:
            return
        self.ending = None
        self.end(hold)
        ended = request_ended(hold.record, sent=True)
        await self._nc.publish(REQUEST_STATS_SUBJECT, ended.model_dump_json().encode())


async def test_a_request_that_ends_while_its_shard_is_adopted_is_recorded_ended(rig):
    """Its lease is left out of the adoption (its quota came in with the others), and the audit
    trail says it ended: the checker counts it no longer at the dead instance while the
    successor grants the whole limit again. (Before, the trail had no end for it: the checker
    kept it live until lease_timeout, one over G once the successor's quota came back.)"""
    shards = rig.config.admission.shards
    edge = _EndsAfterTheRollCall(rig.nc, "edge-ending", lease_timeout=30.0, request_timeout=2.0)
    await edge.start()
    try:
        await rig.report_all(running=0, capacity=16)
        sessions = _sessions(shards, G + 2)
        held = []
        for session in sessions[:3]:  # three requests running when the instance dies
            reply = await rig.ask(session=session)
            assert reply.target is not None and reply.target.provider == "iris", reply
            held.append(edge.hold(reply.lease))
        edge.ending = held[0]
        store = await open_routing_store(rig.nc, rig.config)
        await rig.cluster.admissions[0].kill()
        rig.audit.crash(DEAD)
        assert await remove_exited_member(store, DEAD)
        successor = (await rig.cluster.add_admission(SUCCESSOR)).service
        await rig.cluster.settled()
        assert edge.ending is None, "the roll call never asked for the ending lease's shard"
        assert successor.shards.adopted_leases == 2  # the ended one left out
        ended = [e for e in rig.audit.events if e.kind == "ended" and e.instance == SUCCESSOR]
        assert [(e.lease.lease_id, e.reason) for e in ended] == [
            (held[0].record.lease_id, ENDED_IN_TRANSIT)
        ]

        await _until_dropped(store, DEAD)
        await eventually(
            lambda: successor.ledger.quota[("iris", MODEL)].g == G,
            timeout=BOUND,
            what="the successor's quota of the whole limit",
        )
        await rig.report_all(running=2, capacity=16)
        providers = await _providers(rig, sessions[3:], edge)
        # G on our engines (the two adopted and four new), the next one beyond.
        assert providers == ["iris"] * 4 + ["tensorx"], providers
        violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
        assert violations == [], "\n".join(str(v) for v in violations[:3])
    finally:
        await edge.stop()


async def test_a_stable_name_takes_over_from_its_dead_incarnation_and_refuses_a_live_one(rig):
    config = rig.config
    # The rig's own instance leaves (its shards are released): the named ones are alone.
    await rig.cluster.admissions[0].stop()
    first = await open_admission(config, "adm-a", "first", name="adm")
    try:
        with pytest.raises(NameInUse):  # a second process under the name, by mistake
            async with asyncio.timeout(10):
                await open_admission(config, "adm-b", "second", name="adm")
        assert first.service.membership.can_serve()  # the running one is untouched
        assert len(first.service.shards.serving) == config.admission.shards
        await eventually(lambda: bool(first.service.ledger.quota), what="the first one's quota")
    except BaseException:
        await first.close()
        raise
    await Admission(first.service, first.nc, first.follower).kill()  # SIGKILL
    started = time.monotonic()
    third = await open_admission(config, "adm-c", "third", name="adm")
    try:
        took = time.monotonic() - started
        assert len(third.service.shards.serving) == config.admission.shards
        store = third.service.store
        assert "adm-a" not in {s.value.instance for s in await store.members()}
        await _until_dropped(store, "adm-a")
        # Quiet for 2 x heartbeat + 0.5 s (0.9 s here) since its last renewal, then taken over.
        assert took < BOUND, took
    finally:
        await third.close()


async def test_a_live_instance_whose_key_a_successor_removes_stops_deciding_at_once(
    nats_url, unique_id
):
    """A wrong `--supersedes` (or a second process under a stable name that found the key
    quiet): the live instance learns from its member watch that its key is gone and stops
    deciding within moments, not at its next heartbeat (5 s here), then rejoins under a new id."""
    rig = await open_rig(nats_url, unique_id, heartbeat="5s")
    try:
        service = rig.admissions[0]
        old = service.instance
        store = await open_routing_store(rig.nc, rig.config)
        assert service.membership.can_serve()
        started = time.monotonic()
        assert await remove_exited_member(store, old)
        await eventually(
            lambda: not service.membership.can_serve() or service.instance != old,
            timeout=1.0,
            what="the instance to stop deciding",
        )
        assert time.monotonic() - started < 1.0
        await eventually(lambda: service.instance != old, timeout=5.0, what="its new id")
        assert service.instance.startswith(f"{old}-r")
    finally:
        await rig.close()
