"""The prompt's chain an edge sends admission with each request (cache-aware placement).

`PromptChains.of` turns a request into its text chain (`llmgw.core.prefix`: the canonical
bytes of its conversation, cut into ``prefix.block_bytes`` blocks, rooted at its model) and the
length of those bytes, packed for the `AdmitRequest`. A Responses or Messages request is taken
in its chat completions form (`ApiExchange.prompt`), so the same conversation gives the same
chain whatever API it came through. Embeddings, and anything without a prompt, give none.
Costs about 30 us for an 8k-token prompt (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmgw.core.prefix import canonical_prompt, model_root, pack, text_chain

if TYPE_CHECKING:
    from llmgw.config.sections import PrefixConfig
    from llmgw.services.edge.attempts import ApiExchange

__all__ = ["PromptChains"]

NO_PREFIX = (b"", 0)


class PromptChains:
    def __init__(self, config: PrefixConfig) -> None:
        self.enabled = config.enabled
        self.block_bytes = config.block_bytes
        self.max_blocks = config.max_blocks
        self._roots: dict[str, int] = {}

    def of(
        self, feature: str, body: dict[str, Any], exchange: ApiExchange | None, model: str
    ) -> tuple[bytes, int]:
        """The packed chain of the request's prompt and its canonical length; empty: none."""
        if not self.enabled:
            return NO_PREFIX
        data = exchange.prompt() if exchange is not None else canonical_prompt(feature, body)
        return self.of_bytes(data, model) if data else NO_PREFIX

    def of_bytes(self, data: bytes, model: str) -> tuple[bytes, int]:
        """The packed chain of canonical prompt bytes `data` for `model`, and their length."""
        if not self.enabled:
            return NO_PREFIX
        root = self._roots.get(model)
        if root is None:
            root = self._roots[model] = model_root(model)
        chain = text_chain(data, self.block_bytes, self.max_blocks, root)
        return (pack(chain), len(data)) if chain else NO_PREFIX
