"""The engine simulator over real HTTP (uvicorn on a loopback port)."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time

import httpx
import openai
import pytest
from sim_helpers import Serve, content_of, metric, read_sse
from timing import eventually

from llmgw.services.sim.apps import create_engine_app, create_provider_app
from llmgw.services.sim.params import EngineParams, ProviderParams

MODEL = "sim-llama"


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_non_streamed_chat_has_text_and_usage(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    request = chat("hello there", max_tokens=7, ignore_eos=True)
    response = await client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 7
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7


async def test_streamed_chat_with_include_usage_ends_with_usage_chunk_then_done(
    serve: Serve,
) -> None:
    client = await serve(create_engine_app(EngineParams(itl_base=0.001), [MODEL]))
    request = chat(
        "stream please",
        max_tokens=5,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    async with client.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks, done, _ = await read_sse(response)
    assert done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [content_of(chunk) for chunk in chunks if content_of(chunk)]
    assert len(contents) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1


async def test_streamed_completion_without_usage_has_no_usage_chunk(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    request = {
        "model": MODEL,
        "prompt": "once upon a time",
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=request) as response:
        chunks, done, _ = await read_sse(response)
    assert done
    assert [bool(chunk["choices"]) for chunk in chunks] == [True] * 4
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_output_length_is_drawn_when_max_tokens_is_absent(serve: Serve) -> None:
    params = EngineParams.zero_delay(output_len_distribution="fixed", output_len_mean=9)
    client = await serve(create_engine_app(params, [MODEL]))
    body = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).json()
    assert body["usage"]["completion_tokens"] == 9
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("kind", ["engine", "provider"])
@pytest.mark.parametrize(
    ("fields", "tokens", "reason"),
    [
        ({"max_tokens": 20}, 9, "stop"),  # the model ended before max_tokens
        ({"max_tokens": 9}, 9, "stop"),  # its end-of-sequence token was the last one allowed
        ({"max_tokens": 5}, 5, "length"),
        ({"max_completion_tokens": 5, "max_tokens": 20}, 5, "length"),
        ({"max_tokens": 20, "ignore_eos": True}, 20, "length"),
        ({"max_tokens": 20, "min_tokens": 12}, 13, "stop"),
        ({"max_tokens": 12, "min_tokens": 12}, 12, "length"),
    ],
)
async def test_output_ends_where_the_model_stops_within_the_requests_limits(
    serve: Serve, kind: str, fields: dict[str, object], tokens: int, reason: str
) -> None:
    nine = {"output_len_distribution": "fixed", "output_len_mean": 9}  # the model writes 9
    if kind == "engine":
        app = create_engine_app(EngineParams.zero_delay(**nine), [MODEL])
    else:
        app = create_provider_app(ProviderParams.zero_delay(**nine), [MODEL])
    client = await serve(app)
    for path, body in (
        ("/v1/chat/completions", chat("hi", **fields)),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", **fields}),
    ):
        answer = (await client.post(path, json=body)).json()
        assert answer["usage"]["completion_tokens"] == tokens, path
        assert answer["choices"][0]["finish_reason"] == reason, path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"max_tokens": 4, "min_tokens": 5},
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        ({"min_tokens": "many"}, "min_tokens: Input should be a valid integer"),
        ({"ignore_eos": "perhaps"}, "ignore_eos: Input should be a valid boolean"),
    ],
)
async def test_bad_min_tokens_or_ignore_eos_is_400_as_vllm_says(
    serve: Serve, fields: dict[str, object], message: str
) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    response = await client.post("/v1/chat/completions", json=chat("hi", **fields))
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
    assert response.json()["error"]["param"] == next(iter(fields.keys() - {"max_tokens"}))


async def test_official_openai_client_streams_and_embeds(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(embedding_dim=16), [MODEL]))
    sdk = openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="unused")
    try:
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        # The SDK asks for base64 embeddings by default and decodes them.
        embedding = await sdk.embeddings.create(model=MODEL, input=["a b", "c"])
        assert [len(item.embedding) for item in embedding.data] == [16, 16]
        models = await sdk.models.list()
        assert [model.id for model in models.data] == [MODEL]
    finally:
        await sdk.close()


async def test_embeddings_are_deterministic_unit_vectors(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(embedding_dim=32), [MODEL]))
    request = {"model": MODEL, "input": ["the same text", "other text", [1, 2, 3]]}
    first = (await client.post("/v1/embeddings", json=request)).json()
    second = (await client.post("/v1/embeddings", json=request)).json()
    vectors = [item["embedding"] for item in first["data"]]
    assert vectors == [item["embedding"] for item in second["data"]]
    assert [len(v) for v in vectors] == [32, 32, 32]
    assert vectors[0] != vectors[1]
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0) for v in vectors)
    assert first["usage"]["prompt_tokens"] > 3
    b64 = (
        await client.post("/v1/embeddings", json={**request, "encoding_format": "base64"})
    ).json()
    decoded = struct.unpack("<32f", base64.b64decode(b64["data"][0]["embedding"]))
    assert decoded == pytest.approx(vectors[0], abs=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", chat("x") | {"model": "nope"}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", chat("x", max_tokens=0), 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
        ("/v1/embeddings", {"model": MODEL, "input": {}}, 400, "input"),
        ("/v1/chat/completions", chat("word " * 300, max_tokens=1), 400, "messages"),
    ],
    ids=[
        "unknown-model",
        "bad-messages",
        "zero-max-tokens",
        "bad-prompt",
        "bad-input",
        "prompt-too-long",
    ],
)
async def test_bad_requests_get_openai_shaped_errors(
    serve: Serve, path: str, body: dict, status: int, param: str
) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(max_model_len=100), [MODEL]))
    response = await client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["param"] == param


async def test_malformed_json_is_400_and_unknown_route_404(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    response = await client.post("/v1/chat/completions", content=b"{nope")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert (await client.get("/v2/anything")).status_code == 404
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def _ttft(client: httpx.AsyncClient, request: dict) -> float:
    """Seconds from sending to the first content chunk; reads the whole stream."""
    started = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=request) as response:
        chunks, done, arrivals = await read_sse(response)
    assert done
    first = next(i for i, chunk in enumerate(chunks) if content_of(chunk))
    return arrivals[first] - started


async def test_prefix_cache_hit_cuts_ttft_and_raises_the_hit_counter(serve: Serve) -> None:
    params = EngineParams(
        prefill_base=0.0, prefill_per_token=0.0005, itl_base=0.001, itl_per_running_seq=0.0
    )
    client = await serve(create_engine_app(params, [MODEL]))
    system = {"role": "system", "content": "You are a careful assistant. " * 80}
    turn_one = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": True,
        "messages": [system, {"role": "user", "content": "first question"}],
    }
    turn_two = {
        **turn_one,
        "messages": [
            *turn_one["messages"],
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
        ],
    }
    cold = await _ttft(client, turn_one)
    hits_before = metric((await client.get("/metrics")).text, "vllm:prefix_cache_hits_total")
    warm = await _ttft(client, turn_two)
    hits_after = metric((await client.get("/metrics")).text, "vllm:prefix_cache_hits_total")
    assert hits_after - hits_before >= 400  # most of the ~480-token system prompt
    assert warm < cold / 2


async def test_queueing_beyond_max_num_seqs_shows_in_metrics_and_ttft(serve: Serve) -> None:
    params = EngineParams(
        max_num_seqs=1,
        prefill_base=0.0,
        prefill_per_token=0.0,
        itl_base=0.02,
        itl_per_running_seq=0.0,
    )
    client = await serve(create_engine_app(params, [MODEL]))
    exact = {"ignore_eos": True, "stream": True}
    first = asyncio.create_task(_ttft(client, chat("one", max_tokens=15, **exact)))

    async def running() -> bool:
        return (await client.get("/sim/state")).json()["running"] == 1

    await eventually(running)
    second = asyncio.create_task(_ttft(client, chat("two", max_tokens=2, **exact)))

    async def waiting() -> bool:
        return (await client.get("/sim/state")).json()["waiting"] == 1

    await eventually(waiting)
    text = (await client.get("/metrics")).text
    assert metric(text, "vllm:num_requests_running", model_name=MODEL) == 1
    assert metric(text, "vllm:num_requests_waiting", model_name=MODEL) == 1
    assert metric(text, "vllm:kv_cache_usage_perc", model_name=MODEL) > 0
    assert "vllm:gpu_cache_usage_perc" not in text  # current vLLM's names (vllm-legacy has it)
    assert metric(text, "vllm:cache_config_info", block_size="16", num_gpu_blocks="4096") == 1
    generated_mid_run = metric(text, "vllm:generation_tokens_total", model_name=MODEL)
    ttft_first, ttft_second = await first, await second
    # The second request waited for the first one's 15 tokens (about 0.3 s).
    assert ttft_second > ttft_first + 0.15
    text = (await client.get("/metrics")).text
    assert metric(text, "vllm:generation_tokens_total", model_name=MODEL) == 17 > generated_mid_run
    assert metric(text, "vllm:num_requests_running", model_name=MODEL) == 0
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 2
    assert metric(text, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 2
    assert metric(text, "vllm:prompt_tokens_total", model_name=MODEL) > 0


async def test_client_disconnect_mid_stream_aborts_the_sequence(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams(itl_base=0.05), [MODEL]))
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json=chat("long", max_tokens=500, ignore_eos=True, stream=True),
    ) as response:
        async for line in response.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break

    async def aborted() -> bool:
        state = (await client.get("/sim/state")).json()
        return state["finished"]["abort"] == 1 and state["running"] == 0

    await eventually(aborted)
    assert (await client.get("/sim/state")).json()["kv_blocks"]["used"] == 0


async def test_fault_knobs_rate_limit_and_errors_can_be_flipped_at_runtime(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(retry_after=3), [MODEL]))
    ok = await client.post("/v1/chat/completions", json=chat("x", max_tokens=1))
    assert ok.status_code == 200

    assert (await client.post("/sim/faults", json={"rate_limit_rate": 1.0})).status_code == 200
    limited = await client.post("/v1/chat/completions", json=chat("x", max_tokens=1))
    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "3"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"

    await client.post("/sim/faults", json={"reset": True, "error_rate": 1.0})
    failed = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"

    await client.post("/sim/faults", json={"reset": True, "unhealthy": True})
    assert (await client.get("/health")).status_code == 503
    await client.post("/sim/faults", json={"reset": True})
    health = await client.get("/health")
    assert (health.status_code, health.text) == (200, "ok")

    bad = await client.post("/sim/faults", json={"error_rate": 2})
    assert bad.status_code == 400
    assert "error_rate" in bad.json()["error"]["message"]


async def test_api_keys_are_checked_on_the_v1_routes_and_can_be_revoked_at_runtime(
    serve: Serve,
) -> None:
    client = await serve(create_provider_app(ProviderParams(api_keys=["sk-1"]), [MODEL]))
    body = chat("x", max_tokens=1)
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 401
    bearer = {"authorization": "Bearer sk-1"}
    assert (await client.post("/v1/chat/completions", json=body, headers=bearer)).status_code == 200
    assert (await client.get("/v1/models", headers={"x-api-key": "sk-1"})).status_code == 200
    assert (await client.get("/health")).status_code == 200  # not an API route: no key
    await client.post("/sim/faults", json={"api_keys": ["sk-2"]})  # sk-1 revoked
    refused = await client.post("/v1/chat/completions", json=body, headers=bearer)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


async def test_error_rate_is_a_seeded_fraction(serve: Serve) -> None:
    async def statuses(seed: int) -> list[int]:
        client = await serve(
            create_engine_app(EngineParams.zero_delay(error_rate=0.5, seed=seed), [MODEL])
        )
        return [
            (
                await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
                )
            ).status_code
            for _ in range(40)
        ]

    first, again = await statuses(5), await statuses(5)
    assert first == again
    assert 8 <= first.count(500) <= 32
    assert set(first) == {200, 500}


async def test_die_at_token_cuts_the_stream_without_done(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams(itl_base=0.001, die_at_token=3), [MODEL]))
    chunks = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat("x", max_tokens=10, ignore_eos=True, stream=True),
        ) as response:
            async for line in response.aiter_lines():
                chunks.append(line)
    contents = [line for line in chunks if '"content":"' in line and '"content":""' not in line]
    assert len(contents) == 3
    assert not any("[DONE]" in line for line in chunks)


async def test_die_at_token_aborts_a_non_streamed_response(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(die_at_token=2), [MODEL]))
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post("/v1/chat/completions", json=chat("x", max_tokens=10, ignore_eos=True))
    # Shorter outputs than the cut point complete normally.
    ok = await client.post("/v1/chat/completions", json=chat("x", max_tokens=2))
    assert ok.status_code == 200


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
async def test_stall_after_headers_is_caught_by_a_read_timeout(serve: Serve, stream: bool) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(stall_after_headers=5), [MODEL]))
    timeout = httpx.Timeout(5.0, read=0.3)
    started = time.monotonic()
    async with client.stream(
        "POST", "/v1/chat/completions", timeout=timeout, json=chat("x", max_tokens=3, stream=stream)
    ) as response:
        assert response.status_code == 200  # headers arrived
        with pytest.raises(httpx.ReadTimeout):
            async for _ in response.aiter_lines():
                pass
    assert time.monotonic() - started < 3


async def test_slow_headers_delays_the_response(serve: Serve) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(slow_headers="200ms"), [MODEL]))
    started = time.monotonic()
    response = await client.post("/v1/chat/completions", json=chat("x", max_tokens=1))
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.2


async def test_loras_load_and_unload_at_run_time_as_vllms_runtime_lora_api_does(
    serve: Serve,
) -> None:
    params = EngineParams.zero_delay(lora_modules=["sql-lora=/adapters/sql"])
    client = await serve(create_engine_app(params, [MODEL]))

    async def lora(action: str, name: str) -> httpx.Response:
        body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
        return await client.post(f"/v1/{action}_lora_adapter", json=body)

    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
        (MODEL, None, MODEL),
        ("sql-lora", MODEL, "/adapters/sql"),
    ]
    missing = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and "lora_path" in missing.json()["error"]["message"]
    assert (await lora("load", "chat-lora")).text == (
        "Success: LoRA adapter 'chat-lora' added successfully."
    )
    again = await lora("load", "chat-lora")
    assert again.status_code == 400 and "already been loaded" in again.text
    ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert ids == [MODEL, "sql-lora", "chat-lora"]
    answered = await client.post("/v1/chat/completions", json={**chat("hi"), "model": "chat-lora"})
    assert answered.status_code == 200 and answered.json()["model"] == "chat-lora"
    assert (await lora("unload", "chat-lora")).status_code == 200
    gone = await lora("unload", "chat-lora")
    assert gone.status_code == 404 and "cannot be found" in gone.text
    refused = await client.post("/v1/chat/completions", json={**chat("hi"), "model": "chat-lora"})
    assert refused.status_code == 404
    assert (await client.get("/sim/state")).json()["adapters"] == {"sql-lora": "/adapters/sql"}


async def test_an_adapter_s_requests_have_a_prefix_cache_of_their_own(serve: Serve) -> None:
    """vLLM puts the adapter's name in its block hashes: what one adapter (or the base model)
    cached is no hit for another."""
    params = EngineParams.zero_delay(lora_modules=["sql-lora", "chat-lora"])
    client = await serve(create_engine_app(params, [MODEL]))

    async def cached(model: str) -> int:
        body = {**chat("the same long prompt, " * 8, max_tokens=1), "model": model}
        response = await client.post("/v1/chat/completions", json=body)
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(MODEL) == 0
    assert await cached("sql-lora") == 0
    assert await cached("sql-lora") > 0
    assert await cached("chat-lora") == 0
    assert await cached(MODEL) > 0


async def test_a_provider_has_no_runtime_lora_api(serve: Serve) -> None:
    client = await serve(create_provider_app(ProviderParams(), [MODEL]))
    body = {"lora_name": "x", "lora_path": "/x"}
    assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 404
