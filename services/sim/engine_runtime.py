"""Drives an `EngineModel` in real time on the asyncio loop; the engine `Backend`.

One timer per engine (``loop.call_later``) is armed for the model's next due event; when it fires
the model advances to the clock's current time and the timer is re-armed. With no sequences
running no timer is armed (no busy loop), and with all timings zero a request completes inside
`start` without any timer or task switch, which keeps zero-delay benchmarks cheap.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmgw.services.sim.engine_model import EngineModel, PriorityNotEnabled, PromptTooLong
from llmgw.services.sim.engine_model import Sequence as Seq
from llmgw.services.sim.generation import OutputLimits, SimError
from llmgw.services.sim.metrics import EngineMetrics
from llmgw.services.sim.params import EngineParams

__all__ = ["EngineBackend", "EngineGeneration"]


class EngineGeneration:
    """A `Generation` backed by one engine sequence."""

    __slots__ = ("_backend", "_waiter", "seq")

    def __init__(self, backend: EngineBackend) -> None:
        self._backend = backend
        self._waiter: asyncio.Future[None] | None = None
        self.seq: Seq

    def _on_progress(self, _seq: Seq) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def prompt_tokens(self) -> int:
        return self.seq.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.seq.cached_tokens

    @property
    def output_len(self) -> int:
        return self.seq.output_len

    @property
    def finish_reason(self) -> str:
        return self.seq.finish_reason

    @property
    def text_seed(self) -> int:
        return self.seq.text_seed

    @property
    def emitted(self) -> int:
        return self.seq.emitted

    @property
    def done(self) -> bool:
        return self.seq.done

    async def wait(self, seen: int) -> None:
        seq = self.seq
        if seq.emitted > seen or seq.done:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        if not self.seq.done:
            self._backend.abort(self.seq)
        self._on_progress(self.seq)


class EngineBackend:
    """The engine model, its real-time driver and its vLLM metrics."""

    def __init__(
        self,
        params: EngineParams,
        model_name: str,
        *,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.params = params
        self.clock = clock
        self.metrics_exporter = EngineMetrics(params, model_name)
        self.model = EngineModel(
            params,
            rng,
            on_first_token=self.metrics_exporter.observe_first_token,
            on_finish=self.metrics_exporter.observe_finish,
        )
        self.metrics_exporter.bind(self.model)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0

    # -- Backend ---------------------------------------------------------------------------
    def start(
        self,
        prompt: Sequence[int],
        limits: OutputLimits,
        priority: int = 0,
        lora: str | None = None,
    ) -> EngineGeneration:
        generation = EngineGeneration(self)
        try:
            generation.seq = self.model.submit(
                self.clock(),
                prompt,
                limits.max_tokens,
                generation._on_progress,
                priority=priority,
                min_tokens=limits.min_tokens,
                ignore_eos=limits.ignore_eos,
                lora=lora,
            )
        except PriorityNotEnabled as exc:
            raise SimError(400, str(exc), param="priority") from None
        except PromptTooLong as exc:
            raise SimError(
                400, str(exc), code="context_length_exceeded", param="messages"
            ) from None
        if not generation.seq.done:
            self._rearm()
        return generation

    def enable_lora(self) -> None:
        """An adapter was loaded at run time: from now on the engine serves LoRA (its metrics
        say so, as vLLM's do with LoRA enabled)."""
        self.metrics_exporter.lora_enabled = True

    def embedding_delay(self, prompt_tokens: int) -> float:
        self.model.stats.prompt_tokens += prompt_tokens
        return self.params.prefill_base + self.params.prefill_per_token * prompt_tokens

    def state(self) -> Mapping[str, Any]:
        model = self.model
        model.advance(self.clock())
        self._rearm()
        kv = model.kv
        stats = model.stats
        return {
            "kind": "engine",
            "scheduling_policy": self.params.scheduling_policy,
            "running": len(model.running),
            "waiting": len(model.waiting),
            "kv_cache_usage": kv.usage,
            "kv_blocks": {
                "total": kv.num_blocks,
                "used": kv.used_blocks,
                "free": kv.free,
                "cached": kv.cached_blocks,
                "cached_idle": kv.idle_blocks,
                "reserved": kv.reserved,
            },
            "itl_seconds": model.itl(),
            "prompt_tokens_total": stats.prompt_tokens,
            "generation_tokens_total": stats.generation_tokens,
            "prefix_cache_queries_total": stats.prefix_cache_queries,
            "prefix_cache_hits_total": stats.prefix_cache_hits,
            "finished": dict(stats.finished),
            "rejected": stats.rejected,
        }

    def metrics(self) -> tuple[bytes, str]:
        self.model.advance(self.clock())
        self._rearm()
        return self.metrics_exporter.render()

    def shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- driver ----------------------------------------------------------------------------
    def abort(self, seq: Seq) -> None:
        self.model.abort(seq, self.clock())
        self._rearm()

    def _rearm(self) -> None:
        due = self.model.next_due()
        if due is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None:
            if self._timer_due <= due:
                return  # an earlier (or equal) wake-up is already armed
            self._timer.cancel()
        delay = due - self.clock()
        self._timer_due = due
        self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.model.advance(self.clock())
        self._rearm()
