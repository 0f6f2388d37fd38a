"""The official anthropic client through edge -> admission (NATS) -> simulated engines.

In `gateway_config` no provider declares `messages`: every request here is translated to chat
completions and back. `native_gateway`'s iris serves the Messages API: passed through.
"""

import json
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
from anthropic import AsyncAnthropic
from inproc import start_admission, start_edge, stop_servers
from sse_app import FixedStream
from test_upstream import set_faults
from test_usage_path import collect_stats
from timing import eventually

from llmgw.core.anthropic import opening
from llmgw.core.requests import Feature
from llmgw.core.sessions import session_id
from llmgw.services.edge.messages import MessagesApi
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server

DATA = Path(__file__).parent.parent / "core" / "data" / "anthropic"  # recorded payloads
# The engines' model writes 64 tokens: each request's max_tokens (all below 64) cuts its answer,
# so its output is max_tokens long and it stops with `max_tokens`.
WRITES_64 = {"output_len_distribution": "fixed", "output_len_mean": 64}


@pytest.fixture
def engine_params() -> EngineParams:
    return EngineParams.zero_delay(**WRITES_64)


@pytest.fixture
def client(gateway):
    return AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0)


async def test_non_streamed_message_has_text_and_usage(client, gateway):
    message = await client.messages.create(
        model="m1", max_tokens=7, messages=[{"role": "user", "content": "hello there"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
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


async def test_tool_use_history_translates_and_the_engine_gets_chat_tool_messages(client, gateway):
    recorded = json.loads((DATA / "anthropic_request_tool_result.json").read_text())
    message = await client.messages.create(
        model="m1",
        max_tokens=4,
        tools=recorded["tools"],
        tool_choice={"type": "auto"},
        messages=recorded["messages"],
    )
    assert message.content[0].type == "text" and message.usage.output_tokens == 4


async def test_messages_are_measured_like_chat(gateway, nats_url):
    nc, seen = await collect_stats(nats_url)
    try:
        async with httpx.AsyncClient() as http:
            response = await http.post(
                gateway.url + "/v1/messages",
                json={
                    "model": "m1",
                    "max_tokens": 5,
                    "stream": True,
                    "messages": [{"role": "user", "content": "count"}],
                },
            )
        assert response.status_code == 200
        assert response.text.rstrip().endswith('data: {"type":"message_stop"}')
        await eventually(lambda: len(seen) == 1)
        assert seen[0].ok and seen[0].output_tokens == 5 and seen[0].input_tokens > 0
    finally:
        await nc.close()
    counted = [
        sample.labels
        for metric in gateway.deps.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "llmgw_edge_requests_total" and sample.value > 0
    ]
    assert [(c["feature"], c["outcome"]) for c in counted] == [("messages", "success")]


# -- a provider that serves the Messages API: passed through ------------------------------------


class PathRecorder:
    """ASGI middleware around an engine: the path and body of every POST it received."""

    def __init__(self, app) -> None:
        self.app = app
        self.paths: list[str] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.paths.append(scope["path"])
            chunks: list[bytes] = []

            async def recording():
                message = await receive()
                if message["type"] == "http.request":
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body"):
                        self.bodies.append(b"".join(chunks))
                return message

            await self.app(scope, recording, send)
            return
        await self.app(scope, receive, send)


@pytest_asyncio.fixture
async def native_gateway(nats_url, unique_id, make_gateway_config):
    """`gateway_config` where iris serves the Messages API (its engines do) and tensorx does not."""
    engines, recorders = {}, {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        params = EngineParams.zero_delay(**WRITES_64).model_copy(
            update={"seed": seed, "messages_api": name != "tensorx-1"}
        )
        recorders[name] = PathRecorder(create_engine_app(params, ["m1", "m2"]))
        engines[name] = await start_server(recorders[name])
    urls = {k: v.url for k, v in engines.items()}
    config = make_gateway_config(nats_url, urls, f"routing_{unique_id}")
    providers = [p.model_dump(exclude_none=True) for p in config.providers]
    providers[0]["apis"] = ["chat_completions", "completions", "messages"]
    config = make_gateway_config(nats_url, urls, f"routing_{unique_id}", providers=providers)
    admission = await start_admission(config, nats_url, instance="adm-m", follow_load=False)
    edge = await start_edge(config, nats_url, edge_id="edge-m")
    try:
        yield edge, recorders
    finally:
        await edge.stop()
        await admission.stop()
        nc = await nats.connect(nats_url)
        await nc.jetstream().delete_key_value(config.pinning.bucket)
        await nc.close()
        await stop_servers(engines.values())


async def test_an_engine_serving_messages_gets_them_as_they_are(native_gateway, nats_url):
    edge, recorders = native_gateway
    nc, seen = await collect_stats(nats_url)
    try:
        client = AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0)
        message = await client.messages.create(
            model="small", max_tokens=6, messages=[{"role": "user", "content": "hi"}]
        )
        async with client.messages.stream(
            model="m1", max_tokens=3, messages=[{"role": "user", "content": "again"}]
        ) as stream:
            final = await stream.get_final_message()
        await eventually(lambda: len(seen) == 2)
    finally:
        await nc.close()
    assert message.usage.output_tokens == 6 and final.usage.output_tokens == 3
    assert recorders["engine-1"].paths == ["/v1/messages", "/v1/messages"]
    assert all(s.ok and s.output_tokens in (3, 6) and s.input_tokens > 0 for s in seen)


THINKING = {
    "model": "m1",
    "max_tokens": 3,
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "messages": [{"role": "user", "content": "think"}],
}


async def test_what_only_the_messages_api_expresses_runs_on_a_provider_serving_it(
    native_gateway,
):
    edge, recorders = native_gateway
    async with httpx.AsyncClient() as http:
        response = await http.post(edge.url + "/v1/messages", json=THINKING)
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"
    assert recorders["engine-1"].paths == ["/v1/messages"]


async def test_and_is_an_anthropic_400_when_placed_on_one_that_does_not(native_gateway):
    """iris's engines are down: the retry lands on tensorx, which speaks chat completions only,
    so the attempt ends (its lease released) with the 400, and tensorx is never called."""
    edge, recorders = native_gateway
    for name in ("engine-1", "engine-2"):
        recorders[name].app = _Refuse()
    async with httpx.AsyncClient() as http:
        response = await http.post(edge.url + "/v1/messages", json=THINKING)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "thinking" in response.json()["error"]["message"]
    assert recorders["tensorx-1"].paths == []
    assert response.headers["x-llmgw-provider"] == "tensorx"


CACHED_TURN = {  # an agent's turn with prompt-caching breakpoints (cache_control, with ttl)
    "model": "m1",
    "max_tokens": 3,
    "cache_control": {"type": "ephemeral"},
    "system": [
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ],
    "tools": [
        {
            "name": "Read",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.txt"}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "alpha", "cache_control": {"type": "ephemeral"}}],
                },
                {"type": "text", "text": "Summarize it.", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
            ],
        },
    ],
}  # fmt: skip


async def test_cache_control_reaches_an_engine_serving_messages_as_the_client_sent_it(
    native_gateway,
):
    edge, recorders = native_gateway
    async with httpx.AsyncClient() as http:
        response = await http.post(edge.url + "/v1/messages", json=CACHED_TURN)
    assert response.status_code == 200, response.text
    assert response.headers["x-llmgw-endpoint"] == "engine-1"
    assert recorders["engine-1"].paths == ["/v1/messages"]
    assert json.loads(recorders["engine-1"].bodies[0]) == CACHED_TURN


async def test_cache_control_is_dropped_when_the_turn_is_translated_for_a_chat_engine(
    native_gateway,
):
    """iris's engines are overloaded: the retry lands on tensorx, which speaks chat completions
    only: it gets the turn as chat, its cached blocks as plain content, no stray field."""
    edge, recorders = native_gateway
    for name in ("engine-1", "engine-2"):
        recorders[name].app = _Refuse()
    async with httpx.AsyncClient() as http:
        response = await http.post(edge.url + "/v1/messages", json=CACHED_TURN)
    assert response.status_code == 200, response.text
    assert response.headers["x-llmgw-endpoint"] == "tensorx-1"
    assert recorders["tensorx-1"].paths == ["/v1/chat/completions"]
    sent = recorders["tensorx-1"].bodies[0]
    assert b"cache_control" not in sent and b"ttl" not in sent
    chat = json.loads(sent)
    system, user, assistant, tool, question = chat["messages"]
    assert system == {"role": "system", "content": "You are an agent."}
    assert user == {"role": "user", "content": "Read a.txt"}
    assert assistant["tool_calls"][0]["function"]["name"] == "Read"
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "alpha"}
    assert question == {"role": "user", "content": "Summarize it."}
    assert chat["tools"][0]["function"]["name"] == "Read"
    assert response.json()["type"] == "message"


class _Refuse:
    """An engine answering 503 to everything (an engine that is overloaded)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b'{"error": {"message": "overloaded", "type": "x", "code": 503}}'
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# -- count_tokens -------------------------------------------------------------------------------


async def test_count_tokens_is_asked_of_an_engine_serving_the_messages_api(native_gateway):
    edge, recorders = native_gateway
    client = AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0)
    short = await client.messages.count_tokens(
        model="m1", messages=[{"role": "user", "content": "hi"}]
    )
    longer = await client.messages.count_tokens(
        model="small",
        system="You are a careful assistant who answers in full sentences.",
        messages=[{"role": "user", "content": "hi there, how many tokens is this?"}],
    )
    assert 0 < short.input_tokens < longer.input_tokens
    assert recorders["engine-1"].paths == ["/v1/messages/count_tokens"] * 2


async def test_count_tokens_without_a_provider_serving_the_api_is_an_anthropic_404(gateway):
    async with httpx.AsyncClient() as http:
        response = await http.post(
            gateway.url + "/v1/messages/count_tokens",
            json={"model": "m1", "messages": [{"role": "user", "content": "x"}]},
        )
        bad = await http.post(
            gateway.url + "/v1/messages/count_tokens",
            json={"model": "m1", "messages": [{"role": "robot", "content": "x"}]},
        )
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert "Messages API" in response.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["type"] == "error"


# -- a stream that fails after it began ---------------------------------------------------------


def anthropic_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


STREAM = {
    "model": "m1",
    "max_tokens": 10,
    "stream": True,
    "messages": [{"role": "user", "content": "x"}],
}


async def test_a_translated_stream_whose_engine_dies_ends_with_an_anthropic_error_event(gateway):
    await set_faults(gateway.engines["engine-1"].url, die_at_token=3)
    async with httpx.AsyncClient() as http:
        response = await http.post(gateway.url + "/v1/messages", json=STREAM)
    events = anthropic_events(response.text)
    assert events[0][0] == "message_start" and "message_stop" not in [e for e, _ in events]
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"]["type"] == "api_error" and data["error"]["message"]


async def test_a_passed_through_stream_whose_engine_dies_ends_with_an_anthropic_error_event(
    native_gateway,
):
    edge, _ = native_gateway
    await set_faults(edge.app.edge.config.endpoint("engine-1").url, die_at_token=3)
    async with httpx.AsyncClient() as http:
        response = await http.post(edge.url + "/v1/messages", json=STREAM)
    events = anthropic_events(response.text)
    assert events[0][0] == "message_start" and "message_stop" not in [e for e, _ in events]
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error"


async def test_a_messages_conversation_is_one_pinned_session_and_its_leases_end(client, gateway):
    history = [{"role": "user", "content": "Plan a trip"}]
    routes = []
    for i in range(3):
        raw = await client.messages.with_raw_response.create(
            model="m1", max_tokens=2, system="You are a travel agent.", messages=history
        )
        routes.append(raw.headers["x-llmgw-route"])
        reply = (await raw.parse()).content[0].text
        history = [
            *history,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"day {i}?"},
        ]
    assert routes == ["new_pin", "pinned", "pinned"]
    session = session_id(
        Feature.CHAT, "m1", opening({"system": "You are a travel agent.", "messages": history})
    )
    assert gateway.admission.ledger.pin("m1", session).provider == "iris"
    await eventually(lambda: not gateway.admission.ledger.leases and not gateway.deps.leases.held)


OVERLOADED = (  # Anthropic's overloaded error in place of a stream's first event
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
    b'"message":"Overloaded"}}\n\n'
)


async def test_a_passed_through_stream_that_begins_with_an_error_is_retried_elsewhere(
    native_gateway,
):
    edge, recorders = native_gateway
    recorders["engine-1"].app = FixedStream(OVERLOADED)
    async with httpx.AsyncClient() as http:
        response = await http.post(edge.url + "/v1/messages", json=STREAM)
    assert response.status_code == 200
    assert response.headers["x-llmgw-endpoint"] == "engine-2"
    assert [e for e, _ in anthropic_events(response.text)][-1] == "message_stop"
    assert recorders["engine-1"].paths == ["/v1/messages"]


def test_an_endpoint_may_say_it_serves_other_apis_than_its_provider(make_gateway_config):
    urls = {name: "http://127.0.0.1:1" for name in ("engine-1", "engine-2", "tensorx-1")}
    config = make_gateway_config("nats://127.0.0.1:1", urls)
    providers = [p.model_dump(exclude_none=True) for p in config.providers]
    providers[0]["apis"] = ["chat_completions", "messages"]
    endpoints = [e.model_dump(exclude_none=True) for e in config.endpoints]
    endpoints[1]["apis"] = ["chat_completions"]  # engine-2: an older engine
    endpoints[2]["apis"] = ["chat_completions", "messages"]  # tensorx-1: newer than its provider
    api = MessagesApi(
        make_gateway_config("nats://127.0.0.1:1", urls, providers=providers, endpoints=endpoints)
    )
    assert api.native == {"engine-1": True, "engine-2": False, "tensorx-1": True}
    assert api.translated_only == {"m1": False, "m2": False}


async def test_failures_of_the_gateway_itself_are_anthropic_500s(gateway):
    """A bug after the grant (the upstream client raising) and one before admission (in the
    Messages adapter): each an Anthropic-shaped 500 `api_error`, no lease left behind."""

    async def broken_post(*args, **kwargs):
        raise RuntimeError("a bug")

    def broken_exchange(*args, **kwargs):
        raise RuntimeError("another bug")

    body = {"model": "m1", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(timeout=20) as http:
        gateway.deps.upstream.post = broken_post
        after_grant = await http.post(gateway.url + "/v1/messages", json=body)
        gateway.app.edge.messages.exchange = broken_exchange
        before_admission = await http.post(gateway.url + "/v1/messages", json=body)
    for response in (after_grant, before_admission):
        assert response.status_code == 500
        assert response.json() == {
            "type": "error",
            "error": {"type": "api_error", "message": "The gateway failed unexpectedly."},
        }
    await eventually(lambda: not gateway.admission.ledger.leases and not gateway.deps.leases.held)


async def test_claude_codes_beta_query_and_headers_are_accepted(gateway):
    """Claude Code posts to /v1/messages?beta=true with anthropic-beta headers, its system
    prompt as cached text blocks and its tools with cache_control marks."""
    body = {
        "model": "m1",
        "max_tokens": 3,
        "stream": True,
        "temperature": 1,
        "metadata": {"user_id": "user_abc_account__session_0f1e"},
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run a command",
                "input_schema": {
                    "$schema": "http://json-schema.org/draft-07/schema#",
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                    "additionalProperties": False,
                },
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}
                ],
            }
        ],
    }
    headers = {
        "x-api-key": "unused",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    async with httpx.AsyncClient() as http:
        response = await http.post(
            gateway.url + "/v1/messages?beta=true", json=body, headers=headers
        )
    assert response.status_code == 200, response.text
    assert [e for e, _ in anthropic_events(response.text)][-1] == "message_stop"
