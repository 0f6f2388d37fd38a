"""The provider `Backend`: requests paced on their own timers, limits checked at start."""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmgw.services.sim.generation import OutputLimits, SimError
from llmgw.services.sim.params import ProviderParams
from llmgw.services.sim.provider_model import (
    ConcurrencyLimit,
    RateSchedule,
    TokenBucket,
    retry_after_header,
    token_times,
)
from llmgw.services.sim.sampling import output_length

__all__ = ["PacedGeneration", "ProviderBackend"]


class PacedGeneration:
    """A `Generation` whose tokens are due at precomputed times."""

    __slots__ = (
        "_backend",
        "_closed",
        "_times",
        "_waiter",
        "cached_tokens",
        "finish_reason",
        "output_len",
        "prompt_tokens",
        "text_seed",
    )

    def __init__(
        self,
        backend: ProviderBackend,
        times: list[float],
        prompt_tokens: int,
        finish_reason: str,
        text_seed: int,
    ) -> None:
        self._backend = backend
        self._times = times
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.output_len = len(times)
        self.finish_reason = finish_reason
        self.text_seed = text_seed

    @property
    def emitted(self) -> int:
        return bisect.bisect_right(self._times, self._backend.clock())

    @property
    def done(self) -> bool:
        return self._closed or self.emitted >= self.output_len

    async def wait(self, seen: int) -> None:
        if self.done or self.emitted > seen:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        delay = self._times[seen] - self._backend.clock()
        handle = loop.call_later(max(0.0, delay), _wake, waiter)
        try:
            await waiter
        finally:
            handle.cancel()
            self._waiter = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._backend.limit.release()
        if self._waiter is not None:
            _wake(self._waiter)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ProviderBackend:
    """Limits + pacing of a simulated third-party API."""

    def __init__(
        self, params: ProviderParams, *, clock: Callable[[], float], rng: random.Random
    ) -> None:
        self.params = params
        self.clock = clock
        self.rng = rng
        self.origin = clock()
        self.schedule = RateSchedule(params)
        self.limit = ConcurrencyLimit(params.max_concurrent)
        self.bucket: TokenBucket | None = None
        if params.requests_per_second is not None:
            burst = params.burst or max(1, math.floor(params.requests_per_second))
            self.bucket = TokenBucket.full(params.requests_per_second, burst, self.origin)
        self.requests = 0
        self.rate_limited = 0
        self.generated_tokens = 0

    def start(
        self,
        prompt: Sequence[int],
        limits: OutputLimits,
        priority: int = 0,
        lora: str | None = None,
    ) -> PacedGeneration:
        """Pace one request; `priority` and `lora` are ignored (each request has its own pace,
        no queue; a third party has no adapters)."""
        params = self.params
        now = self.clock()
        prompt_len = len(prompt)
        if prompt_len >= params.max_model_len:
            raise SimError(
                400,
                f"prompt too long: the maximum context length is {params.max_model_len} tokens, "
                f"the prompt has {prompt_len}",
                code="context_length_exceeded",
            )
        if self.bucket is not None:
            wait = self.bucket.try_take(now)
            if wait > 0:
                self._reject(f"Rate limit reached: {params.requests_per_second} requests/s", wait)
        if not self.limit.try_acquire():
            self._reject(f"Too many concurrent requests (max {params.max_concurrent})", 0.0)
        output_len, finish_reason = output_length(
            params,
            self.rng,
            params.max_model_len - prompt_len,
            limits.max_tokens,
            min_tokens=limits.min_tokens,
            ignore_eos=limits.ignore_eos,
        )
        first_at = now + params.base_latency
        if params.input_tokens_per_second > 0:
            first_at += prompt_len / params.input_tokens_per_second
        times = token_times(self.schedule, self.origin, first_at, output_len)
        self.requests += 1
        self.generated_tokens += output_len
        return PacedGeneration(self, times, prompt_len, finish_reason, self.rng.getrandbits(32))

    def _reject(self, message: str, wait: float) -> None:
        self.rate_limited += 1
        retry_after = retry_after_header(wait, self.params.retry_after)
        raise SimError(
            429,
            message,
            type="requests",
            code="rate_limit_exceeded",
            headers=[(b"retry-after", str(retry_after).encode())],
        )

    def embedding_delay(self, prompt_tokens: int) -> float:
        """Embeddings pass the request-rate limit too (they hold no concurrency slot)."""
        if self.bucket is not None:
            wait = self.bucket.try_take(self.clock())
            if wait > 0:
                self._reject(
                    f"Rate limit reached: {self.params.requests_per_second} requests/s", wait
                )
        delay = self.params.base_latency
        if self.params.input_tokens_per_second > 0:
            delay += prompt_tokens / self.params.input_tokens_per_second
        return delay

    def state(self) -> Mapping[str, Any]:
        elapsed = self.clock() - self.origin
        return {
            "kind": "provider",
            "elapsed_seconds": elapsed,
            "tokens_per_second": self.schedule.rate_at(elapsed),
            "in_flight": self.limit.in_flight,
            "requests": self.requests,
            "rate_limited": self.rate_limited,
            "generated_tokens_scheduled": self.generated_tokens,
        }

    def metrics(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
