"""The quota a receiver takes with a shard covers that shard's leases, not its other requests.

A graceful stop hands every shard of the giver to the receiver with its pins and leases; the
receiver moves the giver's earmark for a shard to its own entry (one CAS per pair) and then
takes the shard's state in. Between the two the receiver goes on deciding its own shards, and
a transfer of several pairs (here the managed pair, then an API key's) awaits the store between
them. Here the receiver's book read for the second pair waits until the test has asked the
receiver for as many leases as it grants on its own shards. If the quota moved in for the
handed leases were spendable before they are taken in, those asks would use it and the handed
leases would be refused (their requests end as lease_lost during a graceful stop: the mesh
soak's "4 handed, 0 adopted").
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from rig import MODEL, open_rig
from timing import eventually

from llmgw.core.apikeys import KeyLimits, key_pair
from llmgw.core.shards import shard_of
from llmgw.services.admission.earmarks import Earmarks
from llmgw.state.checker import AuditLog, check_audit
from llmgw.wire import AdmitReply, ReplyStatus, admission_subject

G = 4
LIMITS = {
    "max_pinned_sessions": 100,
    "max_global_in_flight_request_slots": G,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
    "max_per_session_in_flight_request_slots": 4,
}
KEY, KEY_LIMIT = "key-handover", 10  # its limit never binds: it only adds a pair to the books


class _SecondPairRead:
    """The receiver's store during its transfer: `before()` runs before each read of the key
    pair's book (it waits for the test, or fails); everything else goes straight through."""

    def __init__(self, store, before) -> None:  # type: ignore[no-untyped-def]
        self._store, self._before = store, before

    async def quota_book(self, provider: str, model: str):  # type: ignore[no-untyped-def]
        if (provider, model) == key_pair(KEY):
            await self._before()
        return await self._store.quota_book(provider, model)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)


def _during_transfer(monkeypatch, earmarks: Earmarks, moving: int, before) -> None:  # type: ignore[no-untyped-def]
    """`earmarks`' transfers of shard `moving` read the books through `_SecondPairRead`."""
    transfer = Earmarks.transfer

    async def gated(self, source, target, counts, *, record, plain):  # type: ignore[no-untyped-def]
        if self is not earmarks or record.number != moving:
            return await transfer(self, source, target, counts, record=record, plain=plain)
        keeper = self.keeper
        store, keeper.store = keeper.store, _SecondPairRead(keeper.store, before)
        try:
            return await transfer(self, source, target, counts, record=record, plain=plain)
        finally:
            keeper.store = store

    monkeypatch.setattr(Earmarks, "transfer", gated)


@pytest.fixture
async def rig(nats_url, unique_id):
    audit = AuditLog()
    rig = await open_rig(
        nats_url, unique_id, 2, limits=LIMITS, observer_for=audit.observer, queue_ttl="1s"
    )
    rig.audit = audit  # type: ignore[attr-defined]
    yield rig
    await rig.close()


async def _ask(rig, shard: int, session: str | None, key: str | None = None) -> AdmitReply:  # type: ignore[no-untyped-def]
    """The first answer to one ask (ADMITTED, REFUSED, or QUEUED when it waits)."""
    request = rig.request(session=session, shard=shard)
    if key is not None:
        request = request.model_copy(update={"key": key, "key_parallel": KEY_LIMIT})
    msg = await rig.nc.request(
        admission_subject(shard), request.model_dump_json().encode(), timeout=5
    )
    return AdmitReply.model_validate_json(msg.data)


def _sessions_of(shards: set[int], count: int, n: int, prefix: str) -> list[tuple[int, str]]:
    found, i = [], 0
    while len(found) < n:
        session = f"{prefix}-{i}"
        if shard_of(session, count) in shards:
            found.append((shard_of(session, count), session))
        i += 1
    return found


async def _handed(rig, moving: int, *, pinned: bool = True) -> list[str]:  # type: ignore[no-untyped-def]
    """Two leases of the giver in shard `moving`, with an API key (a second pair to move); with
    their sessions pinned unless not `pinned`."""
    leases = []
    for shard, session in _sessions_of({moving}, rig.config.admission.shards, 2, "handed"):
        reply = await _ask(rig, shard, session if pinned else None, key=KEY)
        assert reply.status is ReplyStatus.ADMITTED and reply.target.provider == "iris", reply
        leases.append(reply.lease.lease_id)
    return leases


async def _grants(rig, shards: set[int], n: int) -> int:  # type: ignore[no-untyped-def]
    """How many of up to `n` managed leases asked of `shards` are granted before a refusal."""
    granted = 0
    for shard, session in _sessions_of(shards, rig.config.admission.shards, n, "own"):
        reply = await _ask(rig, shard, session)
        if reply.status is not ReplyStatus.ADMITTED or reply.target.provider != "iris":
            break
        granted += 1
    return granted


async def test_a_receiver_never_spends_the_quota_moved_in_for_a_shard_before_taking_it_in(
    rig, monkeypatch
):
    await rig.report_all(running=0, capacity=16)
    handle_giver, handle_receiver = rig.cluster.admissions
    giver, receiver = handle_giver.service, handle_receiver.service
    moving = min(giver.shards.serving)
    handed = await _handed(rig, moving)

    waiting, go = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        if not go.is_set():
            waiting.set()
            await go.wait()

    _during_transfer(monkeypatch, receiver.quotas.earmarks, moving, slow)
    own = set(receiver.shards.serving)
    stopping = asyncio.create_task(handle_giver.stop())
    try:
        async with asyncio.timeout(20):
            await waiting.wait()  # the managed pair's earmark is the receiver's now
        # The receiver's own shards ask for managed leases until it has none left to give.
        granted = await _grants(rig, own, G + 2)
        assert granted < G + 2, f"the receiver granted {granted} managed leases of G={G}"
    finally:
        go.set()
        await stopping

    assert moving in receiver.shards.serving
    assert receiver.shards.refused_leases == 0
    assert all(lease in receiver.ledger.leases for lease in handed), receiver.ledger.leases
    assert receiver.ledger.pair_use(("iris", MODEL)).leases == granted + len(handed)
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])


@pytest.mark.parametrize("path", ["handover", "adoption"])
async def test_a_take_in_that_fails_leaves_the_quota_moved_in_for_it_spendable(
    rig, monkeypatch, path
):
    """The receiver's transfer fails after the managed pair's earmark has moved to it (a store
    error on the second pair): that quota must not stay set aside for a shard it never took in.
    `handover`: the handover's transfer fails, and the receiver's adoption of the shard (which
    would end the set-aside too) is held meanwhile. `adoption`: the handover never arrives (its
    message is lost) and the adoption's transfer takes the earmark, then fails."""
    await rig.report_all(running=0, capacity=16)
    handle_giver, handle_receiver = rig.cluster.admissions
    giver, receiver = handle_giver.service, handle_receiver.service
    moving = min(giver.shards.serving)
    # No pins: an adoption's retry then has nothing of the managed pair to move (it would
    # overwrite what the failed one set aside).
    await _handed(rig, moving, pinned=False)
    # The key is known at the receiver (a request of its own had it): its book is read in a
    # transfer of `moving` whichever way the shard comes in.
    await receiver.quotas.track(key_pair(KEY), KeyLimits(KEY_LIMIT))

    healed, failed = asyncio.Event(), asyncio.Event()

    async def fail() -> None:
        if not healed.is_set():
            failed.set()
            raise NatsTimeoutError  # the routing bucket did not answer

    _during_transfer(monkeypatch, receiver.quotas.earmarks, moving, fail)
    adopt, send = receiver.shards.handovers.adopt, giver.shards.handovers.send
    adopting = asyncio.Event()

    async def held(shards):  # type: ignore[no-untyped-def]
        if any(shard == moving for shard, _ in shards):
            await adopting.wait()
        return await adopt(shards)

    async def lost(target, handover):  # type: ignore[no-untyped-def]
        if handover.state.shard != moving:
            return await send(target, handover)
        async with asyncio.timeout(10):
            await failed.wait()  # the receiver adopted the shard meanwhile, and that failed
        raise NatsTimeoutError

    if path == "handover":
        monkeypatch.setattr(receiver.shards.handovers, "adopt", held)
    else:
        monkeypatch.setattr(giver.shards.handovers, "send", lost)
    pair = ("iris", MODEL)
    try:
        await handle_giver.stop()  # every shard to the receiver; `moving` is not taken in
        assert failed.is_set(), "the receiver's transfer of the moved shard did not fail"
        book = (await receiver.store.quota_book(*pair)).value
        assert (giver.instance, moving) not in book.handing  # its earmark moved, then it failed
        # Alone now: the whole limit is the receiver's to spend, none held for the failed shard.
        with contextlib.suppress(AssertionError):  # the assert below says what is held
            await eventually(lambda: receiver.ledger.pair_quota(pair).g == G, timeout=5)
        spendable = receiver.ledger.pair_quota(pair)
        assert spendable.g == G, (spendable, book.quota(receiver.instance), G)
        assert await _grants(rig, set(receiver.shards.serving) - {moving}, G) == G
    finally:
        healed.set()  # the shard can be taken in now (adopted: its leases are lost)
        adopting.set()
