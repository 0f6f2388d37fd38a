"""Bad input gets a clear OpenAI-shaped error, and never reaches admission.

The edge's own checks run over a fake admission client (`fake_edge`: its `asked` is what
reached admission); what happens when admission is missing or silent is asked over NATS.
"""

import asyncio
import time

import httpx
import pytest

from llmgw.wire import ADMISSION_REQUEST_PREFIX

CHAT_PATH = "/v1/chat/completions"
OK_BODY = b'{"model": "m1", "messages": [{"role": "user", "content": "x"}]}'


def assert_openai_error(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"\xff", None),
        (b"[]", None),
        (b"[" * 2000 + b"]" * 2000, None),
        (
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
        ),
        (
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            "max_tokens",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
    ids=[
        "malformed",
        "bad-utf8",
        "array",
        "deep-nesting",
        "stream-type",
        "negative-max-tokens",
        "no-model",
    ],
)
async def test_invalid_bodies_get_400_and_take_no_admission(fake_edge, body, param):
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + CHAT_PATH, content=body)
    assert_openai_error(response, 400, param=param)
    assert fake_edge.admission.asked == []


async def test_unknown_model_is_404_without_admission(fake_edge):
    async with httpx.AsyncClient() as http:
        response = await http.post(
            fake_edge.url + CHAT_PATH, content=OK_BODY.replace(b"m1", b"gpt-9")
        )
    assert_openai_error(response, 404, code="model_not_found", param="model")
    assert fake_edge.admission.asked == []


async def test_oversized_bodies_get_413_honest_chunked_or_lying(fake_edge):
    big = b'{"model": "m1", "messages": [{"role": "user", "content": "' + b"x" * 10_000 + b'"}]}'

    async def chunked():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async with httpx.AsyncClient() as http:
        honest = await http.post(fake_edge.url + CHAT_PATH, content=big)
        streamed = await http.post(fake_edge.url + CHAT_PATH, content=chunked())
    assert_openai_error(honest, 413, code="request_too_large")
    assert_openai_error(streamed, 413, code="request_too_large")

    # A declared length over the limit is refused at once, without waiting
    # for (or reading) a body that never comes.
    reader, writer = await asyncio.open_connection(fake_edge.server.host, fake_edge.server.port)
    writer.write(
        b"POST "
        + CHAT_PATH.encode()
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 50000000\r\n\r\n{"
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert b" 413 " in status_line
    assert fake_edge.admission.asked == []


async def test_missing_admission_service_gets_503_with_retry_after_at_once(gateway):
    await gateway.admission_handle.stop()
    started = time.monotonic()
    async with httpx.AsyncClient() as http:
        response = await http.post(gateway.url + CHAT_PATH, content=OK_BODY)
    assert_openai_error(response, 503, code="admission_unavailable")
    assert int(response.headers["retry-after"]) >= 1
    assert time.monotonic() - started < gateway.config.nats.request_timeout + 1


async def test_silent_admission_service_gets_503_within_the_request_timeout(gateway, nats_client):
    """A hung admission service (it takes the request and never answers, as a SIGSTOPped one
    does) costs the client the request timeout, not the queue budget."""
    await gateway.admission_handle.stop()
    swallowed = []

    async def swallow(msg):
        swallowed.append(msg)

    sub = await nats_client.subscribe(ADMISSION_REQUEST_PREFIX + "*", cb=swallow)
    await nats_client.flush()
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(gateway.url + CHAT_PATH, content=OK_BODY)
    elapsed = time.monotonic() - started
    await sub.unsubscribe()
    assert_openai_error(response, 503, code="admission_unavailable")
    assert swallowed, "the request did reach the (silent) admission subscriber"
    assert (
        gateway.config.nats.request_timeout <= elapsed < gateway.config.nats.request_timeout + 1.5
    )


async def test_unknown_routes_and_methods_are_openai_shaped(fake_edge):
    async with httpx.AsyncClient() as http:
        missing = await http.get(fake_edge.url + "/v1/nothing")
        wrong_method = await http.get(fake_edge.url + CHAT_PATH)
    assert_openai_error(missing, 404)
    assert_openai_error(wrong_method, 405)
