"""The reaper loop: every interval, run the routing state's reaper primitives and announce.

What to reclaim, and the compare-and-swap that makes each reclaim happen once, live in the
primitives (`RoutingState.expire_leases / expire_pins / repair`); this loop only sequences them,
publishes the changes they report and measures. Any number of reapers may run on one bucket:
when two race for the same expired lease, one CAS wins and only the winner reports (and so
announces) it; the loser sees a conflict and does nothing.

A pass runs the three steps in order: expire leases (which also unlists them from their pins),
expire idle pins (a pin emptied by the first step expires in the same pass if its inactivity
countdown has run out), then repair. A step that raises or exceeds `step_timeout` is logged and
counted and the pass goes on; the next pass retries. Events of a step are published right after
it, so a later step's failure loses none. A change made by a step that was cut short is not
reported (its event is lost; the state stays consistent and later passes finish the work).

Stopping: `run(stop)` checks `stop` between passes only, so a pass in progress is finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmgw.core.leases import ReaperAction
from llmgw.events import ReaperCause
from llmgw.services.reaper.metrics import ReaperMetrics

__all__ = [
    "MIN_REPAIR_GRACE",
    "PassResult",
    "Reaper",
    "ReaperEvents",
    "ReaperPrimitives",
    "repair_grace",
    "step_timeout",
]

_log = logging.getLogger("llmgw.reaper")

# Repairs undo operations that died half-way; one still running must never be "repaired". An
# admission is a handful of KV calls, each bounded by NATS timeouts of a few seconds, so half a
# minute is an order of magnitude above any live operation even with a short lease timeout.
MIN_REPAIR_GRACE = 30.0
MIN_STEP_TIMEOUT = 30.0


def repair_grace(lease_timeout: float) -> float:
    """How old a half-finished transition must be before repair undoes it."""
    return max(2 * lease_timeout, MIN_REPAIR_GRACE)


def step_timeout(interval: float) -> float:
    """Bound on one step: a stalled NATS call must not stop the reaper forever."""
    return max(10 * interval, MIN_STEP_TIMEOUT)


class ReaperPrimitives(Protocol):
    """The routing state's reaper operations (`RoutingState` satisfies it).

    Each returns only the changes whose write succeeded (so each is reported once overall).
    """

    async def expire_leases(self, now: float) -> list[ReaperAction]: ...

    async def expire_pins(self, now: float) -> list[ReaperAction]: ...

    async def repair(self, now: float, grace: float) -> list[ReaperAction]: ...


class ReaperEvents(Protocol):
    """Where changes are announced (`llmgw.events.EventPublisher` satisfies it)."""

    async def publish_reaper_actions(
        self, actions: Iterable[ReaperAction], cause: ReaperCause
    ) -> int: ...


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one pass did: the changes made (in step order) and the steps that failed."""

    actions: Sequence[ReaperAction]
    failed_steps: Sequence[str]
    duration: float


class Reaper:
    """Runs reaper passes over `state`, publishing every change through `events`.

    `clock` gives the `now` the primitives compare lease and pin times with: it must be the
    clock that stamps leases and pins (unix seconds in the product). `timer` measures
    durations only.
    """

    def __init__(
        self,
        state: ReaperPrimitives,
        events: ReaperEvents,
        metrics: ReaperMetrics,
        *,
        clock: Callable[[], float],
        interval: float,
        grace: float,
        step_timeout: float = MIN_STEP_TIMEOUT,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._state = state
        self._events = events
        self.metrics = metrics
        self._clock = clock
        self._timer = timer
        self.interval = interval
        self.grace = grace
        self.step_timeout = step_timeout
        self.passes = 0  # passes completed
        self._pass_done = asyncio.Condition()

    def _steps(
        self,
    ) -> list[tuple[str, ReaperCause, Callable[[float], Awaitable[list[ReaperAction]]]]]:
        state = self._state
        return [
            ("expire_leases", ReaperCause.EXPIRY, state.expire_leases),
            ("expire_pins", ReaperCause.EXPIRY, state.expire_pins),
            ("repair", ReaperCause.REPAIR, lambda now: state.repair(now, self.grace)),
        ]

    async def run_pass(self) -> PassResult:
        """One pass over every step (see the module docstring); never raises but cancellation."""
        started = self._timer()
        actions: list[ReaperAction] = []
        failed: list[str] = []
        for name, cause, step in self._steps():
            try:
                async with asyncio.timeout(self.step_timeout):
                    done = await step(self._clock())
            except Exception:  # TimeoutError included: the next pass retries
                _log.warning("reaper step %s failed", name, exc_info=True)
                self.metrics.step_failures.labels(name).inc()
                failed.append(name)
                continue
            for action in done:
                self.metrics.count_action(action.kind)
            sent = await self._events.publish_reaper_actions(done, cause)
            if sent < len(done):
                self.metrics.unpublished_events.inc(len(done) - sent)
            actions.extend(done)
        duration = self._timer() - started
        self.metrics.pass_duration.observe(duration)
        self.metrics.last_pass.set(self._clock())
        if actions:
            counts = Counter(str(a.kind) for a in actions)
            _log.info("reaped: %s", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        async with self._pass_done:
            self.passes += 1
            self._pass_done.notify_all()
        return PassResult(tuple(actions), tuple(failed), duration)

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass, `interval` apart, until `stop` is set (the current pass finishes)."""
        while not stop.is_set():
            await self.run_pass()
            try:
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            except TimeoutError:
                pass

    async def wait_for_passes(self, count: int) -> None:
        """Return once `count` passes have completed in total (bound it with asyncio.timeout)."""
        async with self._pass_done:
            await self._pass_done.wait_for(lambda: self.passes >= count)
