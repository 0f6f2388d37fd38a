"""How an engine turns prompts into tokens (`Tokenizer`), a cheap deterministic stand-in for a
real tokenizer (`StandInTokenizer`, the default), its chat template, and filler text.

An engine given a model's own tokenizer files uses `llmgw.services.sim.model_tokenizer` instead
of the stand-in, for every prompt, chat and ``/tokenize`` alike.

Invariants of the stand-in:
- the same text always gives the same token ids, in every process (ids are CRC-32 of the piece,
  never Python's per-process randomised ``hash()``);
- a text that extends another text at a piece boundary tokenizes to an extension of its tokens, so
  multi-turn conversations rendered by `render_chat` share a growing token prefix (which is what
  makes the engine's prefix cache hit);
- a "token" is a run of at most four word characters or one punctuation character, roughly the
  size of a real BPE token for English text.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "StandInTokenizer",
    "TokenizeError",
    "Tokenizer",
    "embedding_inputs",
    "filler_piece",
    "filler_text",
    "hash_token_blocks",
    "render_chat",
    "token_ids",
    "tokenize_prompt",
]

_PIECE = re.compile(r"\w{1,4}|[^\w\s]")

# Filler words for generated text; each word (with its leading space) counts as one token.
_FILLER_WORDS = (
    " the",
    " model",
    " token",
    " cache",
    " batch",
    " prefix",
    " engine",
    " queue",
    " route",
    " stream",
    " block",
    " latency",
    " request",
    " server",
    " vector",
    " signal",
    " data",
    " of",
    " and",
    " to",
    " in",
    " is",
    " for",
    " with",
    " as",
    " on",
    " by",
    " at",
    " from",
    " fast",
    " slow",
    " warm",
    " cold",
    " long",
    " short",
    " new",
    " old",
    " next",
    " first",
    " system",
    " answer",
    " prompt",
    " context",
    " window",
    " gateway",
    " mesh",
    " node",
    " simple",
    " clear",
    " quiet",
    " steady",
    " bright",
    " small",
    " large",
    " early",
    " late",
    " river",
    " stone",
    " light",
    " field",
    " paper",
    " music",
    " garden",
    " city",
    ".",
)


class TokenizeError(ValueError):
    """The request's prompt or messages have the wrong shape (answered with 400)."""


class Tokenizer(Protocol):
    """An engine's tokenizer: what its requests' prompts are in tokens. Bad input (a message
    without a role, a template that refuses the conversation...) raises `TokenizeError`."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; `add_special_tokens` as a completions prompt gets them (BOS)."""
        ...

    def chat(
        self,
        messages: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a chat request's prompt: its messages rendered by the chat template,
        then encoded (the template adds what special tokens it wants)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (raises TokenizeError when this tokenizer has no vocabulary)."""
        ...

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string (raises TokenizeError when it has no vocabulary)."""
        ...


_NO_VOCABULARY = (
    "the simulator's stand-in tokenizer has no vocabulary (its token ids are hashes): give the "
    "engine its model's tokenizer files (the `tokenizer` parameter)"
)


class StandInTokenizer:
    """The built-in `Tokenizer`: CRC-32 ids of short pieces, `render_chat`'s template, no special
    tokens and no vocabulary (ids cannot be decoded)."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return token_ids(text)

    def chat(
        self,
        messages: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        return token_ids(render_chat(messages, add_generation_prompt=add_generation_prompt))

    def decode(self, ids: Sequence[int]) -> str:
        raise TokenizeError(_NO_VOCABULARY)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        raise TokenizeError(_NO_VOCABULARY)


def token_ids(text: str) -> list[int]:
    """Stable token ids of `text`."""
    crc32 = zlib.crc32
    return [crc32(piece.encode()) for piece in _PIECE.findall(text)]


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, Mapping):
                # Images, audio, files: a fixed-size placeholder keeps token counts plausible.
                parts.append(f"<{part.get('type', 'part')}>")
            else:
                raise TokenizeError(f"{where}: content parts must be objects")
        return "\n".join(parts)
    raise TokenizeError(f"{where}: content must be a string or a list of parts")


def render_chat(messages: Any, *, add_generation_prompt: bool = True) -> str:
    """The prompt for a chat request: ``<|role|>\\ncontent\\n`` per message, then (unless
    `add_generation_prompt` is false) the assistant tag."""
    if not isinstance(messages, list) or not messages:
        raise TokenizeError("messages: must be a non-empty list")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TokenizeError(f"messages[{index}]: must be an object with a string `role`")
        text = _content_text(message.get("content"), f"messages[{index}].content")
        rendered.append(f"<|{message['role']}|>\n{text}\n")
    if add_generation_prompt:
        rendered.append("<|assistant|>\n")
    return "".join(rendered)


def tokenize_prompt(prompt: Any, encode: Callable[[str], list[int]] = token_ids) -> list[int]:
    """Token ids of a completions ``prompt``: a string (encoded by `encode`), a token list, or a
    one-element list of either."""
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            return list(prompt)
        if len(prompt) == 1:
            return tokenize_prompt(prompt[0], encode)
        raise TokenizeError(
            "prompt: batched prompts are not supported; send one prompt per request"
        )
    raise TokenizeError("prompt: must be a string or a list of token ids")


def embedding_inputs(value: Any, encode: Callable[[str], list[int]] = token_ids) -> list[list[int]]:
    """Token ids of each embeddings ``input``: string, list of strings, token list, list of token
    lists (strings encoded by `encode`)."""
    if isinstance(value, str):
        return [encode(value)]
    if isinstance(value, list) and value:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [list(value)]
        out: list[list[int]] = []
        for index, item in enumerate(value):
            if isinstance(item, str):
                out.append(encode(item))
            elif isinstance(item, list) and all(
                isinstance(tok, int) and not isinstance(tok, bool) for tok in item
            ):
                out.append(list(item))
            else:
                raise TokenizeError(f"input[{index}]: must be a string or a list of token ids")
        return out
    raise TokenizeError("input: must be a string, a list of strings or token ids")


def filler_piece(text_seed: int, index: int) -> str:
    """The `index`-th generated token of the generation seeded `text_seed` (deterministic)."""
    mixed = ((text_seed ^ (index * 0x9E3779B1)) * 0x85EBCA6B) & 0xFFFFFFFF
    return _FILLER_WORDS[(mixed >> 11) % len(_FILLER_WORDS)]


def filler_text(text_seed: int, start: int, stop: int) -> str:
    """Generated text for tokens ``start..stop-1``."""
    return "".join(filler_piece(text_seed, i) for i in range(start, stop))


def hash_token_blocks(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks of `tokens`: each block's hash covers its parent's hash.

    Two prompts get the same hash for block i exactly when their first (i+1)*block_size tokens
    are equal, which is the prefix-cache key vLLM uses.
    """
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, *tokens[start : start + block_size]))
        hashes.append(parent)
    return hashes
