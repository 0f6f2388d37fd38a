"""A pin never written moves in a handover message as it is (services/admission/pins.py): its
receiver keeps it unwritten and writes it at its session's next request. Two admission
instances on a nats-server, flow control on with engine load reports."""

from __future__ import annotations

from rig import MODEL, admitted, open_rig


async def test_a_handover_carries_an_unwritten_pin_and_its_receiver_writes_it_when_it_returns(
    nats_url, unique_id
):
    """A second instance joins and shards move to it with their pins in the handover message:
    a pin never written arrives unwritten, stays so, and is written by its new owner at its
    session's next request. Flow control on, as shipped, with engine load reports."""
    rig = await open_rig(nats_url, unique_id, 1)
    try:
        await rig.report_all(running=0, kv_usage=0.1)
        [first] = rig.admissions
        sessions = [f"conversation-{i}" for i in range(16)]
        for session in sessions:
            reply = await first.decide(rig.request(band="gold", session=session))
            assert admitted(reply) and reply.route == "new_pin", reply
        assert first.pins.deferred() == 16
        second = await rig.add_admission()
        await rig.cluster.balanced()
        moved = [s for s in sessions if second.ledger.pin(MODEL, s) is not None]
        assert moved, "no shard of these sessions moved"
        assert second.pins.deferred() == len(moved)
        await second.pins.drain()
        assert await second.store.all_pins() == []  # nothing was written on the way
        session = moved[0]
        again = await second.decide(rig.request(band="gold", session=session))
        assert admitted(again) and again.route == "pinned", again
        await second.pins.drain()
        [(_, stored)] = await second.store.all_pins()
        assert (stored.value.session, stored.value.pin_id) == (
            session,
            second.ledger.pin(MODEL, session).pin_id,
        )
    finally:
        await rig.close()
