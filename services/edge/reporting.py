"""What the edge tells the rest of the gateway when an upstream attempt ends.

One `RequestEnded` per attempt on ``llmgw.v1.stats.request``: the lease's release for the shard
owner, the rate balancers' sample and the breakers' evidence for every admission instance, and
usage for anyone who reports on it. Published off the request path: messages queue here and one
background flush hands them all to the NATS client (no task per request).

With a colocated admission instance (``admission.colocated``) each end is first applied in
process (`local`, `AdmissionService.ended_here`): a lease of that instance is released before
the next request is read, and the instance ignores the copy that comes back over NATS. An end
that settled everything here leaves for the others (their samples and evidence) within `hold`
seconds (20 ms), batched with the ends of that window: that saves nats-server and this process
a wake-up per request at low rates, and socket writes (one per window) at any rate. An end whose
lease another instance holds goes at the next event-loop turn, as without a colocated instance.

An attempt that ended `model_unloaded` (a managed engine's 404 for a model the fleet lists
there) also asks the reapers to read that engine's model list again (`ModelsStale` on
``llmgw.v1.fleet.models_stale``), once per endpoint and model per `STALE_EVERY` seconds
(`NoticeGate`): a burst of such answers is one notice.

Best effort by design: a lost message costs one renewal interval of a lease (the owner ends it
when the edge's next lease list leaves it out) and one balancer sample; a lost notice, the wait
for the next `fleet.models_refresh`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of
from llmgw.core.outcomes import Outcome
from llmgw.wire import MODELS_STALE_SUBJECT, REQUEST_STATS_SUBJECT, ModelsStale

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.wire import RequestEnded

log = logging.getLogger("llmgw.edge.reporting")

HOLD = 0.02  # seconds an end settled in process may wait to share one flush
STALE_EVERY = 1.0  # seconds between two notices of one endpoint and model
_MODEL_UNLOADED = Outcome.MODEL_UNLOADED.value
_GATE_SIZE = 1024  # (endpoint, model) pairs remembered at most


class NoticeGate:
    """Which notices go out: a key's first, then at most one per `every` seconds. Pure: the
    time is passed in."""

    def __init__(self, every: float = STALE_EVERY) -> None:
        self.every = every
        self._last: dict[tuple[str, str], float] = {}

    def due(self, key: tuple[str, str], now: float) -> bool:
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            return False
        if len(self._last) >= _GATE_SIZE:  # forget those past their window
            self._last = {k: t for k, t in self._last.items() if now - t < self.every}
        self._last[key] = now
        return True


class NatsReporter:
    """`llmgw.contracts.RequestReporter` over core NATS publish. `scope`: the fleet bucket the
    edge runs on (its model-list notices name it)."""

    def __init__(
        self,
        nc: NATS,
        local: Callable[[RequestEnded], bool] | None = None,
        hold: float = HOLD,
        *,
        scope: str = "",
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self._nc = nc
        self._local = local
        self._hold = hold
        self._scope = scope
        self._clock = monotonic_of(clock)
        self._gate = NoticeGate()
        self._notices: list[bytes] = []
        self.notices = 0  # model-list notices sent
        self._queued: list[RequestEnded] = []  # serialized by the flush, off the request path
        self._flushing: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None  # set: flush without waiting `hold`
        self.sent = 0
        self.failures = 0

    def report(self, message: RequestEnded) -> None:
        urgent = True
        if self._local is not None:
            try:
                urgent = not self._local(message)
            except Exception:  # the NATS copy still reaches every instance
                log.exception("request end not applied in process")
        self._queued.append(message)
        if message.outcome == _MODEL_UNLOADED:
            urgent = self._notice(message) or urgent
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush(urgent))
        elif urgent:
            self._now()

    def _notice(self, message: RequestEnded) -> bool:
        """Queue a model-list notice for the attempt's endpoint unless one went out lately."""
        model = message.served_model or message.model
        if not self._gate.due((message.endpoint, model), self._clock()):
            return False
        notice = ModelsStale(
            edge=message.edge, scope=self._scope, endpoint=message.endpoint, model=model
        )
        self._notices.append(notice.model_dump_json().encode())
        return True

    def _now(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _flush(self, urgent: bool) -> None:
        if urgent:
            await asyncio.sleep(0)  # let this turn's other ends join the batch
        else:
            loop = asyncio.get_running_loop()
            self._wake = loop.create_future()
            timer = loop.call_later(self._hold, self._now)
            try:
                await self._wake
            finally:
                timer.cancel()
                self._wake = None
        while self._queued or self._notices:
            batch, self._queued = self._queued, []
            for message in batch:
                try:
                    payload = message.model_dump_json(exclude_defaults=True).encode()
                    await self._nc.publish(REQUEST_STATS_SUBJECT, payload)
                    self.sent += 1
                except Exception as exc:
                    self.failures += 1
                    log.debug("request stats not published: %s", exc)
            notices, self._notices = self._notices, []
            for payload in notices:
                try:
                    await self._nc.publish(MODELS_STALE_SUBJECT, payload)
                    self.notices += 1
                except Exception as exc:
                    log.debug("model-list notice not published: %s", exc)

    async def drain(self, timeout: float = 5.0) -> None:
        self._now()
        if self._flushing is not None and not self._flushing.done():
            await asyncio.wait([self._flushing], timeout=timeout)
