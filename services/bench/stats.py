"""Per-request records and their statistics (pure).

Definitions (times in seconds on one monotonic clock):

- latency = end - start, where start is just before the request is sent and end is when the
  response is complete (``[DONE]`` or the end of the body);
- TTFT (streams only) = time of the first chunk carrying generated text - start;
- TPOT (streams with at least 2 output tokens) = (end - first token) / (output tokens - 1);
- output tokens come from the response's ``usage`` when it has one, else from counting the
  streamed text chunks, or for a whole response its text at 4 characters per token (then
  `RequestRecord.usage_reported` is False);
- throughput counts successful requests and their tokens over the run's window: from the first
  request's start to the last request's end (failures included in the window);
- percentiles interpolate linearly between closest ranks (numpy's default), so p0 is the
  minimum, p100 the maximum, and they never decrease as q grows.

An error's key is its HTTP status as a string (``"429"``, ``"500"``) or, when there is none or
the body was unusable, one of `ERROR_KINDS`; the summary keeps the first message seen per key.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ERROR_KINDS",
    "PERCENTILES",
    "RequestRecord",
    "percentile",
    "summarize",
]

PERCENTILES = (50, 90, 99)
ERROR_KINDS = {
    "connection": "could not connect, or the connection broke before a response",
    "timeout": "no complete response within --timeout",
    "incomplete": "the response started but was cut off (a stream without [DONE], a short body)",
    "stream_error": "a stream carried an error object instead of chunks",
    "bad_response": "status 200 but the body was not the OpenAI shape",
}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """How one request went. ``error`` is None exactly for successful requests.

    Invariants: ``start <= first_token <= end`` when ``first_token`` is set; ``output_tokens``
    >= 0; ``status`` is the HTTP status when a response header arrived, else None.
    """

    index: int
    start: float
    end: float
    status: int | None
    error: str | None = None
    stream: bool = False
    first_token: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    band: str | None = None
    session_id: str | None = None
    turn: int = 0
    detail: str | None = field(default=None, compare=False)
    """For a failure: the server's error message (or the exception), shortened."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        if not self.ok or not self.stream or self.first_token is None:
            return None
        return self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2 or self.first_token is None:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def error_key(self) -> str | None:
        """None for a success; else the status (``"503"``) or the kind (``"connection"``)."""
        if self.error is None:
            return None
        if self.error == "http" and self.status is not None:
            return str(self.status)
        return self.error


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of non-empty `values`, linearly interpolated."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    if fraction == 0 or ordered[low] == ordered[high]:
        return ordered[low]
    # Written so that the result stays within [ordered[low], ordered[high]] despite rounding.
    value = ordered[low] + (ordered[high] - ordered[low]) * fraction
    return min(max(value, ordered[low]), ordered[high])


def _distribution(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    result = {"mean": math.fsum(values) / len(values)}
    for q in PERCENTILES:
        result[f"p{q}"] = percentile(values, q)
    result["max"] = max(values)
    return result


def summarize(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """The results JSON's ``summary`` object for `records` (see docs/bench.md for the schema)."""
    records = list(records)
    ok = [r for r in records if r.ok]
    errors = Counter(r.error_key for r in records if not r.ok)
    examples: dict[str, str] = {}
    for r in records:
        if r.error_key is not None and r.detail and r.error_key not in examples:
            examples[r.error_key] = r.detail
    if records:
        window = max(r.end for r in records) - min(r.start for r in records)
    else:
        window = 0.0
    output = sum(r.output_tokens for r in ok)
    prompt_known = [r for r in ok if r.prompt_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in prompt_known)
    cached_known = [r for r in prompt_known if r.cached_tokens is not None]
    cached_prompt = sum(r.prompt_tokens or 0 for r in cached_known)
    cached = sum(r.cached_tokens or 0 for r in cached_known)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]

    def per_second(amount: float) -> float:
        return amount / window if window > 0 else 0.0

    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(sorted(errors.items(), key=lambda item: (-item[1], item[0]))),
        "error_examples": {key: examples[key] for key in errors if key in examples},
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "duration_s": window,
        "throughput": {
            "requests_per_s": per_second(len(ok)),
            "output_tokens_per_s": per_second(output),
            "prompt_tokens_per_s": per_second(prompt),
        },
        "tokens": {
            "prompt": prompt,
            "output": output,
            "cached": cached if cached_known else None,
            "usage_reported": sum(r.usage_reported for r in ok),
        },
        "prefix_cache_hit_rate": cached / cached_prompt if cached_prompt > 0 else None,
        "latency_s": _distribution([r.latency for r in ok]),
        "ttft_s": _distribution(ttfts),
        "tpot_s": _distribution(tpots),
    }
