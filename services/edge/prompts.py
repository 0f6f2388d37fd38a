"""The prompt's chains an edge sends admission with each request (cache-aware placement).

`PromptChains.of` turns a request into a `PromptChain`:

- its *text chain* (`llmgw.core.prefix`: the canonical bytes of its conversation, cut into
  ``prefix.block_bytes`` blocks, rooted at its model) and the length of those bytes, for every
  chat and completions prompt. A Responses or Messages request is taken in its chat
  completions form (`ApiExchange.chat_form`), so the same conversation gives the same chain
  whatever API it came through. Costs about 30 us for an 8k-token prompt
  (docs/benchmarks.md);
- its *token chain*, when its model names a ``tokenizer`` and an endpoint of the model reports
  KV cache events: the engine's tokens of the prompt in blocks of ``kv_block_size``, to match
  what the engine says it holds. The tokens come from the model's own tokenizer files
  (`llmgw.chat_tokenizer`, on a worker thread; a `TokenStore` remembers the tokens of prompts'
  leading chunks, so a tenant's system prompt or a conversation's earlier turns are not
  tokenized again), or from an engine's ``POST /tokenize`` (``tokenizer: engine``: one call to
  an endpoint of the model, within `TOKENIZE_TIMEOUT`; the same prompt again is remembered).
  Tokens that cannot be had (an engine that does not answer, a template that refuses the
  conversation) give no token chain: admission then matches the text chain, as for engines
  without events. Never an error for the client.

Embeddings, and anything without a prompt, give nothing. With ``prefix.enabled`` false there
is no chain, but the length of the canonical bytes still travels: admission estimates from it
the prompt's tokens against the endpoints' context windows (`llmgw.core.context`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import httpx

from llmgw.core.prefix import (
    TokenStore,
    canonical_chat,
    canonical_prompt,
    model_root,
    pack,
    text_chain,
    token_chain,
    token_root,
)
from llmgw.core.records import record

if TYPE_CHECKING:
    from llmgw.chat_tokenizer import ChatTokenizer
    from llmgw.config import Config
    from llmgw.services.edge.attempts import ApiExchange

__all__ = ["NO_PROMPT", "PromptChain", "PromptChains", "TokenizerUnavailable"]

log = logging.getLogger("llmgw.edge.prompts")

TOKENIZE_TIMEOUT = 0.5  # seconds an engine's /tokenize may take before the tokens are skipped
_REMEMBERED = 4096  # prompts whose engine tokens (tokenizer: engine) are kept, per model


@record
class PromptChain:
    """What an `AdmitRequest` carries of its prompt: the packed text chain and the canonical
    length; with a tokenizer, the packed token chain, the token count and the block size."""

    text: bytes = b""
    length: int = 0
    tokens: bytes = b""
    token_count: int = 0
    token_block: int = 0


NO_PROMPT = PromptChain()


class TokenizerUnavailable(Exception):
    """A model's tokenizer files cannot be used (the message names the field)."""


class _ModelTokens:
    """One model's way to its engines' tokens (files, or an engine's /tokenize)."""

    def __init__(self, config: Config, model: str, source: str, http: httpx.AsyncClient) -> None:
        self.model = model
        self.source = source
        found = config.model(model)
        assert found is not None  # a model of the config
        self.block = found.kv_block_size
        self.max_blocks = config.prefix.max_blocks * 4  # a token block is a quarter of a text one
        self._http = http
        self._local: ChatTokenizer | None = None
        self._store = TokenStore()
        self._remembered: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._engines: list[tuple[str, str]] = []
        if source == "engine":
            self._engines = [
                (e.url, e.upstream_name(model))
                for p in config.providers
                if p.is_managed
                for e in config.endpoints_for(p.id, model)
            ]
        else:
            from llmgw.chat_tokenizer import ChatTokenizer

            try:
                self._local = ChatTokenizer(source)
            except (ValueError, ImportError) as exc:
                raise TokenizerUnavailable(f"models[{model}].tokenizer: {exc}") from None
        self._next = itertools.cycle(range(max(1, len(self._engines))))

    async def tokens(
        self, form: tuple[list[Any], list[Any] | None] | str, key: bytes
    ) -> list[int] | tuple[int, ...] | None:
        """The engine's tokens of the prompt (`form`: chat messages and tools, or a completions
        prompt); `key`: its canonical bytes. None: none could be had."""
        if self._local is not None:
            return await self._tokenize_here(self._local, form)
        known = self._remembered.get(key)
        if known is not None:
            self._remembered.move_to_end(key)
            return known
        tokens = await self._ask_engine(form)
        if tokens is not None:
            self._remembered[key] = tokens
            if len(self._remembered) > _REMEMBERED:
                self._remembered.popitem(last=False)
        return tokens

    async def _tokenize_here(
        self, tokenizer: ChatTokenizer, form: tuple[list[Any], list[Any] | None] | str
    ) -> list[int] | None:
        try:
            text = form if isinstance(form, str) else tokenizer.chat_text(*form)
        except ValueError:
            return None  # the template refused the conversation: the engine will say why
        known = self._store.lookup(text)
        if known is not None:
            return known
        ids, ends = await asyncio.to_thread(tokenizer.encode_with_ends, text)
        self._store.store(text, ids, ends)
        return ids

    async def _ask_engine(
        self, form: tuple[list[Any], list[Any] | None] | str
    ) -> tuple[int, ...] | None:
        if not self._engines:
            return None
        url, name = self._engines[next(self._next) % len(self._engines)]
        body: dict[str, Any] = {"model": name}
        if isinstance(form, str):
            body["prompt"] = form
        else:
            body["messages"], tools = form
            if tools:
                body["tools"] = tools
        try:
            reply = await self._http.post(f"{url}/tokenize", json=body, timeout=TOKENIZE_TIMEOUT)
            tokens = reply.json()["tokens"] if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tuple(tokens)


class PromptChains:
    """The chains of every request (see the module docstring). Built at start and again for
    each config the edge runs on: `previous`'s tokenizers (and its HTTP client) are kept for
    the models whose tokenizer did not change."""

    def __init__(self, config: Config, previous: PromptChains | None = None) -> None:
        """Raises `TokenizerUnavailable` when a model's tokenizer files cannot be used."""
        prefix = config.prefix
        self.enabled = prefix.enabled
        self.block_bytes = prefix.block_bytes
        self.max_blocks = prefix.max_blocks
        self._roots: dict[str, int] = {}
        self._http: httpx.AsyncClient | None = previous._http if previous is not None else None
        self._tokens: dict[str, _ModelTokens] = {}
        if not self.enabled:
            return
        # A model with a tokenizer gets its tokens counted, whether or not its engines send
        # KV cache events: the events' matching needs them, and so do context windows (an
        # exact prompt length, where the bytes give only a lower bound).
        kept = previous._tokens if previous is not None else {}
        for model in config.models:
            source, name = model.tokenizer, model.name
            if source is None:
                continue
            old = kept.get(name)
            if old is not None and old.source == source and old.block == model.kv_block_size:
                self._tokens[name] = old
                continue
            if self._http is None:
                self._http = httpx.AsyncClient(trust_env=False)
            self._tokens[name] = _ModelTokens(config, name, source, self._http)

    async def of(
        self, feature: str, body: dict[str, Any], exchange: ApiExchange | None, model: str
    ) -> PromptChain:
        """The request's chains; `NO_PROMPT` when it has no prompt (only its length when
        prefixes are off)."""
        form: tuple[list[Any], list[Any] | None] | str | None
        if exchange is not None:
            form = exchange.chat_form()
            data = canonical_chat(*form) if form is not None else None
        else:
            data = canonical_prompt(feature, body)
            form = _form(feature, body)
        if not data:
            return NO_PROMPT
        chain = self.of_bytes(data, model)
        tokens = self._tokens.get(model)
        if tokens is None or form is None or not chain.text:
            return chain
        ids = await tokens.tokens(form, data)
        if not ids:
            return chain
        blocks = token_chain(ids, tokens.block, token_root(None), tokens.max_blocks)
        return PromptChain(chain.text, chain.length, pack(blocks), len(ids), tokens.block)

    def of_bytes(self, data: bytes, model: str) -> PromptChain:
        """The text chain of canonical prompt bytes `data` for `model`, and their length (a
        prompt shorter than a block has no chain; its length still counts, for the context
        windows)."""
        if not self.enabled:
            return PromptChain(length=len(data))
        root = self._roots.get(model)
        if root is None:
            root = self._roots[model] = model_root(model)
        chain = text_chain(data, self.block_bytes, self.max_blocks, root)
        return PromptChain(pack(chain) if chain else b"", len(data))

    async def aclose(self) -> None:
        """Close the HTTP client of `tokenizer: engine` (shared by every config's chains)."""
        if self._http is not None:
            await self._http.aclose()


def _form(feature: str, body: dict[str, Any]) -> tuple[list[Any], list[Any] | None] | str | None:
    """A chat or completions body's prompt as a tokenizer takes it."""
    if feature == "chat":
        messages = body.get("messages")
        tools = body.get("tools")
        return (
            (messages, tools if isinstance(tools, list) else None)
            if isinstance(messages, list)
            else None
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None
