"""The official anthropic client through edge -> admission (NATS) -> simulated engines.

In `gateway_config` no provider declares `messages`: every request here is translated to chat
completions and back. `native_gateway`'s iris serves the Messages API: passed through.
"""

import httpx
import pytest
from anthropic import AsyncAnthropic

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a given location",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}


@pytest.fixture
def client(gateway):
    return AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0)


async def test_non_streamed_message_has_text_and_usage(client, gateway):
    message = await client.messages.create(
        model="m1", max_tokens=7, messages=[{"role": "user", "content": "hello there"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens == 7 and message.usage.input_tokens > 0
    assert message.model == "m1"


async def test_streamed_message_accumulates_with_the_sdk(client):
    async with client.messages.stream(
        model="m1",
        max_tokens=5,
        system="You are terse.",
        messages=[{"role": "user", "content": "tell me a story"}],
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == final.content[0].text and final.content[0].text
    assert final.usage.output_tokens == 5 and final.usage.input_tokens > 0
    assert final.stop_reason == "max_tokens"


async def test_x_api_key_and_anthropic_errors(gateway):
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        response = await http.post(
            "/v1/messages",
            headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
            json={"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
        )
    assert response.status_code == 404
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "not_found_error"
