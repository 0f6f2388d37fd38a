"""Usage and per-request stats: injected for streams whose client did not ask, never shown to it."""

from __future__ import annotations

import json

import httpx
import nats
from timing import eventually

from llmgw.wire import REQUEST_STATS_SUBJECT, RequestEnded

CHAT = {
    "model": "m1",
    "messages": [{"role": "user", "content": "count to five"}],
    "max_tokens": 5,
    "ignore_eos": True,  # exactly five tokens
}


async def collect_stats(nats_url: str) -> tuple[object, list[RequestEnded]]:
    nc = await nats.connect(nats_url)
    seen: list[RequestEnded] = []

    async def on_stats(msg) -> None:
        seen.append(RequestEnded.model_validate_json(msg.data))

    await nc.subscribe(REQUEST_STATS_SUBJECT, cb=on_stats)
    await nc.flush()
    return nc, seen


def events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]


async def test_a_stream_without_include_usage_gets_no_usage_chunk_but_is_measured(
    gateway, nats_url
):
    nc, seen = await collect_stats(nats_url)
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(
                gateway.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10
            )
        assert response.status_code == 200
        payloads = events(response.text)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks and all(c["choices"] and "usage" not in c for c in chunks)
        await eventually(lambda: len(seen) == 1)
        stats = seen[0]
        assert stats.ok and stats.output_tokens == 5 and stats.input_tokens > 0
        assert stats.endpoint == response.headers["x-llmgw-endpoint"] and stats.latency > 0
    finally:
        await nc.close()


async def test_a_stream_that_asked_for_usage_still_gets_it(gateway, nats_url):
    nc, seen = await collect_stats(nats_url)
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(
                gateway.url + "/v1/chat/completions",
                timeout=10,
                json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            )
        chunks = [json.loads(p) for p in events(response.text)[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        await eventually(lambda: len(seen) == 1)
        assert seen[0].output_tokens == 5
    finally:
        await nc.close()


async def test_non_streamed_requests_and_failures_are_measured(gateway, nats_url):
    nc, seen = await collect_stats(nats_url)
    try:
        async with httpx.AsyncClient() as client:
            ok = await client.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert ok.status_code == 200
            await gateway.engines["engine-1"].stop()  # the preferred engine goes away
            gateway.admission.health.set_healthy("engine-2", False)
            failed = await client.post(
                gateway.url + "/v1/chat/completions", json={**CHAT, "model": "m2"}, timeout=10
            )
        assert failed.status_code == 502
        await eventually(lambda: len(seen) == 2)
        good, bad = seen
        assert good.ok and good.output_tokens == 5
        assert not bad.ok and (bad.input_tokens, bad.output_tokens) == (0, 0)
        assert bad.endpoint == "engine-1"
    finally:
        await nc.close()
