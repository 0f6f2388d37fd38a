"""Bad Messages API input gets Anthropic's error shape and status, and never reaches admission
(`fake_edge`: its `asked` is what reached admission)."""

import json

import httpx
import pytest

PATH = "/v1/messages"


def messages_body(**fields) -> bytes:
    base = {"model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    return json.dumps({**base, **fields}).encode()


def assert_anthropic_error(response, status, kind):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and body["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"{not json", id="malformed-json"),
        pytest.param(b"[]", id="array"),
        pytest.param(json.dumps({"model": "m1", "messages": []}).encode(), id="no-max-tokens"),
        pytest.param(messages_body(messages=[{"role": "tool", "content": "x"}]), id="bad-role"),
        pytest.param(
            messages_body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
            id="unknown-content-block",
        ),
        pytest.param(messages_body(temperature=3), id="temperature"),
        # fake_edge's providers all speak chat completions only: nobody could run these
        pytest.param(
            messages_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
            id="server-tool-untranslatable",
        ),
        pytest.param(
            messages_body(thinking={"type": "enabled", "budget_tokens": 2048}),
            id="thinking-untranslatable",
        ),
    ],
)
async def test_bad_messages_get_anthropic_400_and_take_no_admission(fake_edge, body):
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + PATH, content=body)
    assert_anthropic_error(response, 400, "invalid_request_error")
    assert fake_edge.admission.asked == []
    assert fake_edge.leases.held == {} and fake_edge.leases.ended == []


async def test_unknown_model_is_an_anthropic_404_without_admission(fake_edge):
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + PATH, content=messages_body(model="claude-x"))
    assert_anthropic_error(response, 404, "not_found_error")
    assert fake_edge.admission.asked == []


async def test_oversized_messages_are_an_anthropic_413(fake_edge):
    big = messages_body(messages=[{"role": "user", "content": "x" * 10_000}])
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + PATH, content=big)
    assert_anthropic_error(response, 413, "request_too_large")
    assert fake_edge.admission.asked == []


async def test_an_oversized_token_count_is_an_anthropic_413(fake_edge):
    """count_tokens reads its body as the routed APIs do: over the limit, declared or chunked,
    it is the 413 before anything else is looked at (a body within it would be the 404 of a
    model none of whose endpoints serves the Messages API)."""
    big = messages_body(messages=[{"role": "user", "content": "x" * 10_000}])

    async def chunks():
        for i in range(0, len(big), 1024):
            yield big[i : i + 1024]

    async with httpx.AsyncClient() as http:
        declared = await http.post(fake_edge.url + PATH + "/count_tokens", content=big)
        streamed = await http.post(fake_edge.url + PATH + "/count_tokens", content=chunks())
    assert_anthropic_error(declared, 413, "request_too_large")
    assert_anthropic_error(streamed, 413, "request_too_large")
    assert "4096 bytes" in declared.json()["error"]["message"]


async def test_an_unreachable_engine_is_an_anthropic_error_too(fake_edge):
    """Admitted as chat (fake_edge's target listens nowhere, so every retry fails too): the
    gateway's 502 in Anthropic's shape, and every lease it took ended."""
    async with httpx.AsyncClient() as http:
        response = await http.post(fake_edge.url + PATH, content=messages_body())
    assert_anthropic_error(response, 502, "api_error")
    assert {ask.feature for ask in fake_edge.admission.asked} == {"chat"}
    assert fake_edge.leases.held == {}


async def test_an_unknown_band_is_an_anthropic_400_naming_the_header(fake_edge):
    header = fake_edge.config.admission.band_header
    async with httpx.AsyncClient() as http:
        response = await http.post(
            fake_edge.url + PATH, content=messages_body(), headers={header: "diamond"}
        )
    assert_anthropic_error(response, 400, "invalid_request_error")
    assert header in response.json()["error"]["message"]
    assert fake_edge.admission.asked == []
