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

An engine that judged a request too long after all (an estimate falls short) says so in its 400
(`refused_window` reads it, with the window the engine names); the request then needs more than
that window (`ContextNeed.beyond`), which is what its retry is placed with.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from llmgw.core.records import record

__all__ = [
    "BYTES_PER_TOKEN",
    "ContextNeed",
    "ContextWindow",
    "effective_window",
    "need_of",
    "refused_window",
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


@record
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

    def beyond(self, window: ContextWindow) -> ContextNeed:
        """This need, known to exceed `window` (its engine refused the request for its length):
        its prompt at least what makes it need ``window.tokens + 1``, counted as `window`
        counts, and no longer exact (the engine's count is not the gateway's)."""
        if window.hold_output:
            least = window.tokens + 1 - max(1, self.output)
        else:  # llama.cpp: the prompt alone reached the context
            least = window.tokens
        if least <= self.prompt:
            return self
        return replace(self, prompt=least, exact=False)

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


# An engine's words for a prompt (and output) over its context window, with the window they
# name, from each engine's source: vLLM's OpenAI server ("This model's maximum context length
# is N tokens. However, ..."; its renderer's "... the model's context length is only N tokens")
# and engine ("The decoder prompt (length P) is longer than the maximum model length of N."),
# SGLang ("... exceeds the model's maximum context length of N tokens", "The input (P tokens) is
# longer than the model's context length (N tokens)."), llama.cpp ("request (P tokens) exceeds
# the available context size (N tokens), try increasing it").
_WINDOW_PATTERNS = re.compile(
    r"maximum context length (?:is|of) (\d{1,9})\b"
    r"|context length is only (\d{1,9})\b"
    r"|model's context length \((\d{1,9}) tokens\)"
    r"|maximum model length of (\d{1,9})\b"
    r"|available context size \((\d{1,9}) tokens\)",
    re.IGNORECASE,
)
# Codes and types that say so without naming the window: OpenAI's code, llama.cpp's type.
_REFUSAL_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})


def refused_window(body: bytes) -> int | None:
    """Whether an engine's 400 `body` refuses a request for its context length, and the window
    it names: None when it is no such refusal, 0 when it is one that names no window.

    Read from the error's message (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type":
    "error", "error": {...}}``, vLLM's older flat ``{"object": "error", "message": ...}``) or
    its ``code`` or ``type`` (vLLM's ``code`` is the HTTP status, 400: its message says it)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    error = value.get("error")
    detail = error if isinstance(error, dict) else value
    message = detail.get("message", detail.get("detail"))
    if isinstance(message, str) and (match := _WINDOW_PATTERNS.search(message)) is not None:
        return int(next(group for group in match.groups() if group is not None))
    if detail.get("code") in _REFUSAL_CODES or detail.get("type") in _REFUSAL_CODES:
        n_ctx = detail.get("n_ctx")  # llama.cpp names its slot's context beside the type
        return n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else 0
    return None
