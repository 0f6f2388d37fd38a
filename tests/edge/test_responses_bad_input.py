"""Bad Responses API input gets the API's own error shape and status, reaches no admission
(`fake_edge.admission.asked`) and stores nothing (the edge's response store)."""

import asyncio
import json
import time

import httpx
import pytest
from test_bad_input import assert_openai_error

from llmgw.core.responses import StoredResponse
from llmgw.services.edge.responses import owner_of

PATH = "/v1/responses"


def _nothing_happened(fake_edge) -> None:
    assert fake_edge.admission.asked == []
    assert fake_edge.deps.responses.kv.history == []  # nothing written to the store


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m1"}, "input"),
        ({"model": "m1", "input": []}, "input"),
        ({"model": "m1", "input": [3]}, "input[0]"),
        ({"model": "m1", "input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"model": "m1", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m1", "input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
        ({"model": "m1", "input": [{"type": {"a": 1}}]}, "input[0].type"),
        ({"model": "m1", "input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"model": "m1", "input": [{"role": "user", "content": [1]}]}, "input[0].content[0]"),
        (
            {"model": "m1", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {"model": "m1", "input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"model": "m1", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "model": "m1",
                "input": "x",
                "tools": [{"type": "function", "name": "f"}, {"type": "mcp"}],
            },
            "tools[1].type",
        ),
        ({"model": "m1", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"model": "m1", "input": "x", "stream": "yes"}, "stream"),
        ({"model": "m1", "input": "x", "store": 1}, "store"),
        ({"model": "m1", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m1", "input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"model": "m1", "input": "x", "background": True}, "background"),
        ({"model": "m1", "input": "x", "conversation": "conv_1"}, "conversation"),
    ],
    ids=[
        "no-model",
        "no-input",
        "empty-input",
        "item-not-object",
        "unknown-item-type",
        "bad-role",
        "role-not-a-string",
        "type-not-a-string",
        "bad-content",
        "bad-content-part",
        "call-without-id",
        "output-without-call-id",
        "built-in-tool",
        "second-tool-built-in",
        "function-without-name",
        "stream-type",
        "store-type",
        "zero-max-output-tokens",
        "previous-id-type",
        "background",
        "conversation",
    ],
)
async def test_malformed_requests_get_400_naming_the_field(fake_edge, body, param):
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + PATH, json=body)
    assert_openai_error(response, 400, param=param)
    assert response.json()["error"]["type"] == "invalid_request_error"
    _nothing_happened(fake_edge)


async def test_an_unknown_previous_response_is_404_before_admission(fake_edge):
    body = {"model": "m1", "input": "x", "previous_response_id": "resp_" + "0" * 32}
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + PATH, json=body)
        not_ours = await http.post(
            fake_edge.url + PATH, json={**body, "previous_response_id": "resp_elsewhere.>"}
        )
    assert_openai_error(response, 404, "previous_response_not_found", "previous_response_id")
    assert_openai_error(not_ours, 404, "previous_response_not_found", "previous_response_id")
    _nothing_happened(fake_edge)


async def test_another_keys_response_is_404_for_every_route(fake_edge):
    store = fake_edge.deps.responses
    theirs = StoredResponse(
        id="resp_" + "a" * 32,
        owner=owner_of(None, "Bearer sk-theirs"),
        root="resp_" + "a" * 32,
        previous=None,
        input=({"type": "message", "role": "user", "content": "secret"},),
        response={"id": "resp_" + "a" * 32, "object": "response", "output": []},
        created_at=0.0,
    )
    await store.kv.put(theirs.id, theirs.encode())
    written = list(store.kv.history)
    mine = {"authorization": "Bearer sk-mine"}
    async with httpx.AsyncClient(headers=mine) as http:
        chained = await http.post(
            fake_edge.url + PATH,
            json={"model": "m1", "input": "x", "previous_response_id": theirs.id},
        )
        got = await http.get(f"{fake_edge.url}{PATH}/{theirs.id}")
        items = await http.get(f"{fake_edge.url}{PATH}/{theirs.id}/input_items")
        deleted = await http.delete(f"{fake_edge.url}{PATH}/{theirs.id}")
        own = await http.get(
            f"{fake_edge.url}{PATH}/{theirs.id}", headers={"authorization": "Bearer sk-theirs"}
        )
    assert_openai_error(chained, 404, "previous_response_not_found", "previous_response_id")
    for response in (got, items, deleted):
        assert_openai_error(response, 404, "not_found")
        assert "secret" not in response.text
    assert own.status_code == 200 and json.loads(own.text)["id"] == theirs.id
    assert fake_edge.admission.asked == []
    assert store.kv.history == written  # still there, nothing else written


async def test_a_store_that_does_not_answer_is_503_within_the_request_timeout(fake_edge):
    class Silent:
        async def get(self, key: str) -> None:
            await asyncio.Event().wait()  # NATS gone: no answer, ever

    fake_edge.deps.responses.kv = Silent()
    body = {"model": "m1", "input": "x", "previous_response_id": "resp_" + "0" * 32}
    started = time.monotonic()
    async with httpx.AsyncClient() as http:
        chained = await http.post(fake_edge.url + PATH, json=body)
        got = await http.get(f"{fake_edge.url}{PATH}/resp_{'0' * 32}")
    assert time.monotonic() - started < 4 * fake_edge.config.nats.request_timeout
    for response in (chained, got):
        assert_openai_error(response, 503, "admission_unavailable")
        assert response.headers["retry-after"] == "1"
    assert fake_edge.admission.asked == []
