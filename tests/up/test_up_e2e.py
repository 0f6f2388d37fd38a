"""`llmgw up` end to end: real NATS, simulators, admission and edge as processes."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from up_harness import UpProcess, process_exists

pytestmark = pytest.mark.e2e

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)
SERVICES = {
    "nats",
    "engine-1",
    "engine-2",
    "tensorx-east",
    "tensorx-west",
    "reaper",  # no admission process: the edge runs admission (admission.colocated)
    "scraper",
    "edge",
}


def _chat(api: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{api}/chat/completions",
        json={
            "model": "llama",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
        },
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def _stop_order(up: UpProcess) -> list[str]:
    return [
        line[1:].split("]")[0] for line in up.lines if line.endswith(")") and "] stopping" in line
    ]


def test_up_serves_a_chat_completion_and_stops_cleanly_on_sigterm(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config)
    api, key = up.wait_for(READY, timeout=90).groups()
    pids = up.pids()
    assert set(pids) == SERVICES

    response = _chat(api, key)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] > 0

    assert up.stop(signal.SIGTERM) == 0
    assert "llmgw up: stopped" in up.lines
    assert not [name for name, pid in pids.items() if process_exists(pid)]
    order = _stop_order(up)
    assert order[0] == "edge"
    assert set(order[1:3]) == {"reaper", "scraper"}  # one tier, stopped together
    assert set(order[3:]) == {"engine-1", "engine-2", "tensorx-east", "tensorx-west"}
    # No load balancer in front of `llmgw up`'s edge to wait for: it drains at once.
    assert any("serving 0.0s more before draining" in line for line in up.lines)


def test_up_restarts_a_killed_engine_and_keeps_serving(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config)
    api, key = up.wait_for(READY, timeout=90).groups()
    first_pid = up.pids()["engine-1"]

    os.kill(first_pid, signal.SIGKILL)
    up.wait_for(r"^\[engine-1\] exited with code -9; restarting \(1/5\)", timeout=30)
    up.wait_for(r"^\[engine-1\] ready again", timeout=60)
    second_pid = up.pids()["engine-1"]
    assert second_pid != first_pid and process_exists(second_pid)

    assert _chat(api, key).status_code == 200

    assert up.stop(signal.SIGINT) == 0  # Ctrl-C behaves like SIGTERM
    assert not [pid for pid in up.all_pids() if process_exists(pid)]


def test_children_do_not_outlive_a_killed_supervisor(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config)
    up.wait_for(READY, timeout=90)
    pids = up.pids()

    store = Path(up.wait_for(r"^\[nats\] .* store (\S+)\)$").group(1))

    up.process.kill()  # no chance to stop anything: the children must notice on their own
    up.process.wait(10)
    leftovers = {name: pid for name, pid in pids.items() if _still_alive_after(pid, timeout=15)}
    assert not leftovers
    # Only the killed supervisor could have removed the temporary NATS store.
    assert store.parent.name.startswith("llmgw-nats-")
    shutil.rmtree(store.parent)


def _still_alive_after(pid: int, timeout: float) -> bool:
    """Whether `pid` still runs after `timeout` (orphans exit via their own SIGTERM path)."""
    deadline = time.monotonic() + timeout
    while process_exists(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)  # polling an exit we cannot wait() on: these are not our children
    return False


def test_openai_client_gets_every_api_through_llmgw_up(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    """The quickstart promise: the official SDK works against the cluster `llmgw up` starts."""
    from openai import AuthenticationError, NotFoundError, OpenAI

    up = start_up(cluster_config)
    api, key = up.wait_for(READY, timeout=90).groups()
    # The development key of the ready line is the one the README exports as OPENAI_API_KEY.
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=api, api_key="unused", max_retries=0).models.list()
    client = OpenAI(base_url=api, api_key=key, max_retries=0, timeout=30)

    assert {m.id for m in client.models.list()} == {"llama-3.3-70b", "llama", "qwen2.5-32b", "qwen"}
    reply = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},  # vLLM's field, passed through: exactly 8 tokens
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "Stream it"}],
            max_tokens=6,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6
    completion = client.completions.create(model="llama-3.3-70b", prompt="Once upon", max_tokens=4)
    assert completion.choices[0].text
    embedding = client.embeddings.create(model="qwen2.5-32b", input="embed me")
    assert len(embedding.data[0].embedding) > 0
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    # Bad input through the real edge: clear errors with the documented statuses.
    auth = {"authorization": f"Bearer {key}"}
    bad = httpx.post(f"{api}/chat/completions", content=b"{oops", headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    wrong_type = httpx.post(
        f"{api}/chat/completions",
        json={
            "model": "llama",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": "many",
        },
        headers=auth,
        timeout=10,
    )
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "max_tokens"
    assert up.stop(signal.SIGTERM) == 0
