"""Output lengths (pure; the caller passes a seeded ``random.Random``).

A real model ends its answer when it samples its end-of-sequence token, usually well before
``max_tokens``; ``max_tokens`` (or the room left in the context) only cuts what would have been
longer. `output_length` models that: the draw of `draw_output_len` is where the model would have
sampled EOS, and the request's caps decide whether it got there.
"""

from __future__ import annotations

import math
import random
from typing import Protocol

__all__ = ["draw_output_len", "output_length"]


class _OutputLenParams(Protocol):
    """What a draw reads (read-only, so a model with a narrower field type fits)."""

    @property
    def output_len_distribution(self) -> str: ...

    @property
    def output_len_mean(self) -> int: ...

    @property
    def output_len_max(self) -> int: ...

    @property
    def output_len_sigma(self) -> float: ...


def draw_output_len(params: _OutputLenParams, rng: random.Random) -> int:
    """An output length in ``1..output_len_max`` whose mean is about ``output_len_mean``.

    lognormal: mean-preserving (mu = ln(mean) - sigma^2/2), clipped to the bounds;
    uniform: integers in ``1..2*mean-1`` (clipped to the max); fixed: always the mean.
    """
    mean, high = params.output_len_mean, params.output_len_max
    kind = params.output_len_distribution
    if kind == "fixed":
        value = mean
    elif kind == "uniform":
        value = rng.randint(1, max(1, 2 * mean - 1))
    else:
        sigma = params.output_len_sigma
        value = round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))
    return max(1, min(high, value))


def output_length(
    params: _OutputLenParams,
    rng: random.Random,
    room: int,
    max_tokens: int | None,
    *,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[int, str]:
    """(output tokens, finish reason) of one request, as vLLM ends it.

    The cap is ``min(max_tokens, room)`` (`room`: the context left after the prompt). With
    `ignore_eos` the output is the cap (``length``) and nothing is drawn. Otherwise the model's
    end-of-sequence token (counted in the output, as vLLM counts it) is the drawn token, or the
    one right after `min_tokens` when the draw falls within them (vLLM masks EOS until
    `min_tokens` tokens are out): ``stop`` when that fits the cap (an EOS sampled as the last
    allowed token still ends with ``stop``: vLLM checks EOS before the length), else the cap
    and ``length``.
    """
    cap = room if max_tokens is None else min(max_tokens, room)
    if ignore_eos:
        return cap, "length"
    wanted = draw_output_len(params, rng)
    if wanted <= min_tokens:
        wanted = min_tokens + 1
    return (wanted, "stop") if wanted <= cap else (cap, "length")
