"""A Responses request placed on a provider that serves only chat completions is translated to
chat completions and back: the official openai client, through edge -> admission (NATS) ->
simulated engines that answer 404 on /v1/responses."""

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from inproc import start_edge
from openai import AsyncOpenAI

from llmgw.config import config_from_dict
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import render_chat, token_ids

CHAT_ONLY = ["chat_completions", "completions", "embeddings"]


@pytest.fixture
def engine_params() -> EngineParams:
    """The `gateway`'s engines answer 404 on /v1/responses, as chat-only servers do; their
    model writes 64 tokens, so max_output_tokens cuts each answer (incomplete)."""
    fixed = {"output_len_distribution": "fixed", "output_len_mean": 64}
    return EngineParams.zero_delay(**fixed).model_copy(update={"responses_api": False})


@pytest_asyncio.fixture
async def chat_only(gateway: Any, nats_url: str) -> AsyncIterator[tuple[str, Any, Any]]:
    """A second edge beside `gateway`'s whose providers declare chat completions only."""
    data = gateway.config.model_dump(mode="json")
    for provider in data["providers"]:
        provider["apis"] = CHAT_ONLY
    config = config_from_dict(data, source="<test>", env={})
    edge = await start_edge(config, nats_url, edge_id="edge-chat-only")
    try:
        async with httpx.AsyncClient() as http:  # what the engines are: chat-only
            probe = await http.post(
                gateway.engines["engine-1"].url + "/v1/responses",
                json={"model": "m1", "input": "x"},
            )
        assert probe.status_code == 404
        gateway.received["engine-1"].seen.clear()
        yield edge.url, gateway, edge
    finally:
        await edge.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_chain_on_chat_only_engines_is_translated_both_ways(chat_only, stream):
    url, _, _ = chat_only
    client = AsyncOpenAI(base_url=url + "/v1", api_key="sk-t", max_retries=0)
    previous, conversation = None, []
    for turn in range(3):
        question = f"question {turn}"
        result = await client.responses.create(
            model="m1",
            input=question,
            instructions="be brief",
            max_output_tokens=3,
            previous_response_id=previous,
            stream=stream,
        )
        if stream:
            events = [event async for event in result]
            assert events[0].type == "response.created"
            assert events[-1].type == "response.incomplete"  # stopped at max_output_tokens
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            result = events[-1].response
            assert result.output_text == deltas
        assert result.id.startswith("resp_") and result.previous_response_id == previous
        assert result.usage.output_tokens == 3
        conversation.append({"role": "user", "content": question})
        prompt = [{"role": "system", "content": "be brief"}, *conversation]
        assert result.usage.input_tokens == len(token_ids(render_chat(prompt)))
        conversation.append({"role": "assistant", "content": result.output_text})
        previous = result.id
    stored = await client.responses.retrieve(previous)
    assert stored.output_text == conversation[-1]["content"]


async def test_what_chat_completions_cannot_carry_is_a_400_naming_it_and_the_lease_goes(
    chat_only,
):
    url, gateway, edge = chat_only
    client = AsyncOpenAI(base_url=url + "/v1", api_key="sk-t", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model="m1",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_file", "file_id": "file-1"}],
                }
            ],
        )
    assert caught.value.body["param"] == "input[0].content[0].type"
    assert not edge.deps.leases.held  # admitted, then released at once
    assert not any(recorder.seen for recorder in gateway.received.values())  # no engine called
