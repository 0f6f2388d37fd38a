"""The stand-in tokenizer, chat template, filler text and block hashing."""

from __future__ import annotations

import json
import subprocess
import sys

from llmgw.services.sim import tokenizer
from llmgw.services.sim.tokenizer import (
    filler_piece,
    hash_token_blocks,
    render_chat,
    token_ids,
)


def test_token_ids_are_stable_across_processes() -> None:
    code = "from llmgw.services.sim.tokenizer import token_ids; print(token_ids('Hello, world!'))"
    # A fresh interpreter has a different str-hash seed; ids must not depend on it.
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert json.loads(out.stdout) == token_ids("Hello, world!")


def test_pieces_are_short_and_punctuation_is_a_token() -> None:
    assert len(token_ids("internationalization")) == 5  # 20 characters in pieces of <= 4
    assert len(token_ids("a, b.")) == 4


def test_multi_turn_chat_prompts_share_a_growing_token_prefix() -> None:
    turn_one = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn_two = [
        *turn_one,
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "More"},
    ]
    first, second = token_ids(render_chat(turn_one)), token_ids(render_chat(turn_two))
    shared = len(token_ids("<|system|>\nBe brief.\n<|user|>\nHi\n"))
    assert second[:shared] == first[:shared]
    assert len(second) > len(first)


def test_chain_hashes_depend_on_the_whole_prefix() -> None:
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = hash_token_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b
    assert c[1] != a[1]  # same second block, different parent


def test_filler_pieces_are_deterministic_and_need_no_json_escaping() -> None:
    assert [filler_piece(7, i) for i in range(20)] == [filler_piece(7, i) for i in range(20)]
    assert len({filler_piece(7, i) for i in range(200)}) > 20
    for word in tokenizer._FILLER_WORDS:
        assert json.dumps(word) == f'"{word}"'
