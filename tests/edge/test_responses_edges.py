"""Stored responses across edges: two edges on one NATS server (and one admission instance,
simulated engines), a client that sends each turn of a chain to the other edge the moment it has
the previous turn's response (read-your-writes, no 404 window: one edge is far from NATS, so its
writes land well after its answers), and an edge that dies or hangs with a response's write
still pending (the next turn is answered 404 within a bound, never left waiting)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import pytest_asyncio
from inproc import Edge, start_edge
from timing import eventually

from llmgw.services.sim.params import EngineParams
from llmgw.serving import free_port

CHAINS = 8  # chains at once
TURNS = 12  # turns per chain, each on the other edge
LINK_DELAY = 0.03  # seconds each way between the far edge and NATS


@pytest.fixture
def engine_params() -> EngineParams:
    return EngineParams.zero_delay(output_len_distribution="fixed", output_len_mean=64)


class SlowLink:
    """A TCP link with `delay` seconds of latency each way (bytes keep their order): a real
    network path to a NATS server, as from another zone."""

    def __init__(self, target: str, delay: float) -> None:
        self.target = urlparse(target)
        self.delay = delay
        self.port = free_port()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _link(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(self.target.hostname, self.target.port)
        for source, sink in ((client_r, server_w), (server_r, client_w)):
            task = asyncio.ensure_future(self._pump(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await due.get()
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                if not data:
                    sink.close()
                    return
                sink.write(data)
                await sink.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await source.read(65536):
                due.put_nowait((time.monotonic() + self.delay, data))
            due.put_nowait((time.monotonic() + self.delay, b""))
            await delivering
        finally:
            delivering.cancel()


@pytest_asyncio.fixture
async def far_edge(gateway: Any, nats_url: str) -> AsyncIterator[Edge]:
    """Another edge beside `gateway`'s, with the same config (and so the same bucket), whose
    link to NATS has `LINK_DELAY` of latency each way."""
    link = SlowLink(nats_url, LINK_DELAY)
    await link.start()
    edge = await start_edge(gateway.config, f"nats://127.0.0.1:{link.port}", edge_id="edge-far")
    try:
        yield edge
    finally:
        await edge.stop()
        await link.stop()


@pytest_asyncio.fixture
async def second_edge(gateway: Any, nats_url: str) -> AsyncIterator[Edge]:
    """Another edge beside `gateway`'s, with the same config (and so the same bucket)."""
    edge = await start_edge(gateway.config, nats_url, edge_id="edge-other")
    try:
        yield edge
    finally:
        await edge.stop()


async def turn(
    http: httpx.AsyncClient, url: str, text: str, previous: str | None, stream: bool
) -> tuple[int, dict[str, Any]]:
    """One turn: its status and its response object (or error). Streamed, the turn ends for the
    client when it has read the response's last event (it does not wait for the stream to
    close): that is when it sends the next one."""
    body = {
        "model": "m1",
        "input": text,
        "max_output_tokens": 3,
        "previous_response_id": previous,
        "stream": stream,
    }
    if not stream:
        answer = await http.post(url + "/v1/responses", json=body)
        return answer.status_code, answer.json()
    async with http.stream("POST", url + "/v1/responses", json=body) as answer:
        if answer.status_code != 200:
            return answer.status_code, json.loads(await answer.aread())
        async for line in answer.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event["type"] in ("response.completed", "response.incomplete"):
                    return 200, event["response"]
    return 0, {"error": "the stream ended without its last event"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_each_turn_on_the_other_edge_at_once_finds_the_previous_response(
    gateway, far_edge, stream
):
    edges = [gateway.url, far_edge.url]
    failures: list[str] = []

    async def chain(number: int, http: httpx.AsyncClient) -> None:
        previous = None
        for index in range(TURNS):
            status, response = await turn(
                http, edges[(number + index) % 2], f"chain {number} turn {index}", previous, stream
            )
            if status != 200:
                failures.append(f"chain {number} turn {index}: {status} {response}")
                return
            assert response["previous_response_id"] == previous
            previous = response["id"]

    async with httpx.AsyncClient(timeout=10) as http:
        await asyncio.gather(*(chain(number, http) for number in range(CHAINS)))
    assert failures == [], f"{len(failures)} of {CHAINS} chains broke: {failures[:3]}"


async def test_a_response_deleted_on_one_edge_is_gone_from_the_other(gateway, second_edge):
    async with httpx.AsyncClient(timeout=10) as http:
        status, first = await turn(http, gateway.url, "remember", None, False)
        assert status == 200
        status, _ = await turn(http, second_edge.url, "and this", first["id"], False)
        assert status == 200
        other = second_edge.deps.responses
        assert first["id"] in other.recent  # it read the first turn: it holds it now
        gone = await http.delete(f"{gateway.url}/v1/responses/{first['id']}")
        assert gone.status_code == 200
        await eventually(lambda: first["id"] not in other.recent, 5, "the delete told to the other")
        status, error = await turn(http, second_edge.url, "and?", first["id"], False)
        assert status == 404 and error["error"]["code"] == "previous_response_not_found"
        retrieved = await http.get(f"{second_edge.url}/v1/responses/{first['id']}")
        assert retrieved.status_code == 404


def die_before_writing(edge: Any) -> list[str]:
    """Make `edge` die the moment it has handed its next stored response over for writing:
    its write never leaves the process. The ids it kept so."""
    store = edge.deps.responses
    save = store.save
    kept: list[str] = []

    def save_then_die(stored: Any, response_json: bytes | None = None) -> None:
        save(stored, response_json)
        kept.append(stored.id)
        for write in list(store._writes):  # the process is gone before the write goes out
            write.cancel()

    store.save = save_then_die
    return kept


async def test_a_response_whose_edge_died_with_its_write_pending_is_not_found_at_once(
    gateway, second_edge
):
    writer = second_edge.deps.responses
    kept = die_before_writing(second_edge)
    async with httpx.AsyncClient(timeout=10) as http:
        status, response = await turn(http, second_edge.url, "lost", None, False)
        assert status == 200 and kept == [response["id"]]
        await writer.close()  # ...and with the process, its subscriptions: nobody answers
        started = time.monotonic()
        status, error = await turn(http, gateway.url, "next", response["id"], False)
        took = time.monotonic() - started
    assert status == 404 and error["error"]["code"] == "previous_response_not_found"
    assert took < gateway.config.nats.request_timeout / 2  # "no responders": no wait at all


async def test_a_response_whose_edge_hangs_with_its_write_pending_is_not_found_after_the_bound(
    gateway, second_edge
):
    kept = die_before_writing(second_edge)  # its write never lands; the edge still listens
    bound = gateway.config.nats.request_timeout
    async with httpx.AsyncClient(timeout=10) as http:
        status, response = await turn(http, second_edge.url, "stuck", None, False)
        assert status == 200 and kept == [response["id"]]
        started = time.monotonic()
        status, error = await turn(http, gateway.url, "next", response["id"], False)
        took = time.monotonic() - started
    assert status == 404 and error["error"]["code"] == "previous_response_not_found"
    # The writer waited its bound for its write, answered nothing; the asker's own bound (the
    # same) ran out meanwhile: one bound, not two, and well before the client's timeout.
    assert bound * 0.9 <= took < bound * 2, took
