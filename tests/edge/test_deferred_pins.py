"""A new pin's first write waits for its session's next request (services/admission/pins.py):
one-shot conversations cost no write to the routing bucket, nor a delete when they are evicted;
a conversation that comes back, a pin older than a refresh period and a shard released without
a handover are written. Real parts: the edge and an admission instance on a nats-server,
simulated engines, every write of the routing bucket recorded."""

from __future__ import annotations

import httpx

from llmgw.state.history import HistoryRecorder
from llmgw.state.nats_kv import NatsKV
from llmgw.state.store import RoutingStore

CHAT_PATH = "/v1/chat/completions"


def chat(user: str) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "user": user}


async def stored_sessions(gateway) -> set[str]:  # type: ignore[no-untyped-def]
    return {stored.value.session for _, stored in await gateway.admission.store.all_pins()}


async def test_one_shot_sessions_write_nothing_and_a_returning_one_is_written(gateway, nats_client):
    """20 one-shot sessions on a provider with room for 8 pins: each is pinned (the route says
    so), the oldest are evicted to make room, and the bucket sees no pin write at all. The
    session that comes back is written at its second request."""
    recorder = await HistoryRecorder(nats_client.jetstream(), gateway.config.pinning.bucket).start()
    try:
        async with httpx.AsyncClient(timeout=20) as http:
            for i in range(20):
                r = await http.post(gateway.url + CHAT_PATH, json=chat(f"once-{i}"))
                assert r.status_code == 200, r.text
                assert r.headers["x-llmgw-route"] == "new_pin"
            admission = gateway.admission
            assert admission.ledger.pair_use(("iris", "m1")).pins == 8  # P = 8: evicted for room
            assert admission.pins.never_written == 12
            await admission.pins.drain()
            assert await stored_sessions(gateway) == set()
            again = await http.post(gateway.url + CHAT_PATH, json=chat("once-19"))
            assert again.headers["x-llmgw-route"] == "pinned"
        await admission.pins.drain()
        [session] = await stored_sessions(gateway)
        assert admission.ledger.pins[("m1", session)].revision > 0
        entries = await recorder.sync(timeout=10)
    finally:
        await recorder.stop()
    pin_writes = [e for e in entries if e.key.startswith("pin.")]
    assert len(pin_writes) == 1, pin_writes  # the returning session's: no other write, no delete


async def test_a_shard_released_without_a_handover_writes_its_deferred_pins(gateway, nats_client):
    """The only instance stops: its shards are released to the bucket, and the next owner adopts
    their pins from there, so a pin that was only in memory is written first."""
    async with httpx.AsyncClient(timeout=20) as http:
        for i in range(3):
            r = await http.post(gateway.url + CHAT_PATH, json=chat(f"kept-{i}"))
            assert r.headers["x-llmgw-route"] == "new_pin"
    sessions = {pin.session for pin in gateway.admission.ledger.pins.values()}
    assert await stored_sessions(gateway) == set()
    await gateway.admission_handle.stop()
    store = RoutingStore(NatsKV(nats_client.jetstream(), gateway.config.pinning.bucket))
    assert {stored.value.session for _, stored in await store.all_pins()} == sessions


async def test_a_pin_unwritten_after_a_refresh_period_is_written(gateway):
    """A session that has not come back within a refresh period (pin_inactivity_timeout / 4)
    still has its pin written: a crash after that loses nothing."""
    admission = gateway.admission
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(gateway.url + CHAT_PATH, json=chat("slow-to-return"))
        assert r.headers["x-llmgw-route"] == "new_pin"
    [pin] = admission.ledger.pins.values()
    assert admission.pins.deferred() == 1
    refresh_every = gateway.config.pinning.pin_inactivity_timeout / 4
    # The expiry pass as upkeep runs it, a refresh period later (its clock is the wall's).
    admission.upkeep.expire(pin.created_at + refresh_every + 1)
    await admission.pins.drain()
    assert await stored_sessions(gateway) == {pin.session}
    assert admission.pins.deferred() == 0
