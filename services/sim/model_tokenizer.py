"""An engine's `Tokenizer` on its model's own tokenizer files (the engine's ``tokenizer``
parameter): `llmgw.chat_tokenizer.ChatTokenizer` behind the simulator's tokenizer port, so the
engine's prompts, chats, prefix cache and ``/tokenize`` are in the model's real tokens, the ones
a gateway computes from the same files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from llmgw.chat_tokenizer import ChatTokenizer
from llmgw.services.sim.tokenizer import TokenizeError

__all__ = ["ModelTokenizer"]


class ModelTokenizer:
    """A `Tokenizer` reading `directory` once, at construction (TokenizerFilesError, or
    ImportError without the ``tokenizer`` extra); bad conversations raise TokenizeError."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._chat = ChatTokenizer(directory)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self._chat.encode(text, add_special_tokens=add_special_tokens)

    def chat(
        self,
        messages: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        if tools is not None and not isinstance(tools, list):
            raise TokenizeError("tools: must be a list")
        try:
            return self._chat.tokens(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                add_special_tokens=add_special_tokens,
            )
        except ValueError as exc:
            raise TokenizeError(str(exc)) from None

    def decode(self, ids: Sequence[int]) -> str:
        return self._chat.decode(ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        try:
            return self._chat.token_strs(ids)
        except ValueError as exc:
            raise TokenizeError(str(exc)) from None
