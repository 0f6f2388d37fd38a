"""A simulated engine on its model's own tokenizer files (the `tokenizer` parameter): its tokens
are the ones `llmgw.chat_tokenizer` computes from the same files, as a gateway would."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from sim_helpers import Serve
from tokenizer_files import write_tokenizer

from llmgw.chat_tokenizer import ChatTokenizer, TokenizerFilesError
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.main import run_engine
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import hash_token_blocks

MODEL = "sim-llama"
BLOCK = 4
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly."}
TURN_ONE = [SYSTEM, {"role": "user", "content": "What is a prefix cache, and why does it help?"}]
TURN_TWO = [
    *TURN_ONE,
    {"role": "assistant", "content": "It keeps the KV blocks of prompts it computed."},
    {"role": "user", "content": "Tell me a story about a river and a stone."},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Café <menu>"}}]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def engine(files: Path):  # type: ignore[no-untyped-def]
    params = EngineParams.zero_delay(block_size=BLOCK, tokenizer=str(files))
    return create_engine_app(params, [MODEL])


async def test_the_engine_computes_and_caches_the_tokens_the_gateway_computes(
    serve: Serve, files: Path
) -> None:
    gateway_side = ChatTokenizer(files)
    app = engine(files)
    client = await serve(app)
    expected = gateway_side.tokens(TURN_ONE, tools=TOOLS)
    tokenized = await client.post("/tokenize", json={"messages": TURN_ONE, "tools": TOOLS})
    assert tokenized.json()["tokens"] == expected
    chat = {"model": MODEL, "messages": TURN_ONE, "tools": TOOLS, "max_tokens": 1}
    served = (await client.post("/v1/chat/completions", json=chat)).json()
    assert served["usage"]["prompt_tokens"] == len(expected)
    kv = app.backend.model.kv
    hashes = hash_token_blocks(expected, BLOCK)
    assert hashes and all(kv.is_cached(h) for h in hashes) and kv.cached_blocks == len(hashes)


async def test_the_next_turn_finds_the_previous_one_in_the_prefix_cache(
    serve: Serve, files: Path
) -> None:
    client = await serve(engine(files))
    gateway_side = ChatTokenizer(files)
    for turn in (TURN_ONE, TURN_TWO):
        body = {"model": MODEL, "messages": turn, "max_tokens": 1}
        usage = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
    first = len(gateway_side.tokens(TURN_ONE))
    assert usage["prompt_tokens"] == len(gateway_side.tokens(TURN_TWO))
    assert usage["prompt_tokens_details"]["cached_tokens"] == first // BLOCK * BLOCK


async def test_prompts_detokenize_and_token_strings_use_the_vocabulary(
    serve: Serve, files: Path
) -> None:
    gateway_side = ChatTokenizer(files)
    client = await serve(engine(files))
    prompt = "Hello! Tell me a story."
    # A text prompt gets the special tokens the tokenizer adds (llama3's config: a BOS).
    expected = gateway_side.encode(prompt, add_special_tokens=True)
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    served = (await client.post("/v1/completions", json=completion)).json()
    assert served["usage"]["prompt_tokens"] == len(expected)
    asked = {"prompt": prompt, "return_token_strs": True}
    body = (await client.post("/tokenize", json=asked)).json()
    assert body["tokens"] == expected
    assert body["token_strs"] == gateway_side.token_strs(expected)
    text = (await client.post("/detokenize", json={"tokens": expected})).json()["prompt"]
    assert text == gateway_side.decode(expected) and text.endswith(prompt)


async def test_a_conversation_the_template_refuses_is_a_400(serve: Serve, files: Path) -> None:
    client = await serve(engine(files))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response = await client.post("/v1/chat/completions", json=body)
    if files.name.startswith("llama3"):  # its template wants the system prompt first
        assert response.status_code == 400
        assert "first message must be the system prompt" in response.json()["error"]["message"]
    else:
        assert response.status_code == 200


def test_unusable_files_stop_the_engine_before_it_serves(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TokenizerFilesError, match=r"tokenizer_config\.json"):
        create_engine_app(EngineParams(tokenizer=str(tmp_path)), [MODEL])
    args = argparse.Namespace(set=[f"tokenizer={tmp_path}"], port=0, host="127.0.0.1")
    assert run_engine(args) == 2
    assert "llmgw sim engine: tokenizer: " in capsys.readouterr().err
