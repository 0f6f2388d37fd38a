"""An edge that dies or stalls while it holds leases, with every service a real process and the
shipped defaults on (flow control, a scraper, the reaper).

The shard's owner (admission) holds the leases in memory and renews them from the edges' lists:
a killed edge's leases end within ``lease_timeout`` (each announced once as lease.expired) and
its sessions' pins survive; a paused edge that wakes finds its lease gone (``lease_lost``) and
its late end message frees nothing granted since. What the instances hold is read from their
state subject and what the edges hold from a roll call: the protocol's own observables.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
import yaml
from cluster import MODEL, Service, edge_url, stop_all, write_config
from timing import eventually

from llmgw.events import EVENTS_SUBJECT_PREFIX, parse_event
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.wire import (
    ADMISSION_ROLLCALL_SUBJECT,
    ADMISSION_STATE_SUBJECT,
    REQUEST_STATS_SUBJECT,
    RequestEnded,
    RollCall,
    RollCallAnswer,
    StateReply,
)

pytestmark = pytest.mark.e2e

LEASE_TIMEOUT = 2.0
SHARDS = 32  # the shipped default
LEASE_EVENTS_SUBJECT = f"{EVENTS_SUBJECT_PREFIX}.lease.>"


@pytest.fixture
async def engine():
    server = await start_server(
        create_engine_app(EngineParams.zero_delay(itl_base="50ms"), [MODEL])
    )
    yield server
    await server.stop()


@pytest.fixture
async def world(tmp_path, nats_url, nats_client, unique_id, engine, request):
    limits = getattr(request, "param", None) or {
        "max_pinned_sessions": 8,
        "max_global_in_flight_request_slots": 8,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
        "max_per_session_in_flight_request_slots": 2,
    }
    bucket = f"chaos_{unique_id}"
    config = write_config(
        tmp_path / "config.yaml",
        nats_url,
        engine.url,
        bucket,
        limits,
        lease_timeout=f"{LEASE_TIMEOUT}s",
    )
    events = []

    async def record(msg):
        events.append(parse_event(msg.data))

    sub = await nats_client.subscribe(LEASE_EVENTS_SUBJECT, cb=record)
    # One tier at a time, as `llmgw up` starts them: admission, scraper and reaper together,
    # then the edge.
    services = {name: Service(name, config) for name in ("admission", "scraper", "reaper")}
    await asyncio.gather(*(asyncio.to_thread(s.wait_ready) for s in services.values()))
    services["edge"] = Service("edge", config)
    await asyncio.to_thread(services["edge"].wait_ready)
    kv = await open_routing_bucket(nats_client.jetstream(), bucket, history=64)
    yield config, kv, services, events
    stop_all(services.values())
    await sub.unsubscribe()
    await nats_client.jetstream().delete_key_value(bucket)


async def held_by_admission(nc) -> StateReply:
    """What the (single) admission instance holds now."""
    reply = await nc.request(ADMISSION_STATE_SUBJECT, b"", timeout=2)
    return StateReply.model_validate_json(reply.data)


def leases_held(state: StateReply) -> int:
    return sum(pair.leases for pair in state.pairs)


def pins_held(state: StateReply) -> int:
    return sum(pair.pins for pair in state.pairs)


async def leases_of_edges(nc, edges: int) -> dict[str, set[str]]:
    """Roll call over every shard: each live edge that holds leases answers with them (waits
    for `edges` answers)."""
    answers: dict[str, set[str]] = {}
    done = asyncio.Event()

    async def collect(msg):
        answer = RollCallAnswer.model_validate_json(msg.data)
        answers[answer.edge] = {lease.lease_id for lease in answer.leases}
        if len(answers) >= edges:
            done.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    call = RollCall(owner="chaos-test", shards=tuple(range(SHARDS)))
    await nc.publish(ADMISSION_ROLLCALL_SUBJECT, call.model_dump_json().encode(), reply=inbox)
    await asyncio.wait_for(done.wait(), 5)
    await sub.unsubscribe()
    return answers


def chat(session, max_tokens=400):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {session}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # streams as long as max_tokens
        "stream": True,
    }


async def open_streams(url, sessions):
    client = httpx.AsyncClient(timeout=60)
    streams = []
    for session in sessions:
        cm = client.stream(
            "POST",
            url + "/v1/chat/completions",
            json=chat(session),
            headers={"x-session-id": session},
        )
        response = await cm.__aenter__()
        assert response.status_code == 200, await response.aread()
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        streams.append((cm, lines))
    return client, streams


async def test_a_killed_edge_loses_exactly_its_leases_and_the_pins_survive(world, nats_client):
    config, _kv, services, events = world
    client, _ = await open_streams(edge_url(config), ["a", "b", "c"])
    [held] = (await leases_of_edges(nats_client, 1)).values()
    assert len(held) == 3
    before = await held_by_admission(nats_client)
    assert leases_held(before) == 3 and pins_held(before) == 3

    services["edge"].signal(signal.SIGKILL)
    killed_at = time.monotonic()

    async def none_held():
        return leases_held(await held_by_admission(nats_client)) == 0

    await eventually(none_held, timeout=LEASE_TIMEOUT + 5, interval=0.05)
    elapsed = time.monotonic() - killed_at
    # Ended by the owner's expiry sweep: lease_timeout after the last renewal, plus one sweep.
    assert elapsed <= LEASE_TIMEOUT + 1.5, elapsed
    expired = sorted(e.lease_id for e in events if e.event == "lease.expired")
    assert expired == sorted(held)  # exactly those, each once
    after = await held_by_admission(nats_client)
    # The sessions keep their engine (and its prefix cache): their owner holds their pins (in
    # memory only: a new pin is written to the bucket once its session comes back).
    assert pins_held(after) == 3
    await client.aclose()


ONE_SLOT = {
    "max_pinned_sessions": 4,
    "max_global_in_flight_request_slots": 1,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
    "max_per_session_in_flight_request_slots": 1,
}


@pytest.mark.parametrize("world", [ONE_SLOT], indirect=True)
async def test_a_paused_edge_never_frees_a_slot_granted_to_someone_else(
    world, tmp_path, nats_client
):
    config, _kv, services, events = world
    client, [(cm, lines)] = await open_streams(edge_url(config), ["paused"])
    [paused_leases] = (await leases_of_edges(nats_client, 1)).values()
    [paused_lease] = paused_leases

    services["edge"].signal(signal.SIGSTOP)

    async def none_held():
        return leases_held(await held_by_admission(nats_client)) == 0

    await eventually(none_held, timeout=LEASE_TIMEOUT + 5, interval=0.05)
    assert [e.lease_id for e in events if e.event == "lease.expired"] == [paused_lease]
    # The only slot goes to another request, through a second edge.
    second_config = write_config(
        tmp_path / "second.yaml", *_same_world(config), lease_timeout=f"{LEASE_TIMEOUT}s"
    )
    second = Service("edge", second_config)
    await asyncio.to_thread(second.wait_ready)
    ended: list[RequestEnded] = []

    async def on_ended(msg):
        ended.append(RequestEnded.model_validate_json(msg.data))

    sub = await nats_client.subscribe(REQUEST_STATS_SUBJECT, cb=on_ended)
    try:
        other_client, _ = await open_streams(edge_url(second_config), ["other"])
        [other_leases] = (await leases_of_edges(nats_client, 1)).values()  # the paused one sleeps
        [other_lease] = other_leases
        assert other_lease != paused_lease
        assert leases_held(await held_by_admission(nats_client)) == 1

        services["edge"].signal(signal.SIGCONT)
        # The woken edge finds its lease gone at its next renewal and ends its stream.
        rest = [line async for line in lines]
        error = json.loads([line for line in rest if line.startswith("data: ")][-1][6:])
        assert error["error"]["code"] == "lease_lost"

        async def paused_end_seen():
            return any(e.outcome == "lease_lost" for e in ended)

        # Its end message went out: lease_lost, releasing nothing (it knows it holds nothing)...
        await eventually(paused_end_seen, timeout=5, interval=0.05)
        [lost_end] = [e for e in ended if e.outcome == "lease_lost"]
        assert lost_end.lease is None and not lost_end.sent
        # ...and freed nothing: the slot is still the other request's.
        state = await held_by_admission(nats_client)
        assert leases_held(state) == 1
        # Edges answer a roll call only with leases: the woken one holds none now.
        assert list((await leases_of_edges(nats_client, 1)).values()) == [{other_lease}]
        await other_client.aclose()
    finally:
        await sub.unsubscribe()
        second.stop()
    await cm.__aexit__(None, None, None)
    await client.aclose()


def _same_world(config):
    data = yaml.safe_load(config.read_text())
    return (
        data["nats"]["url"],
        data["endpoints"][0]["url"],
        data["pinning"]["bucket"],
        data["providers"][0]["models"][0]["limits"],
    )
