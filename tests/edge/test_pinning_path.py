"""Pins and leases through the real edge: sessions stick, move once, and leases end cleanly."""

import asyncio
import json

import httpx
import pytest

from llmgw.core.leasekeys import LEASE_PREFIX, LeaseSlotValue
from llmgw.events import EVENTS_SUBJECT_PREFIX, parse_event
from llmgw.services.sim.params import EngineParams

CHAT_PATH = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a travel agent."}


@pytest.fixture
def engine_params():
    return EngineParams.zero_delay(itl_base="20ms")


def turn(*history, max_tokens=2, stream=False):
    return {
        "model": "m1",
        "messages": [SYSTEM, {"role": "user", "content": "Plan a trip"}, *history],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def taken_leases(gateway):
    entries = await gateway.routing._kv.list(LEASE_PREFIX)
    values = [(e, LeaseSlotValue.from_json(e.value)) for e in entries]
    return [(e, v) for e, v in values if v.is_taken]


async def eventually(predicate, timeout=5.0):
    """Poll an observable condition until it holds (state written by background tasks)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_every_turn_of_a_chat_reaches_the_pinned_provider(gateway):
    async with httpx.AsyncClient() as http:
        history = []
        providers = []
        for i in range(4):
            r = await http.post(gateway.url + CHAT_PATH, json=turn(*history))
            assert r.status_code == 200
            providers.append(r.headers["x-llmgw-provider"])
            history += [
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"and day {i}?"},
            ]
    assert providers == ["iris"] * 4
    await eventually(lambda: _no_leases(gateway))


async def _no_leases(gateway):
    return not await taken_leases(gateway)


async def test_degraded_provider_repins_the_session_once_and_it_stays(gateway, nats_client):
    moved = []
    events = []

    async def record(msg):
        events.append(parse_event(msg.data))

    sub = await nats_client.subscribe(f"{EVENTS_SUBJECT_PREFIX}.pin.>", cb=record)
    await nats_client.flush()

    async with httpx.AsyncClient() as http:
        first = await http.post(gateway.url + CHAT_PATH, json=turn())
        pin = await gateway.routing.get_pin("m1", first_session := await _session_of(gateway))
        assert first.headers["x-llmgw-provider"] == "iris" and pin.provider == "iris"
        gateway.admission.health.set_healthy("engine-1", False)
        gateway.admission.health.set_healthy("engine-2", False)
        for _ in range(3):
            r = await http.post(gateway.url + CHAT_PATH, json=turn())
            moved.append(r.headers["x-llmgw-provider"])
        new_pin = await gateway.routing.get_pin("m1", first_session)
    assert moved == ["tensorx"] * 3
    assert new_pin.provider == "tensorx" and new_pin.id != pin.id
    await nats_client.flush()
    await sub.unsubscribe()
    # Admission announced exactly what it did: one pin created, one pin moved.
    assert [e.event for e in events] == ["pin.created", "pin.moved"], events
    assert events[1].from_provider == "iris" and events[1].provider == "tensorx"
    # Only the first request after the flip moved it: the pin's identity stayed since.
    assert new_pin.refreshed_at >= pin.refreshed_at


async def _session_of(gateway):
    pins = await gateway.routing._kv.list("pin.")
    assert len(pins) == 1
    return json.loads(pins[0].value)["session"]


async def test_per_session_limit_sends_extra_requests_to_a_temporary_fallback(gateway):
    async with httpx.AsyncClient(timeout=20) as http:
        warm = await http.post(gateway.url + CHAT_PATH, json=turn())
        assert warm.headers["x-llmgw-provider"] == "iris"
        session = await _session_of(gateway)
        pin = await gateway.routing.get_pin("m1", session)
        # Two long streams hold the session's two slots on iris...
        long_streams = [
            http.stream("POST", gateway.url + CHAT_PATH, json=turn(max_tokens=60, stream=True))
            for _ in range(2)
        ]
        responses = [await s.__aenter__() for s in long_streams]
        assert [r.headers["x-llmgw-provider"] for r in responses] == ["iris", "iris"]
        # ...so a third request of the session runs elsewhere, and the pin stays.
        extra = await http.post(gateway.url + CHAT_PATH, json=turn())
        assert extra.headers["x-llmgw-provider"] == "tensorx"
        for s in long_streams:
            await s.__aexit__(None, None, None)
    current = await gateway.routing.get_pin("m1", session)
    assert current.id == pin.id and current.provider == "iris"


async def test_client_disconnect_mid_stream_releases_the_lease(gateway):
    async with httpx.AsyncClient() as http:
        async with http.stream(
            "POST", gateway.url + CHAT_PATH, json=turn(max_tokens=200, stream=True)
        ) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # streaming, lease held
            assert len(await taken_leases(gateway)) == 1
        # Leaving the block closes the connection mid-stream.
    await eventually(lambda: _no_leases(gateway))


async def test_a_lost_lease_ends_the_stream_with_an_error_event(gateway):
    """The lease is reclaimed under a running stream (as the reaper would after a pause)."""
    async with httpx.AsyncClient(timeout=20) as http:
        async with http.stream(
            "POST", gateway.url + CHAT_PATH, json=turn(max_tokens=400, stream=True)
        ) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            [(entry, _)] = await taken_leases(gateway)
            # Someone else now owns the slot: free it and take it again.
            kv = gateway.routing._kv
            freed = await kv.update(entry.key, LeaseSlotValue.free().to_json(), entry.revision)
            await kv.update(
                entry.key, entry.value.replace(b'"lease_id":"', b'"lease_id":"x'), freed
            )
            rest = [line async for line in lines]
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == "lease_lost"
    assert "[DONE]" not in events
    # The edge did not free the slot it no longer holds.
    [(entry_after, value)] = await taken_leases(gateway)
    assert entry_after.key == entry.key and value.lease_id.startswith("x")
