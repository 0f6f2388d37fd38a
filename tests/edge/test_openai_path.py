"""The official openai client through edge -> admission (NATS) -> simulated engine."""

import httpx
import pytest
from openai import AsyncOpenAI


@pytest.fixture
def client(gateway):
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


async def test_non_streamed_chat_completion_has_content_and_usage(client):
    response = await client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=7,
        extra_body={"ignore_eos": True},  # vLLM's field, passed through: exactly 7 tokens
    )
    assert response.choices[0].message.content
    assert response.usage.completion_tokens == 7
    assert response.usage.prompt_tokens > 0


async def test_streamed_chat_completion_arrives_in_chunks_with_usage(client):
    stream = await client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_completion_embedding_and_model_list(client):
    completion = await client.completions.create(model="m2", prompt="Once upon", max_tokens=3)
    assert completion.choices[0].text
    embedding = await client.embeddings.create(model="m1", input=["a", "b"])
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) > 0
    models = {m.id async for m in client.models.list()}
    assert models == {"m1", "small", "m2"}


async def test_alias_is_resolved_and_served_by_the_first_managed_endpoint(gateway):
    async with httpx.AsyncClient() as http:
        response = await http.post(
            gateway.url + "/v1/chat/completions",
            json={
                "model": "small",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
            },
        )
    assert response.status_code == 200
    assert response.headers["x-llmgw-provider"] == "iris"
    assert response.headers["x-llmgw-endpoint"] == "engine-1"
    assert response.json()["model"] == "m1"


async def test_unhealthy_endpoints_are_skipped_then_overflow_goes_to_the_unlimited_provider(
    gateway,
):
    board = gateway.admission.health
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with httpx.AsyncClient() as http:
        board.set_healthy("engine-1", False)
        first = await http.post(gateway.url + "/v1/chat/completions", json=body)
        board.set_healthy("engine-2", False)
        second = await http.post(gateway.url + "/v1/chat/completions", json=body)
        # m2 has no unlimited provider: with iris degraded there is nowhere to go.
        third = await http.post(gateway.url + "/v1/chat/completions", json={**body, "model": "m2"})
    assert first.headers["x-llmgw-endpoint"] == "engine-2"
    assert second.headers["x-llmgw-provider"] == "tensorx"
    assert third.status_code == 503 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "no_capacity"
