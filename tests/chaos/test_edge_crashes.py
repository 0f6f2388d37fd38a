"""An edge that dies or stalls while it holds leases: the reaper reclaims exactly what it held,
pins survive, and a stalled edge that wakes up never frees a slot granted to someone else."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest
import yaml
from cluster import MODEL, Service, edge_url, eventually, write_config

from llmgw.config import load_config
from llmgw.core.leasekeys import LEASE_PREFIX, PIN_PREFIX, LeaseSlotValue
from llmgw.events import ALL_EVENTS_SUBJECT, parse_event
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state import check_history
from llmgw.state.history import HistoryRecorder
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.state.setup import limits_from_config

pytestmark = pytest.mark.e2e

LEASE_TIMEOUT = 2.0
REAPER_INTERVAL = 0.2


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
        reaper_interval=f"{REAPER_INTERVAL}s",
    )
    kv = await open_routing_bucket(nats_client.jetstream(), bucket, history=64)
    recorder = await HistoryRecorder(nats_client.jetstream(), bucket).start()
    events = []

    async def record(msg):
        events.append(parse_event(msg.data))

    sub = await nats_client.subscribe(ALL_EVENTS_SUBJECT, cb=record)
    services = {name: Service(name, config) for name in ("admission", "reaper", "edge")}
    for service in services.values():
        await asyncio.to_thread(service.wait_ready)
    yield config, kv, services, events
    for service in services.values():
        service.stop()
    await sub.unsubscribe()
    entries = await recorder.sync(timeout=10)
    await recorder.stop()
    await nats_client.jetstream().delete_key_value(bucket)
    loaded = load_config(config)
    assert check_history(entries, limits_from_config(loaded), LEASE_TIMEOUT) == []


async def taken(kv):
    leases = {}
    for entry in await kv.list(LEASE_PREFIX):
        value = LeaseSlotValue.from_json(entry.value)
        if value.is_taken:
            leases[entry.key] = value.lease_id
    return leases


def chat(session, max_tokens=400):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {session}"}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def open_streams(url, sessions):
    client = httpx.AsyncClient(timeout=60)
    streams = []
    for session in sessions:
        cm = client.stream("POST", url + "/v1/chat/completions", json=chat(session))
        response = await cm.__aenter__()
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        streams.append((cm, lines))
    return client, streams


async def test_a_killed_edge_loses_exactly_its_leases_and_the_pins_survive(world):
    config, kv, services, events = world
    client, _ = await open_streams(edge_url(config), ["a", "b", "c"])
    held = await taken(kv)
    assert len(held) == 3
    pins_before = {e.key for e in await kv.list(PIN_PREFIX)}

    services["edge"].signal(signal.SIGKILL)
    elapsed = await eventually(lambda: _none_taken(kv), timeout=LEASE_TIMEOUT + 5)

    assert elapsed <= LEASE_TIMEOUT + REAPER_INTERVAL + 1.5, elapsed
    expired = sorted(e.lease_id for e in events if e.event == "lease.expired")
    assert expired == sorted(held.values())  # exactly those, each once
    assert {e.key for e in await kv.list(PIN_PREFIX)} == pins_before  # pins survive
    await client.aclose()


async def _none_taken(kv):
    return not await taken(kv)


ONE_SLOT = {
    "max_pinned_sessions": 4,
    "max_global_in_flight_request_slots": 1,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
    "max_per_session_in_flight_request_slots": 1,
}


@pytest.mark.parametrize("world", [ONE_SLOT], indirect=True)
async def test_a_paused_edge_never_frees_a_slot_granted_to_someone_else(world, tmp_path):
    config, kv, services, _ = world
    client, [(cm, lines)] = await open_streams(edge_url(config), ["paused"])
    [(slot_key, paused_lease)] = (await taken(kv)).items()

    services["edge"].signal(signal.SIGSTOP)
    await eventually(lambda: _none_taken(kv), timeout=LEASE_TIMEOUT + 5)
    # The only slot goes to another request, through a second edge.
    second = Service(
        "edge",
        write_config(
            tmp_path / "second.yaml",
            *_same_world(config),
            lease_timeout=f"{LEASE_TIMEOUT}s",
        ),
    )
    await asyncio.to_thread(second.wait_ready)
    try:
        other_client, _ = await open_streams(edge_url(tmp_path / "second.yaml"), ["other"])
        [(regranted_key, other_lease)] = (await taken(kv)).items()
        assert regranted_key == slot_key and other_lease != paused_lease

        services["edge"].signal(signal.SIGCONT)
        # The woken edge finds its lease gone at its next renewal and ends its stream.
        rest = [line async for line in lines]
        error = json.loads([line for line in rest if line.startswith("data: ")][-1][6:])
        assert error["error"]["code"] == "lease_lost"
        # ...and it did not free the slot it no longer holds.
        await asyncio.sleep(0.5)
        assert (await taken(kv)) == {slot_key: other_lease}
        await other_client.aclose()
    finally:
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
