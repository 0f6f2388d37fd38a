"""Output-length draws (pure; the caller passes a seeded ``random.Random``)."""

from __future__ import annotations

import math
import random
from typing import Protocol

__all__ = ["draw_output_len"]


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
