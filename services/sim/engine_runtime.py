"""Drives an `EngineModel` in real time on the asyncio loop; the engine `Backend`.

One timer per engine (``loop.call_later``) is armed for the model's next due event; when it fires
the model advances to the clock's current time and the timer is re-armed. With no sequences
running no timer is armed (no busy loop), and with all timings zero a request completes inside
`start` without any timer or task switch, which keeps zero-delay benchmarks cheap.

With ``kv_events_endpoint`` set, the model records its cache changes (`KvEventRecorder`) and
every call that ran the model hands the recorded batches to the `KvEventPublisher`, under the
current fault knobs (`apply_faults`).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmgw.services.sim.engine_model import EngineModel, PriorityNotEnabled, PromptTooLong
from llmgw.services.sim.engine_model import Sequence as Seq
from llmgw.services.sim.generation import OutputLimits, SimError
from llmgw.services.sim.kv_events import KvEventRecorder
from llmgw.services.sim.metrics import EngineMetrics
from llmgw.services.sim.params import EngineParams, FaultKnobs

if TYPE_CHECKING:
    from llmgw.services.sim.kv_publisher import KvEventPublisher

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
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`wall_clock` stamps KV-event batches (vLLM: ``time.time()``)."""
        self.params = params
        self.clock = clock
        self.metrics_exporter = EngineMetrics(params, model_name)
        self.kv_publisher: KvEventPublisher | None = None
        self._kv_recorder: KvEventRecorder | None = None
        if params.kv_events_endpoint is not None:
            # Imported only here: pyzmq and msgpack are the kv-events extra.
            from llmgw.services.sim.kv_publisher import KvEventPublisher

            self._kv_recorder = KvEventRecorder(_salt())
            self.kv_publisher = KvEventPublisher(params, wall_clock=wall_clock)
        self._faults = params.faults()
        self.model = EngineModel(
            params,
            rng,
            on_first_token=self.metrics_exporter.observe_first_token,
            on_finish=self.metrics_exporter.observe_finish,
            kv_events=self._kv_recorder,
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
        self._publish_kv_events()
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
            **({"kv_events": self.kv_publisher.state()} if self.kv_publisher else {}),
        }

    def metrics(self) -> tuple[bytes, str]:
        self.model.advance(self.clock())
        self._rearm()
        return self.metrics_exporter.render()

    def shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- engine controls -------------------------------------------------------------------
    async def startup(self) -> None:
        """Bind the KV-event sockets, if any (a bind error fails the server's start-up)."""
        if self.kv_publisher is not None:
            await self.kv_publisher.start()

    async def aclose(self) -> None:
        if self.kv_publisher is not None:
            await self.kv_publisher.close()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``POST /reset_prefix_cache`` (see `EngineModel.reset_prefix_cache`)."""
        done = self.model.reset_prefix_cache(
            self.clock(), reset_running_requests=reset_running_requests
        )
        self._rearm()
        return done

    def apply_faults(self, faults: FaultKnobs) -> None:
        """Take the current fault knobs: batches to skip or lose count down in them, and
        `kv_events_restart` restarts the prefix cache and the event stream now."""
        self._faults = faults
        if faults.kv_events_restart:
            faults.kv_events_restart = False
            self._restart_kv()

    def _restart_kv(self) -> None:
        now = self.clock()
        self.model.advance(now)
        self._publish_kv_events()  # what happened before the restart went out before it
        self.model.reset_prefix_cache(now, reset_running_requests=True)
        if self._kv_recorder is not None and self.kv_publisher is not None:
            self._kv_recorder.take()  # a restarting engine announces nothing
            self._kv_recorder.resalt(_salt())
            self.kv_publisher.restart()
        self._rearm()

    def _publish_kv_events(self) -> None:
        if self._kv_recorder is not None and self.kv_publisher is not None:
            for events in self._kv_recorder.take():
                self.kv_publisher.publish(events, self._faults)

    # -- driver ----------------------------------------------------------------------------
    def abort(self, seq: Seq) -> None:
        self.model.abort(seq, self.clock())
        self._rearm()

    def _rearm(self) -> None:
        self._publish_kv_events()
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


def _salt() -> bytes:
    """A random salt for published block hashes, new for each engine (and restart)."""
    return os.urandom(16)
