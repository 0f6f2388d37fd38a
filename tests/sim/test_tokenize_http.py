"""vLLM's /tokenize and /detokenize on the simulated engine, over real HTTP."""

from __future__ import annotations

import pytest
from sim_helpers import Serve

from llmgw.services.sim.apps import create_engine_app, create_provider_app
from llmgw.services.sim.params import EngineParams, ProviderParams
from llmgw.services.sim.tokenizer import hash_token_blocks

MODEL = "sim-llama"
BLOCK = 4
CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant who answers briefly."},
    {"role": "user", "content": "What is a prefix cache, and why does it help?"},
    {"role": "assistant", "content": "It keeps the KV blocks of prompts it computed."},
    {"role": "user", "content": "And when is it evicted?"},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def engine(**overrides: object):  # type: ignore[no-untyped-def]
    return create_engine_app(EngineParams.zero_delay(block_size=BLOCK, **overrides), [MODEL])


async def test_a_chats_tokens_are_what_the_engine_computes_and_caches_for_it(serve: Serve) -> None:
    app = engine()
    client = await serve(app)
    answer = await client.post(
        "/tokenize", json={"model": MODEL, "messages": CONVERSATION, "tools": TOOLS}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    tokens = body["tokens"]
    assert body == {
        "count": len(tokens),
        "max_model_len": 32768,
        "tokens": tokens,
        "token_strs": None,
    }
    chat = {"model": MODEL, "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 1}
    served = (await client.post("/v1/chat/completions", json=chat)).json()
    assert served["usage"]["prompt_tokens"] == len(tokens)
    # The engine's prefix cache now holds exactly the full blocks of those tokens...
    kv = app.backend.model.kv
    hashes = hash_token_blocks(tokens, BLOCK)
    assert hashes and all(kv.is_cached(h) for h in hashes)
    assert kv.cached_blocks == len(hashes)
    # ...so a completion sent as those very tokens finds all of them (but the last token).
    again = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": tokens, "max_tokens": 1}
    )
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(tokens) - 1) // BLOCK * BLOCK


async def test_a_prompts_tokens_are_the_completions_prompt(serve: Serve) -> None:
    client = await serve(engine())
    prompt = "Once upon a time, in a cache far away"
    body = (await client.post("/tokenize", json={"prompt": prompt})).json()  # model: optional
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    served = (await client.post("/v1/completions", json=completion)).json()
    assert served["usage"]["prompt_tokens"] == body["count"] == len(body["tokens"]) > 0
    hit = {**completion, "prompt": body["tokens"]}
    again = (await client.post("/v1/completions", json=hit)).json()
    assert (
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
        == (body["count"] - 1) // BLOCK * BLOCK
    )


async def test_without_the_generation_prompt_a_chat_is_a_prefix_of_the_one_with_it(
    serve: Serve,
) -> None:
    client = await serve(engine())
    with_it = (await client.post("/tokenize", json={"messages": CONVERSATION})).json()["tokens"]
    without = await client.post(
        "/tokenize", json={"messages": CONVERSATION, "add_generation_prompt": False}
    )
    shorter = without.json()["tokens"]
    assert len(shorter) < len(with_it) and with_it[: len(shorter)] == shorter


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/tokenize", {"model": MODEL}, 400, "a `prompt` or `messages` is required"),
        ("/tokenize", {"messages": [{"content": "no role"}]}, 400, "messages[0]"),
        ("/tokenize", {"prompt": ["not", "text"]}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": CONVERSATION, "continue_final_message": True},
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        ("/tokenize", {"messages": CONVERSATION, "add_special_tokens": "yes"}, 400, "boolean"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "The model `other` does not exist."),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "no vocabulary"),
        ("/detokenize", {"tokens": [1, 2, 3]}, 400, "no vocabulary"),
        ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens"),
    ],
)
async def test_errors_have_vllms_shape(
    serve: Serve, route: str, body: dict[str, object], status: int, message: str
) -> None:
    client = await serve(engine())
    response = await client.post(route, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert message in error["message"]


async def test_a_provider_has_no_tokenizer_api(serve: Serve) -> None:
    client = await serve(create_provider_app(ProviderParams(), [MODEL]))
    assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 404
