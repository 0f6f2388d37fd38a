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

import pytest
from rig import MODEL, open_rig

from llmgw.core.apikeys import key_pair
from llmgw.core.shards import shard_of
from llmgw.services.admission.quotas import QuotaKeeper
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


class _SlowSecondPair:
    """The receiver's store during its transfer: reading the key pair's book waits for the
    test (`go`), once `waiting` is set; everything else goes straight through."""

    def __init__(self, store, waiting: asyncio.Event, go: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
        self._store, self._waiting, self._go = store, waiting, go

    async def quota_book(self, provider: str, model: str):  # type: ignore[no-untyped-def]
        if (provider, model) == key_pair(KEY) and not self._go.is_set():
            self._waiting.set()
            await self._go.wait()
        return await self._store.quota_book(provider, model)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)


@pytest.fixture
async def rig(nats_url, unique_id):
    audit = AuditLog()
    rig = await open_rig(
        nats_url, unique_id, 2, limits=LIMITS, observer_for=audit.observer, queue_ttl="1s"
    )
    rig.audit = audit  # type: ignore[attr-defined]
    yield rig
    await rig.close()


async def _ask(rig, shard: int, session: str, key: str | None = None) -> AdmitReply:  # type: ignore[no-untyped-def]
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


async def test_a_receiver_never_spends_the_quota_moved_in_for_a_shard_before_taking_it_in(
    rig, monkeypatch
):
    count = rig.config.admission.shards
    await rig.report_all(running=0, capacity=16)
    handle_giver, handle_receiver = rig.cluster.admissions
    giver, receiver = handle_giver.service, handle_receiver.service
    # Two leases of the giver in one of its shards, with an API key (a second pair to move).
    moving = min(giver.shards.serving)
    handed = []
    for shard, session in _sessions_of({moving}, count, 2, "handed"):
        reply = await _ask(rig, shard, session, key=KEY)
        assert reply.status is ReplyStatus.ADMITTED and reply.target.provider == "iris", reply
        handed.append(reply.lease.lease_id)

    waiting, go = asyncio.Event(), asyncio.Event()
    transfer = QuotaKeeper.transfer

    async def gated(self, source, target, counts, *, shard, plain):  # type: ignore[no-untyped-def]
        if self is not receiver.quotas or shard != moving:
            return await transfer(self, source, target, counts, shard=shard, plain=plain)
        store, self.store = self.store, _SlowSecondPair(self.store, waiting, go)
        try:
            return await transfer(self, source, target, counts, shard=shard, plain=plain)
        finally:
            self.store = store

    monkeypatch.setattr(QuotaKeeper, "transfer", gated)
    own = set(receiver.shards.serving)
    stopping = asyncio.create_task(handle_giver.stop())
    try:
        async with asyncio.timeout(20):
            await waiting.wait()  # the managed pair's earmark is the receiver's now
        # The receiver's own shards ask for managed leases until it has none left to give.
        granted = 0
        for shard, session in _sessions_of(own, count, G + 2, "own"):
            reply = await _ask(rig, shard, session)
            if reply.status is not ReplyStatus.ADMITTED or reply.target.provider != "iris":
                break
            granted += 1
        else:
            pytest.fail(f"the receiver granted {granted} managed leases of G={G}")
    finally:
        go.set()
        await stopping

    assert moving in receiver.shards.serving
    assert receiver.shards.refused_leases == 0
    assert all(lease in receiver.ledger.leases for lease in handed), receiver.ledger.leases
    assert receiver.ledger.pair_use(("iris", MODEL)).leases == granted + len(handed)
    violations = check_audit(rig.audit.events, rig.cluster.limits, lease_timeout=30.0)
    assert violations == [], "\n".join(str(v) for v in violations[:3])
