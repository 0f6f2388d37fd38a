"""The edge's admission client over NATS: one request/reply to the shard's owner per attempt.

`NatsAdmission.admit` publishes the `AdmitRequest` to ``llmgw.v1.admission.request.<shard>``
with a reply subject under this edge's one inbox subscription (no per-request subscription, no
per-request timer task) and waits:

- for the first answer within ``nats.request_timeout``: the decision, or QUEUED (the request
  waits in flow control), after which it waits up to ``admission.queue_ttl`` more for the
  decision. So an admission service that does not answer fails the request within the request
  timeout, never the whole queue budget (invariant I7);
- "no responders" or NOT_OWNER (the shard is moving between instances) is retried with a short
  backoff within the request timeout (counted afresh when a queued request is handed back:
  its instance stopped and answered NOT_OWNER for everything it had queued);
- an ask without an answer after a quarter of the request timeout is asked again, and a queued
  request asks again every request timeout: when a NATS node dies, the ask or its answer may
  die in that node's connection buffers (the edge's or the owner's). Every ask of an attempt
  carries the same attempt id and reply subject, and admission answers an attempt it decided
  or queued the same way again (`AdmissionService.on_request`), as does the new owner of a
  shard handed over with the grant: one attempt is not granted twice. A grant that still
  comes after the attempt has its answer (a new owner that adopted the shard by roll call and
  decided an ask again anew, or a grant after the timeout) is ended at once (`_stray`);
- while NATS is unreachable it fails at once (`AdmissionUnavailable(fast=True)`): the declared
  outage mode `reject` answers 503 with Retry-After without waiting. One exception, a cluster's
  failover: when the connection dropped and its server list has another server to move to, a
  request waits for the reconnection within its request timeout (`reachable`); a reconnection
  to a surviving node takes a fraction of a second, so a request that reaches the edge while
  its node dies is not failed for it. Once such a wait ran out, NATS counts as unreachable and
  requests fail at once again until the connection is back.

While queued it watches the client: when the client hangs up it tells every admission instance
to drop the request (``llmgw.v1.admission.cancel``) and still takes the answer (CANCELLED, or a
grant that crossed the cancel, whose lease the caller ends at once).

Readiness: a background probe asks ``llmgw.v1.admission.health`` every second; the edge is ready
while NATS is connected and an admission instance answered within the last few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from llmgw.clock import SYSTEM, Clock
from llmgw.contracts import AdmissionUnavailable
from llmgw.core.outcomes import Outcome, Refusal
from llmgw.tasks import cancel_and_wait
from llmgw.tracing import current_headers
from llmgw.wire import (
    ADMISSION_CANCEL_SUBJECT,
    ADMISSION_HEALTH_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitCancel,
    AdmitReply,
    AdmitRequest,
    ReplyStatus,
    RequestEnded,
    admission_subject,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config

log = logging.getLogger("llmgw.edge.admission")

_NO_RESPONDERS = "503"
_BACKOFF = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_PROBE_EVERY = 1.0
_READY_FOR = 3.0  # seconds an answered probe keeps the edge ready
_RECONNECT_POLL = 0.005  # seconds between looks at a reconnecting connection (nats-py has no event)


class _Pending:
    """The answers to one attempt's asks, in arrival order (every ask shares its reply subject)."""

    __slots__ = ("answers", "waiter")

    def __init__(self) -> None:
        self.answers: deque[Msg] = deque()
        self.waiter: asyncio.Future[Msg | None] | None = None

    def put(self, msg: Msg) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
        else:
            self.answers.append(msg)

    async def next(self, budget: float, also: asyncio.Future[Any] | None = None) -> Msg | None:
        """The next answer, or None after `budget` seconds or once `also` is done (one timer
        and one future: this wait is on every request's path)."""
        if self.answers:
            return self.answers.popleft()
        if budget <= 0:
            return None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Msg | None] = loop.create_future()
        self.waiter = waiter
        timer = loop.call_later(budget, _give_up, waiter)
        if also is not None:
            also.add_done_callback(lambda _: _give_up(waiter))
        try:
            return await waiter
        finally:
            self.waiter = None
            timer.cancel()


def _give_up(waiter: asyncio.Future[Msg | None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class NatsAdmission:
    """`llmgw.contracts.AdmissionClient` over NATS request/reply (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        *,
        request_timeout: float,
        queue_ttl: float,
        clock: Clock = SYSTEM,
    ) -> None:
        self._nc = nc
        self.request_timeout = request_timeout
        self.queue_ttl = queue_ttl
        # An ask without an answer after this long is asked again (the first answer is
        # immediate: the decision, or QUEUED).
        self.reask_after = max(request_timeout / 4, 0.05)
        self._monotonic = clock.monotonic  # deadlines, when to ask again
        self._wall = clock.wall  # the stamp of an end it reports
        self._pending: dict[str, _Pending] = {}
        self._tokens = itertools.count()
        self._prefix = ""
        self._sub: Subscription | None = None
        self._probe: asyncio.Task[None] | None = None
        self._answered_at = float("-inf")
        self._unreachable = False  # a failover wait ran out: fail at once until connected again
        self.unanswered = 0  # probes without an answer in a row
        self.asked_again = 0  # asks repeated for want of an answer (the node-loss test reads it)
        # Reply subjects of attempts that have their answer (or timed out), for one more request
        # timeout: a grant arriving there is a stray (`_stray`), ended at once.
        self._finished: OrderedDict[str, tuple[float, AdmitRequest, str | None]] = OrderedDict()
        self.strays = 0

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_reply)
        await self._nc.flush()
        self._probe = asyncio.create_task(self._probing(), name="admission-probe")

    async def stop(self) -> None:
        if self._probe is not None:
            task, self._probe = self._probe, None
            await cancel_and_wait([task])
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    # ---- readiness ----------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._nc.is_connected and self._monotonic() - self._answered_at < _READY_FOR

    async def probe(self) -> bool:
        """Ask the admission instances whether any is alive; True if one answered in time."""
        if not self._nc.is_connected:
            return False
        try:
            await self._nc.request(ADMISSION_HEALTH_SUBJECT, b"", timeout=self.request_timeout)
        except Exception:
            self.unanswered += 1
            return False
        self.unanswered = 0
        self._answered_at = self._monotonic()
        return True

    async def _probing(self) -> None:
        while self._probe is not None:
            with contextlib.suppress(Exception):
                await self.probe()
            await asyncio.sleep(_PROBE_EVERY)

    # ---- reaching NATS -------------------------------------------------------------------------

    async def reachable(self, deadline: float | None = None) -> bool:
        """Whether NATS is connected, waiting until `deadline` (default: one request timeout)
        for a reconnection that may succeed: the connection is reconnecting and its server list
        has another server (a cluster's failover). False at once otherwise (one server: an
        outage), and while an earlier wait ran out without a reconnection."""
        nc = self._nc
        if nc.is_connected:
            self._unreachable = False
            return True
        # Reconnecting, or connecting to the next server (nats-py says CONNECTING meanwhile).
        moving = nc.is_reconnecting or nc.is_connecting
        if self._unreachable or not (moving and len(nc.servers) > 1):
            return False
        if deadline is None:
            deadline = self._monotonic() + self.request_timeout
        while self._monotonic() < deadline:
            await asyncio.sleep(_RECONNECT_POLL)
            if nc.is_connected:
                return True
            if nc.is_closed:
                return False
        self._unreachable = True
        return False

    # ---- deciding -----------------------------------------------------------------------------

    async def _on_reply(self, msg: Msg) -> None:
        pending = self._pending.get(msg.subject)
        if pending is not None:
            pending.put(msg)
        elif msg.subject in self._finished:
            await self._stray(msg)

    async def admit(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool]:
        """The decision, and whether the client left while the request was queued."""
        nc = self._nc
        deadline = self._monotonic() + self.request_timeout
        if nc.is_connected:
            self._unreachable = False
        elif not await self.reachable(deadline):
            raise AdmissionUnavailable("the gateway cannot reach NATS", fast=True)
        payload = request.model_dump_json(exclude_defaults=True).encode()
        subject = admission_subject(request.shard)
        # One reply subject for every ask of this attempt: a late answer to an earlier ask is
        # as good as the latest one (admission answers an attempt it knows the same way).
        token = f"{self._prefix}.{next(self._tokens)}"
        pending = _Pending()
        self._pending[token] = pending

        taken: str | None = None  # the lease of the grant returned

        async def ask() -> None:
            try:
                await nc.publish(subject, payload, reply=token, headers=current_headers())
            except Exception as exc:  # closed, or the reconnect buffer is full
                raise AdmissionUnavailable("the gateway cannot reach NATS", fast=True) from exc

        try:
            for attempt in itertools.count():
                await ask()
                msg = await pending.next(min(deadline - self._monotonic(), self.reask_after))
                while msg is None and self._monotonic() < deadline:
                    # No answer yet: the ask or its answer may have been lost with a NATS node
                    # (in a dead connection's buffers). Ask again: same attempt, same answer.
                    self.asked_again += 1
                    await ask()
                    msg = await pending.next(min(deadline - self._monotonic(), self.reask_after))
                if msg is None:
                    raise AdmissionUnavailable("the admission service did not answer in time")
                if not _no_responders(msg):
                    reply = AdmitReply.model_validate_json(msg.data)
                    left = False
                    if reply.status is ReplyStatus.QUEUED:
                        reply, left = await self._queued(request, pending, ask, client_gone)
                        # Handed back from a queue (its instance stopped): the new owner gets
                        # a full request timeout, however long it waited there.
                        deadline = max(deadline, self._monotonic() + self.request_timeout)
                    if reply.refusal is not Refusal.NOT_OWNER:
                        self._answered_at = self._monotonic()
                        taken = reply.lease.lease_id if reply.lease is not None else None
                        return reply, left
                # Nobody serves the shard right now (it is moving): ask again shortly.
                pause = _BACKOFF[min(attempt, len(_BACKOFF) - 1)]
                if self._monotonic() + pause >= deadline:
                    raise AdmissionUnavailable("no admission instance serves this request's shard")
                await asyncio.sleep(pause)
            raise AssertionError("unreachable")
        finally:
            self._pending.pop(token, None)
            self._finish(token, request, taken)
            for msg in pending.answers:  # answers that came after the one taken
                await self._stray(msg)

    def _finish(self, token: str, request: AdmitRequest, taken: str | None) -> None:
        now = self._monotonic()
        finished = self._finished
        finished[token] = (now + self.request_timeout, request, taken)
        while finished and next(iter(finished.values()))[0] < now:
            finished.popitem(last=False)

    async def _stray(self, msg: Msg) -> None:
        """An answer to an attempt that has its answer (or gave up): a grant of another lease
        (asked again, a new owner that adopted the shard by roll call decided anew; or it
        came after the timeout) is ended at once, so the owner does not hold it until a renewal leaves it out.
        Asks of one attempt answered by one owner all carry its one lease: not strays."""
        _, request, taken = self._finished[msg.subject]
        if _no_responders(msg):
            return
        try:
            reply = AdmitReply.model_validate_json(msg.data)
        except ValueError:
            return
        lease = reply.lease
        if reply.status is not ReplyStatus.ADMITTED or lease is None or lease.lease_id == taken:
            return
        self.strays += 1
        ended = RequestEnded(
            id=request.id,
            request_id=request.request_id,
            edge=request.edge,
            lease=lease.lease_id,
            shard=lease.shard,
            ok=False,
            outcome=Outcome.ADMISSION_UNAVAILABLE.value,  # never used: the attempt was over
            model=request.model,
            provider=lease.provider,
            endpoint=lease.endpoint or "?",
            ended_at=self._wall(),
            sent=False,
        )
        with contextlib.suppress(Exception):
            await self._nc.publish(REQUEST_STATS_SUBJECT, ended.model_dump_json().encode())

    def follow(self, config: Config, draining: frozenset[str] = frozenset()) -> None:
        """Wait for a queued request as long as `config`'s queue TTL (an applied config)."""
        self.queue_ttl = config.admission.queue_ttl

    async def _queued(
        self,
        request: AdmitRequest,
        pending: _Pending,
        ask: Callable[[], Awaitable[None]],
        client_gone: Callable[[], Awaitable[object]] | None,
    ) -> tuple[AdmitReply, bool]:
        """Wait for the decision of a queued request, cancelling it if the client leaves. Asks
        again every request timeout (the decision may have been lost with a NATS node; the
        owner answers QUEUED again while it still waits, or repeats its decision)."""
        end = self._monotonic() + self.queue_ttl + self.request_timeout
        watcher = asyncio.ensure_future(client_gone()) if client_gone is not None else None
        try:
            while (now := self._monotonic()) < end:
                msg = await pending.next(min(end - now, self.request_timeout), watcher)
                if msg is not None:
                    reply = _decision(msg)
                    if reply is not None:
                        return reply, False
                elif watcher is not None and watcher.done():
                    return await self._cancel(request, pending), True
                else:
                    self.asked_again += 1
                    await ask()
            raise AdmissionUnavailable("the admission service did not answer in time")
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()

    async def _cancel(self, request: AdmitRequest, pending: _Pending) -> AdmitReply:
        """The client left a queued request: tell every instance, and take the answer (CANCELLED,
        or a grant that crossed the cancel)."""
        cancel = AdmitCancel(id=request.id).model_dump_json().encode()
        with contextlib.suppress(Exception):
            await self._nc.publish(ADMISSION_CANCEL_SUBJECT, cancel)
        end = self._monotonic() + self.request_timeout
        while (msg := await pending.next(end - self._monotonic())) is not None:
            reply = _decision(msg)
            if reply is not None:
                return reply
        return AdmitReply(id=request.id, status=ReplyStatus.REFUSED, refusal=Refusal.CANCELLED)


def _no_responders(msg: Msg) -> bool:
    return bool(msg.headers and msg.headers.get("Status") == _NO_RESPONDERS)


def _decision(msg: Msg) -> AdmitReply | None:
    """The decision a message carries, None for what a queued request ignores: QUEUED again
    (the answer to an ask again) and "no responders" (to an ask sent while the owner moved)."""
    if _no_responders(msg):
        return None
    reply = AdmitReply.model_validate_json(msg.data)
    return None if reply.status is ReplyStatus.QUEUED else reply
