"""The prompt's chains an edge sends admission (services/edge/prompts.py): the text chain of
any chat or completions prompt, and with a model's tokenizer its engine's token chain, from the
model's own files (a real byte-level BPE and chat template built at test time) or from an
engine's /tokenize (a real simulated engine). A tokenizer that cannot answer costs the token
chain, never the request."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from llmgw.chat_tokenizer import ChatTokenizer
from llmgw.config import Config, config_from_dict
from llmgw.core.prefix import TokenStore, token_chain, unpack
from llmgw.services.edge.prompts import NO_PROMPT, PromptChains, TokenizerUnavailable
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import RunningServer, free_port, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenizer_files import write_tokenizer

SYSTEM = "You are a careful assistant who answers briefly. " * 40


def config_with(tokenizer: str | None, url: str = "http://127.0.0.1:1") -> Config:
    return config_from_dict(
        {
            "models": [{"name": "m", "tokenizer": tokenizer}],
            "providers": [{"id": "p", "kind": "managed", "models": [{"name": "m"}]}],
            "endpoints": [
                {
                    "id": "e1",
                    "url": url,
                    "provider": "p",
                    "models": ["m"],
                    "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"},
                }
            ],
        },
        source="<test>",
        env={},
    )


def chat(*turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user", "content": turn} for turn in turns]
    return {"model": "m", "messages": messages}


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return write_tokenizer(tmp_path / "tok", "chatml")


async def test_the_token_chain_is_the_engines_tokens_in_kv_blocks(tokenizer_dir: Path) -> None:
    chains = PromptChains(config_with(str(tokenizer_dir)))
    body = chat("What is a prefix cache?")
    got = await chains.of("chat", body, None, "m")
    expected = ChatTokenizer(tokenizer_dir).tokens(body["messages"])
    assert got.token_count == len(expected) and got.token_block == 16
    assert unpack(got.tokens) == tuple(token_chain(expected, 16))
    assert got.text and got.length > len(SYSTEM)
    await chains.aclose()


async def test_a_conversations_earlier_tokens_are_not_tokenized_again(tokenizer_dir: Path) -> None:
    chains = PromptChains(config_with(str(tokenizer_dir)))
    tokens = chains._tokens["m"]
    calls = []
    real = tokens._local.encode_with_ends  # type: ignore[union-attr]

    def counting(text: str) -> tuple[list[int], list[int]]:
        calls.append(len(text))
        return real(text)

    tokens._local.encode_with_ends = counting  # type: ignore[union-attr,method-assign]
    first = await chains.of("chat", chat("What is a prefix cache?"), None, "m")
    second = await chains.of("chat", chat("What is a prefix cache?", "And a block?"), None, "m")
    assert len(calls) == 1  # the second found its leading chunks
    head = unpack(first.tokens)
    assert unpack(second.tokens)[: len(head) - 1] == head[:-1]  # the same leading blocks
    await chains.aclose()


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[RunningServer]:
    server = await start_server(create_engine_app(EngineParams.zero_delay(), models=["m"]))
    yield server
    await server.stop()


async def test_tokens_from_an_engines_tokenize_and_none_when_it_does_not_answer(
    engine: RunningServer,
) -> None:
    chains = PromptChains(config_with("engine", engine.url))
    body = chat("Hello!")
    got = await chains.of("chat", body, None, "m")
    assert got.tokens and got.token_count > 0
    again = await chains.of("chat", body, None, "m")  # remembered: the same chain
    assert again == got
    await chains.aclose()
    silent = PromptChains(config_with("engine", f"http://127.0.0.1:{free_port()}"))
    lost = await silent.of("chat", body, None, "m")
    assert lost.text == got.text and not lost.tokens  # the text chain, no token chain
    await silent.aclose()


def test_unusable_tokenizer_files_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailable, match=r"models\[m\]\.tokenizer"):
        PromptChains(config_with(str(tmp_path / "nothing-here")))


async def test_no_prompt_no_chain() -> None:
    chains = PromptChains(config_with(None))
    assert await chains.of("embeddings", {"input": "x"}, None, "m") == NO_PROMPT
    assert await chains.of("chat", {"messages": "nope"}, None, "m") == NO_PROMPT
    assert (await chains.of("completions", {"prompt": "p" * 600}, None, "m")).text


def test_a_token_store_gives_back_a_prefix_tokenized_before() -> None:
    store = TokenStore(chunk=8, min_cover=0.5)
    text = "abcdefgh" * 4  # 4 chunks
    ids = list(range(32))
    ends = [i + 1 for i in range(32)]  # one token per character
    store.store(text, ids, ends)
    assert store.lookup(text) == ids
    longer = text + "xyz"  # the same 4 chunks, then a partial one
    assert store.lookup(longer) == ids
    assert store.lookup("zzzzzzzz" + text) is None  # a different start: nothing
    assert store.lookup(text[:8] + "different text here!") is None  # too little covered
