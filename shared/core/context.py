"""Context windows: whether a request fits an endpoint's window, decided before it is placed.

A request needs ``prompt + output`` tokens of a window, where ``output`` is what it asks for
(`requested_output`: ``max_completion_tokens``, ``max_tokens`` or ``max_output_tokens``; at
least one token, which every answer generates). That is how vLLM counts: it refuses a request
whose prompt plus ``max_tokens`` exceeds ``max_model_len``, and one without ``max_tokens``
whose prompt alone reaches it (SGLang and TGI count the same way). llama.cpp refuses only a
prompt that fills its slot's context (the output stops where the context ends): a window that
does not `ContextWindow.hold_output`.

The prompt (`need_of`) is counted exactly where the edge has the model's tokens (its
``tokenizer``), else estimated from the canonical bytes of the conversation as a lower bound:
one token per `BYTES_PER_TOKEN` bytes, rounded down. Real tokenizers give more tokens than that
(measured with a 131k-token BPE vocabulary: 3.4 bytes a token for English prose, 4.1 for Python
code, 2.9 for JSON, 1.3 for base64, 5.4 for code indented 16 spaces a line; only long runs of
blanks make more), so an estimate falls short of the truth: a request is sent elsewhere or
refused only when it clearly does not fit, and one close to the limit goes to the engine, which
judges it.

Where an endpoint's window comes from (`effective_window`): its own ``context_window`` in the
config, else what its engine reports (the scraper reads it), else its model's
``context_window``; none of them: unknown, and every request fits (the engine judges).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BYTES_PER_TOKEN",
    "ContextNeed",
    "ContextWindow",
    "effective_window",
    "need_of",
    "requested_output",
]

# Bytes of canonical prompt per token at most, for a lower bound of a prompt's tokens when its
# tokens are not known: above what a real tokenizer averages on anything but runs of blanks
# (docs/architecture.md, "Context windows").
BYTES_PER_TOKEN = 6

# The request fields that ask for an amount of output, by API: chat completions (the newer
# name first, as vLLM reads it), completions and Messages, the Responses API.
_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class ContextWindow:
    """An endpoint's context window in tokens; `hold_output`: the requested output must fit in
    it beside the prompt (vLLM, SGLang, TGI, third-party APIs), or only the prompt plus one
    token (llama.cpp, whose output stops at the end of the context)."""

    tokens: int
    hold_output: bool = True


@dataclass(frozen=True, slots=True)
class ContextNeed:
    """What a request needs of a window: its prompt's tokens (exact, or a lower bound when
    `exact` is False) and the output it asks for (0: none said)."""

    prompt: int = 0
    output: int = 0
    exact: bool = False

    def tokens(self, window: ContextWindow | None = None) -> int:
        """The tokens it needs of `window` (by default: of a window that holds the output)."""
        if window is not None and not window.hold_output:
            return self.prompt + 1
        return self.prompt + max(1, self.output)

    def fits(self, window: ContextWindow | None) -> bool:
        """Whether it may run in `window` (an unknown window: yes, the engine judges)."""
        return window is None or self.tokens(window) <= window.tokens

    @property
    def known(self) -> bool:
        """Whether anything is known of it (a request without a prompt fits everywhere)."""
        return self.prompt > 0 or self.output > 0


def need_of(prompt_tokens: int, prompt_bytes: int, output: int) -> ContextNeed:
    """The need of a request with `prompt_tokens` (its tokens by the model's tokenizer; 0:
    unknown) or `prompt_bytes` (the length of its canonical prompt), asking for `output`."""
    if prompt_tokens > 0:
        return ContextNeed(prompt_tokens, max(0, output), exact=True)
    return ContextNeed(max(0, prompt_bytes) // BYTES_PER_TOKEN, max(0, output))


def requested_output(body: Mapping[str, object]) -> int:
    """The output tokens a request body asks for at most; 0 when it does not say."""
    for name in _OUTPUT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def effective_window(
    endpoint: int | None, reported: ContextWindow | None, model: int | None
) -> ContextWindow | None:
    """An endpoint's window: its configured ``context_window`` (the operator's word wins: a
    cap below what the engine could take, or an engine that reports a wrong one), else the
    window its engine reports, else its model's configured ``context_window``, else None.
    How the engine counts (`ContextWindow.hold_output`) stays the engine's, whoever gave the
    size."""
    if endpoint is not None:
        return ContextWindow(endpoint, reported.hold_output if reported is not None else True)
    if reported is not None:
        return reported
    if model is not None:
        return ContextWindow(model)
    return None
