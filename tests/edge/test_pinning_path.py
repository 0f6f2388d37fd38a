"""Pins and leases through the real edge: sessions stick, move once, and leases end cleanly."""

import json

import httpx
import pytest
from timing import eventually

from llmgw.core.ledger import EndReason
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
        "ignore_eos": True,  # long streams hold their slots for all of their tokens
        "stream": stream,
    }


def live_leases(gateway):
    """The leases admission accounts (they live in its ledger, not in the bucket)."""
    return list(gateway.admission.ledger.leases.values())


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
    return not live_leases(gateway) and not gateway.deps.leases.held


async def test_degraded_provider_repins_the_session_once_and_it_stays(gateway, nats_client):
    moved = []
    events = []

    async def record(msg):
        events.append(parse_event(msg.data))

    sub = await nats_client.subscribe(f"{EVENTS_SUBJECT_PREFIX}.pin.>", cb=record)
    await nats_client.flush()

    async with httpx.AsyncClient() as http:
        first = await http.post(gateway.url + CHAT_PATH, json=turn())
        session = _session_of(gateway)
        pin = gateway.admission.ledger.pin("m1", session)
        assert first.headers["x-llmgw-provider"] == "iris" and pin.provider == "iris"
        gateway.admission.health.set_healthy("engine-1", False)
        gateway.admission.health.set_healthy("engine-2", False)
        for _ in range(3):
            r = await http.post(gateway.url + CHAT_PATH, json=turn())
            moved.append((r.headers["x-llmgw-provider"], r.headers["x-llmgw-route"]))
        new_pin = gateway.admission.ledger.pin("m1", session)
    assert moved == [("tensorx", "repinned"), ("tensorx", "pinned"), ("tensorx", "pinned")]
    assert new_pin.provider == "tensorx" and new_pin.pin_id != pin.pin_id
    await gateway.admission.pins.drain()
    [(_, stored)] = await gateway.admission.store.all_pins()
    assert (stored.value.provider, stored.value.pin_id) == ("tensorx", new_pin.pin_id)
    await nats_client.flush()
    await sub.unsubscribe()
    # Admission announced exactly what it did: one pin created, one pin moved.
    assert [e.event for e in events] == ["pin.created", "pin.moved"], events
    assert events[1].from_provider == "iris" and events[1].provider == "tensorx"
    assert events[1].reason == "degraded"


def _session_of(gateway):
    pins = list(gateway.admission.ledger.pins.values())
    assert len(pins) == 1
    return pins[0].session


async def test_per_session_limit_sends_extra_requests_to_a_temporary_fallback(gateway):
    async with httpx.AsyncClient(timeout=20) as http:
        warm = await http.post(gateway.url + CHAT_PATH, json=turn())
        assert warm.headers["x-llmgw-provider"] == "iris"
        session = _session_of(gateway)
        pin = gateway.admission.ledger.pin("m1", session)
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
        assert extra.headers["x-llmgw-route"] == "temporary"
        for s in long_streams:
            await s.__aexit__(None, None, None)
    current = gateway.admission.ledger.pin("m1", session)
    assert current.pin_id == pin.pin_id and current.provider == "iris"


def _requests_ended_as(gateway, outcome):
    """The edge's requests counted with `outcome`, over every label set."""
    return sum(
        sample.value
        for metric in gateway.deps.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "llmgw_edge_requests_total" and sample.labels["outcome"] == outcome
    )


async def test_client_disconnect_mid_stream_releases_the_lease(gateway):
    """The client hangs up while the engine is still streaming (200 tokens at 20 ms: 4 s): the
    edge stops relaying at once, ends the attempt as client_disconnected and releases its lease,
    long before the stream would have ended."""
    async with httpx.AsyncClient() as http:
        async with http.stream(
            "POST", gateway.url + CHAT_PATH, json=turn(max_tokens=200, stream=True)
        ) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # streaming, lease held
            assert len(live_leases(gateway)) == 1
        # Leaving the block closes the connection mid-stream.
    await eventually(lambda: _no_leases(gateway), timeout=1.5)

    async def counted():
        return _requests_ended_as(gateway, "client_disconnected") == 1

    await eventually(counted, timeout=1.5)
    assert _requests_ended_as(gateway, "success") == 0


async def test_client_gone_before_a_whole_answer_still_ends_its_attempt(gateway):
    """A non-streamed attempt ends once its answer has been sent (off the client's critical
    path), and also when sending it fails: the client left while the engine was working."""
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                gateway.url + CHAT_PATH, json=turn(max_tokens=100), timeout=httpx.Timeout(0.2)
            )
        assert len(live_leases(gateway)) == 1  # the engine is still answering
    await eventually(lambda: _no_leases(gateway), timeout=15)


async def test_a_lost_lease_ends_the_stream_with_an_error_event(gateway):
    """The owner no longer holds the lease (it expired there: the edge was cut off or paused
    past lease_timeout): the next renewal says so, and the stream ends as lease_lost."""
    async with httpx.AsyncClient(timeout=20) as http:
        async with http.stream(
            "POST", gateway.url + CHAT_PATH, json=turn(max_tokens=400, stream=True)
        ) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            [lease] = live_leases(gateway)
            ledger = gateway.admission.ledger
            ledger.take_shard(lease.shard, 0.0, EndReason.DROPPED)  # the owner forgets it
            await gateway.deps.leases.renew_all()  # the edge's next renewal round
            rest = [line async for line in lines]
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == "lease_lost"
    assert "[DONE]" not in events
    assert not gateway.deps.leases.held


async def test_a_lost_end_is_ended_by_a_renewal_though_the_edge_holds_nothing_else(gateway):
    """The end message of the edge's only lease in a shard is lost: its renewal rounds still
    list that shard (empty), and the owner ends the lease it kept as unlisted, instead of
    holding it until lease_timeout."""
    reporter = gateway.deps.reporter
    expired = gateway.admission.metrics.leases_expired
    expired_before = sum(s.value for m in expired.collect() for s in m.samples)
    lost = []
    reporter.report = lost.append  # the end message goes nowhere
    try:
        async with httpx.AsyncClient() as http:
            r = await http.post(gateway.url + CHAT_PATH, json=turn())
        assert r.status_code == 200
    finally:
        del reporter.report
    assert len(lost) == 1 and not gateway.deps.leases.held
    [orphan] = live_leases(gateway)
    assert orphan.lease_id == lost[0].lease

    async def ended_by_a_renewal() -> bool:
        await gateway.deps.leases.renew_all()  # a round (the owner ends only settled leases)
        return not live_leases(gateway)

    await eventually(ended_by_a_renewal)
    assert sum(s.value for m in expired.collect() for s in m.samples) == expired_before


async def test_a_failure_of_the_gateway_itself_ends_the_attempt_and_releases_its_lease(gateway):
    """A bug between the grant and the answer (here the upstream client raising what it never
    should): the client gets an OpenAI-shaped 500, the request counts as internal_error, and the
    lease is released instead of being renewed for a request that is over."""
    pool = gateway.deps.upstream

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    pool.post = broken
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(gateway.url + CHAT_PATH, json=turn())
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-request-id"]
    await eventually(lambda: _no_leases(gateway), timeout=2)
    assert not gateway.deps.leases.held
    assert _requests_ended_as(gateway, "internal_error") == 1
