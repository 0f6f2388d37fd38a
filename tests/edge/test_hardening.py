"""Edge hardening: header caps, the HTTP server's own errors as OpenAI JSON, x-request-id kept.

All of it is the edge's HTTP layer: admission is a fake that admits to one simulated engine.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest_asyncio
from fakes import target

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest_asyncio.fixture
async def fake_target():
    """`fake_edge` admits every request to one simulated engine."""
    engine = await start_server(create_engine_app(EngineParams.zero_delay(), ["m1", "m2"]))
    try:
        yield target("iris", "engine-1", engine.url, "m1")
    finally:
        await engine.stop()


async def _raw(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes no well-behaved client would; the status, headers and body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


async def test_ten_thousand_headers_are_refused_with_an_openai_error(fake_edge) -> None:
    # Written as raw bytes: an HTTP client library takes seconds to build 10,000 headers, and
    # here it would share the event loop with the admission instance it starves.
    body = json.dumps(CHAT).encode()
    many = b"".join(b"x-filler-%d: 1\r\n" % i for i in range(10_000))
    status, _, answer = await _raw(
        fake_edge.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n%s\r\n%s" % (len(body), many, body),
    )
    assert status == 431
    assert json.loads(answer)["error"]["code"] == "request_headers_too_large"
    async with httpx.AsyncClient(timeout=30) as client:
        huge = {"x-huge": "a" * 40_000}
        response = await client.post(
            f"{fake_edge.url}/v1/chat/completions", json=CHAT, headers=huge
        )
        assert response.status_code == 431
        assert (
            await client.post(f"{fake_edge.url}/v1/chat/completions", json=CHAT)
        ).status_code == 200


async def test_a_control_character_in_a_header_is_an_openai_shaped_400(fake_edge) -> None:
    body = json.dumps(CHAT).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: llmgw\r\ncontent-type: application/json\r\n"
        b"x-bad: a\x01b\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    status, headers, answer = await _raw(fake_edge.url, request)
    assert status == 400
    assert headers["content-type"] == "application/json"
    error = json.loads(answer)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_request"


async def test_the_clients_request_id_is_kept_and_returned(fake_edge) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        ok = await client.post(
            f"{fake_edge.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "client-42"}
        )
        bad = await client.post(
            f"{fake_edge.url}/v1/chat/completions",
            content=b"{",
            headers={"x-request-id": "client-43"},
        )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "client-42"
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "client-43"
