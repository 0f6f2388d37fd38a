"""The Responses API through `llmgw up` with the shipped config: the official openai SDK as
agent clients use it, and chains that survive the loss of their replica."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from openai import OpenAI
from up_harness import UpProcess

from llmgw.services.sim.tokenizer import render_chat, token_ids

pytestmark = pytest.mark.e2e

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)
INSTRUCTIONS = "You are terse."


class Chain:
    """A conversation by previous_response_id; what its engine must have been sent."""

    def __init__(self, client: OpenAI) -> None:
        self.client = client
        self.previous: str | None = None
        self.transcript = [{"role": "system", "content": INSTRUCTIONS}]
        self.endpoints: list[str] = []
        self.cached: list[int] = []  # prompt tokens the engine found in its prefix cache

    def turn(self, question: str, *, stream: bool = False) -> None:
        raw = self.client.responses.with_raw_response.create(
            model="llama",
            input=question,
            instructions=INSTRUCTIONS,
            max_output_tokens=6,
            previous_response_id=self.previous,
            stream=stream,
        )
        self.endpoints.append(raw.headers["x-llmgw-endpoint"])
        if stream:
            events = list(raw.parse())
            response = events[-1].response
            assert events[-1].type in ("response.completed", "response.incomplete")
        else:
            response = raw.parse()
        assert response.previous_response_id == self.previous
        self.transcript.append({"role": "user", "content": question})
        # The engine that served this turn was sent the whole conversation: the simulator's
        # prompt tokens are those of every earlier turn, in order, then this one.
        assert response.usage.input_tokens == len(token_ids(render_chat(self.transcript)))
        self.cached.append(response.usage.input_tokens_details.cached_tokens)
        self.transcript.append({"role": "assistant", "content": response.output_text})
        self.previous = response.id


def test_the_openai_sdk_creates_streams_and_chains_responses_unchanged(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config)
    api, key = up.wait_for(READY, timeout=90).groups()
    client = OpenAI(base_url=api, api_key=key, max_retries=0, timeout=30)

    response = client.responses.create(model="llama", input="Hello!", max_output_tokens=8)
    # The model ends most answers before max_output_tokens, as a real one does.
    assert response.output_text and 0 < response.usage.output_tokens <= 8
    assert response.status == "completed" or response.usage.output_tokens == 8
    assert client.responses.retrieve(response.id).output_text == response.output_text

    events = list(client.responses.create(model="qwen", input="Stream it", stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text

    for stream in (False, True):
        chain = Chain(client)
        for turn in range(5):
            chain.turn(f"turn {turn}, what now?", stream=stream)
        assert len(set(chain.endpoints)) == 1, chain.endpoints  # its replica, every turn
        assert all(cached > 0 for cached in chain.cached[1:]), chain.cached  # its prefix cache
        items = client.responses.input_items.list(chain.previous, order="asc", limit=100)
        assert len(items.data) == 9  # five questions, four answers before the last
    assert up.stop(signal.SIGTERM) == 0


def test_a_chain_whose_replica_dies_goes_on_elsewhere_with_the_whole_conversation(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    up = start_up(cluster_config)
    api, key = up.wait_for(READY, timeout=90).groups()
    client = OpenAI(base_url=api, api_key=key, max_retries=0, timeout=30)
    chain = Chain(client)
    for turn in range(3):
        chain.turn(f"turn {turn}: plan a trip")
    replica = chain.endpoints[0]
    assert chain.endpoints == [replica] * 3
    assert replica in ("engine-1", "engine-2")

    os.kill(up.pids()[replica], signal.SIGKILL)
    # Once the supervisor saw it die it waits 0.5 s before a restart: turns 4 and 5 run now.
    up.wait_for(rf"^\[{replica}\] exited with code -9; restarting", timeout=30)
    chain.turn("turn 3: and then?")
    chain.turn("turn 4: and finally?", stream=True)
    assert replica not in chain.endpoints[3:], chain.endpoints
    assert up.stop(signal.SIGTERM) == 0


def test_a_chain_that_overflows_to_the_chat_only_third_party_is_translated(
    cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    """local.yaml's third party speaks chat completions only: with both engines down, turn 3
    runs there as a chat completion, with the whole conversation, and comes back as a
    response the chain goes on from."""
    up = start_up(cluster_config)
    api, key = up.wait_for(READY, timeout=90).groups()
    client = OpenAI(base_url=api, api_key=key, max_retries=0, timeout=30)
    chain = Chain(client)
    chain.turn("turn 0: plan a trip")
    chain.turn("turn 1: and then?")
    assert chain.endpoints[0].startswith("engine-")
    pids = up.pids()
    for engine in ("engine-1", "engine-2"):
        os.kill(pids[engine], signal.SIGKILL)
    for engine in ("engine-1", "engine-2"):
        up.wait_for(rf"^\[{engine}\] exited with code -9; restarting", timeout=30)
    chain.turn("turn 2: over there?", stream=True)
    assert chain.endpoints[2].startswith("tensorx-"), chain.endpoints
    stored = client.responses.retrieve(chain.previous)
    assert stored.output_text == chain.transcript[-1]["content"]
    assert up.stop(signal.SIGTERM) == 0
