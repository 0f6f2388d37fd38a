"""API keys on the Messages API: Anthropic's `x-api-key` header is a key like a bearer token."""

from __future__ import annotations

import httpx
import pytest
from anthropic import AsyncAnthropic, AuthenticationError

pytestmark = pytest.mark.asyncio(loop_scope="module")

MESSAGES = {"model": "m1", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_x_api_key_is_the_key_for_messages_and_every_other_route(keyed) -> None:
    created = await keyed.keys("create", "--tenant", "team-x")
    url = keyed.edges[0]
    client = AsyncAnthropic(base_url=url, api_key=created["secret"], max_retries=0)
    message = await client.messages.create(**MESSAGES)
    assert 0 < message.usage.output_tokens <= 3
    with pytest.raises(AuthenticationError) as refused:
        await AsyncAnthropic(base_url=url, api_key="sk-llmgw-nope", max_retries=0).messages.create(
            **MESSAGES
        )
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"
    async with httpx.AsyncClient(timeout=10) as http:
        chat = await http.post(
            f"{url}/v1/chat/completions",
            headers={"x-api-key": created["secret"]},
            json={"model": "m1", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        )
        models = await http.get(f"{url}/v1/models", headers={"x-api-key": created["secret"]})
    assert chat.status_code == 200 and models.status_code == 200
