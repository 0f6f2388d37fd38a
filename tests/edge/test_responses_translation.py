"""A Responses request placed on a provider that serves only chat completions is translated to
chat completions and back: the official openai client, through edge -> admission (NATS) ->
simulated engines that answer 404 on /v1/responses."""

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from conftest import gateway_config
from inproc import start_admission, start_edge, stop_servers
from openai import AsyncOpenAI

from llmgw.config import config_from_dict
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import render_chat, token_ids
from llmgw.serving import start_server

CHAT_ONLY = ["chat_completions", "completions", "embeddings"]


class PathRecorder:
    """ASGI middleware around an engine: the path of every POST it received."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest_asyncio.fixture
async def chat_only(nats_url: str, unique_id: str) -> AsyncIterator[tuple[str, dict, Any]]:
    """`gateway_config`'s cluster whose providers and engines speak chat completions only."""
    engines, recorders = {}, {}
    params = EngineParams.zero_delay().model_copy(update={"responses_api": False})
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        app = create_engine_app(params.model_copy(update={"seed": seed}), ["m1", "m2"])
        recorders[name] = PathRecorder(app)
        engines[name] = await start_server(recorders[name])
    config = gateway_config(
        nats_url, {k: v.url for k, v in engines.items()}, f"routing_{unique_id}"
    )
    data = config.model_dump(mode="json")
    for provider in data["providers"]:
        provider["apis"] = CHAT_ONLY
    config = config_from_dict(data, source="<test>", env={})
    admission = await start_admission(config, nats_url, instance="admission-t", follow_load=False)
    edge = await start_edge(config, nats_url, edge_id="edge-t")
    try:
        yield edge.url, recorders, edge
    finally:
        await edge.stop()
        await admission.stop()
        await stop_servers(engines.values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_chain_on_chat_only_engines_is_translated_both_ways(chat_only, stream):
    url, recorders, _ = chat_only
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
    paths = [p for recorder in recorders.values() for p in recorder.paths]
    assert paths == ["/v1/chat/completions"] * 3
    stored = await client.responses.retrieve(previous)
    assert stored.output_text == conversation[-1]["content"]


async def test_what_chat_completions_cannot_carry_is_a_400_naming_it_and_the_lease_goes(
    chat_only,
):
    url, recorders, edge = chat_only
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
    assert [p for recorder in recorders.values() for p in recorder.paths] == []
