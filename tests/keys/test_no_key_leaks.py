"""Neither clients' keys nor providers' keys appear in logs, NATS messages, metrics or errors."""

from __future__ import annotations

import logging

import httpx
import nats
import pytest
from prometheus_client import generate_latest

from llmgw.services.edge.app import Edge

# One cluster for the module (conftest: keyed_cluster), so one event loop for it too.
pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_keys_never_leave_the_edge_except_upstream(keyed, caplog) -> None:
    provider_key = keyed.provider_key
    caplog.set_level(logging.DEBUG)
    seen: list[bytes] = []
    tap = await nats.connect(keyed.nats_url)

    async def keep(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg.subject.encode() + b" " + repr(msg.headers).encode() + b" " + msg.data)

    await tap.subscribe(">", cb=keep)  # every subject: KV writes, events, stats, usage
    await tap.flush()
    created = await keyed.keys("create", "--tenant", "team-a", "--models", "m1", "--rpm", "3")
    secret = created["secret"]
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answers: list[str] = []
    async with httpx.AsyncClient(timeout=10) as client:
        for url in keyed.edges:
            for headers, extra in (
                ({"authorization": f"Bearer {secret}"}, {}),
                ({"authorization": f"Bearer {secret}"}, {"model": "m2"}),  # not its model
                ({"authorization": f"Bearer {secret}x"}, {}),  # wrong key
                ({"authorization": f"Bearer {secret}"}, {"stream": True}),
                ({"authorization": f"Bearer {secret}"}, {}),  # past its rpm
            ):
                response = await client.post(
                    f"{url}/v1/chat/completions", json={**body, **extra}, headers=headers
                )
                answers.append(f"{response.status_code} {response.headers} {response.text}")
    await tap.flush()
    await tap.close()
    assert any(a.startswith("429") for a in answers) and any(a.startswith("401") for a in answers)
    metrics = [
        generate_latest(edge.deps.metrics.registry).decode() for edge in keyed.cluster.edges
    ] + [generate_latest(a.metrics.registry).decode() for a in keyed.cluster.live_admissions()]
    texts = {
        "logs": caplog.text,
        "NATS": b"\n".join(seen).decode(errors="replace"),
        "metrics": "\n".join(metrics),
        "responses": "\n".join(answers),
    }
    assert texts["NATS"]  # the tap heard the traffic
    for where, text in texts.items():
        for leaked in (secret, secret[len(created["prefix"]) :], provider_key):
            assert leaked not in text, f"a key appears in {where}"
    # ... while the upstream key is what the edge sends to the third party.
    edge: Edge = keyed.cluster.edges[0].app.edge
    assert edge.upstream_headers["tensorx"]["authorization"] == f"Bearer {provider_key}"
