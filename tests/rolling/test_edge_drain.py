"""An edge's SIGTERM, step by step, with every service a real process and the shipped defaults.

``/ready`` turns 503 ``draining`` at once while requests are still served for
``router.drain_delay`` (answered with ``Connection: close``); then running requests get
``router.drain_timeout``; what is still running then is ended by the edge: a stream with one SSE
error event ``shutting_down``, a request whose answer had not begun with 503 ``shutting_down``
and Retry-After, and both leases are released at once (the owner holds none long before
``lease_timeout`` could have expired them). The edge exits 0.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from rolling_rig import MODEL, admission_states
from timing import eventually

pytestmark = pytest.mark.e2e

DRAIN_DELAY = 1.5
DRAIN_TIMEOUT = 1.0


def long_chat(session: str, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {session}"}],
        "max_tokens": 3000,  # far longer than the drain deadline
        "ignore_eos": True,  # all of them
        "stream": stream,
    }


async def leases_held(nc) -> int:
    return sum(p.leases for s in await admission_states(nc) for p in s.pairs)


@pytest.mark.parametrize(
    "gateway",
    [{"drain_delay": f"{DRAIN_DELAY}s", "drain_timeout": f"{DRAIN_TIMEOUT}s"}],
    indirect=True,
)
async def test_sigterm_unready_first_then_drains_then_ends_the_rest_and_releases(
    gateway, nats_client
):
    for kind in ("admission", "scraper"):
        await gateway.started(kind)
    edge = await gateway.started("edge")
    async with httpx.AsyncClient(timeout=30) as http:
        stream_cm = http.stream(
            "POST",
            edge.url + "/v1/chat/completions",
            json=long_chat("streamed", True),
            headers={"x-session-id": "streamed"},
        )
        stream = await stream_cm.__aenter__()
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        plain = asyncio.create_task(
            http.post(
                edge.url + "/v1/chat/completions",
                json=long_chat("plain", False),
                headers={"x-session-id": "plain"},
            )
        )
        await eventually(lambda: _held(nats_client, 2), timeout=10, interval=0.1)
        assert (await http.get(edge.admin + "/ready")).status_code == 200

        # Before the signal: the edge may start its drain clock before this process runs again.
        signalled = time.monotonic()
        edge.service.process.terminate()

        async def unready() -> bool:
            r = await http.get(edge.admin + "/ready")
            return r.status_code == 503 and r.json()["status"] == "draining"

        await eventually(unready, timeout=DRAIN_DELAY, interval=0.1)
        # Still served during the delay (the balancer has not noticed yet), connection closed.
        short = await http.post(
            edge.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert time.monotonic() - signalled < DRAIN_DELAY
        assert short.status_code == 200 and short.headers["connection"] == "close"

        rest = [line async for line in lines]
        cut_at = time.monotonic() - signalled
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] != "[DONE]"
        assert json.loads(events[-1])["error"]["code"] == "shutting_down"
        answer = await plain
        assert answer.status_code == 503, "\n".join(edge.service.lines[-60:])
        assert answer.json()["error"]["code"] == "shutting_down"
        assert "retry-after" in answer.headers
        # Ended at the deadline (delay + timeout), not when the upstream would have finished.
        assert DRAIN_DELAY + DRAIN_TIMEOUT <= cut_at < DRAIN_DELAY + DRAIN_TIMEOUT + 5, cut_at
        await stream_cm.__aexit__(None, None, None)

    assert await asyncio.to_thread(edge.service.process.wait, 15) == 0
    # Released by the edge's end messages: lease_timeout (30 s) is far from over.
    await eventually(lambda: _held(nats_client, 0), timeout=3, interval=0.1)
    assert time.monotonic() - signalled < 15


async def _held(nc, count: int) -> bool:
    return await leases_held(nc) == count
