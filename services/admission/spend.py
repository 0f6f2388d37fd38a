"""Writing spend down: the edges' daily totals into the spend bucket, one put per edge a while.

Every edge publishes its totals of the current UTC day on ``llmgw.v1.spend.totals`` each
`spend.interval` while they change (services/edge/spend.py). Every admission instance subscribes
in one queue group, so each message reaches one instance, which keeps the latest totals per
(day, edge) and writes them to the bucket `spend.bucket` under ``spend.<day>.<edge>``. Writes
are puts of totals, not increments: a later copy replaces an earlier one, so two instances
writing copies of one edge's totals, or a lost message, cannot double or lose what the next
message carries. One write per edge per interval at most, never one per request.

The same bucket holds the budget accounts (``budget.<kind>.<scope>.<period>``,
llmgw.core.budget), written by `BudgetAccounts` for the edges, by CAS.

The bucket is the spend record `llmgw spend` and `llmgw keys usage` read: sum the rows of every
edge's entry of the days asked for (llmgw.core.spend.SpendTotals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from llmgw.core.budget import Account, AccountError, regrant
from llmgw.core.spend import spend_key
from llmgw.state.kv import CasConflict
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.tasks import cancel_and_wait
from llmgw.wire import (
    BUDGET_GRANT_SUBJECT,
    SPEND_TOTALS_SUBJECT,
    BudgetGrantReply,
    BudgetGrantRequest,
    SpendTotalsReport,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.state.nats_kv import NatsKV

log = logging.getLogger("llmgw.admission.spend")

SPEND_QUEUE = "llmgw-spend"


async def open_spend_bucket(nc: NATS, config: Config) -> NatsKV:
    """The spend bucket (file storage, one revision a key; created on first use)."""
    return await open_routing_bucket(
        nc.jetstream(),
        config.spend.bucket,
        storage="file",
        history=1,
        replicas=config.replicas_of(config.spend.bucket),
    )


class SpendRecorder:
    def __init__(self, nc: NATS, bucket: NatsKV) -> None:
        self._nc = nc
        self._bucket = bucket
        self._pending: dict[str, bytes] = {}  # KV key -> the latest totals not yet written
        self._wake = asyncio.Event()
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self.written = 0

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            SPEND_TOTALS_SUBJECT, queue=SPEND_QUEUE, cb=self._on_totals
        )
        self._task = asyncio.create_task(self._write_loop(), name="spend-recorder")

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()
        await self._flush()
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _on_totals(self, msg: Msg) -> None:
        try:
            report = SpendTotalsReport.model_validate_json(msg.data)
        except ValueError:
            return
        self._pending[spend_key(report.day, report.edge)] = msg.data
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        while self._pending:
            key = next(iter(self._pending))
            value = self._pending.pop(key)
            try:
                await self._bucket.put(key, value)
                self.written += 1
            except Exception as exc:
                # Kept for the next round unless newer totals arrived meanwhile.
                self._pending.setdefault(key, value)
                log.warning("spend totals of %s not written: %s", key, exc)
                await asyncio.sleep(0.5)
                return


class BudgetAccounts:
    """Answers the edges' grant requests (``llmgw.v1.spend.grant``, one queue group over every
    admission instance): one CAS write of the account per request (`llmgw.core.budget.regrant`),
    retried on a conflict with a racing instance. An edge asks when its grant cannot fit a
    request, and every `spend.interval` while it holds one, so the writes follow the edges'
    needs, not their requests. The answer names the other holders that hold more than they
    spent: an edge left short asks them for a loan (edge to edge, not through here)."""

    def __init__(self, nc: NATS, bucket: NatsKV, *, ttl: float, clock: Any = time.time) -> None:
        self._nc = nc
        self._bucket = bucket
        self._ttl = ttl
        self._clock = clock
        self._sub: Subscription | None = None
        self.writes = 0

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            BUDGET_GRANT_SUBJECT, queue=SPEND_QUEUE, cb=self._on_request
        )

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _on_request(self, msg: Msg) -> None:
        try:
            asked = BudgetGrantRequest.model_validate_json(msg.data)
        except ValueError as exc:
            reply = BudgetGrantReply(ok=False, error=f"malformed: {exc}")
        else:
            reply = await self.grant(asked)
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(reply.model_dump_json().encode())

    async def grant(self, asked: BudgetGrantRequest) -> BudgetGrantReply:
        for _ in range(_CAS_ATTEMPTS):
            try:
                entry = await self._bucket.get(asked.account)
                account = Account.from_json(entry.value) if entry is not None else None
                after, grant = regrant(
                    account,
                    holder=asked.edge,
                    limit=asked.limit,
                    spent=asked.spent,
                    want=asked.want,
                    now=self._clock(),
                    ttl=self._ttl,
                )
                if entry is None:
                    await self._bucket.create(asked.account, after.to_json())
                else:
                    await self._bucket.update(asked.account, after.to_json(), entry.revision)
            except CasConflict:
                continue
            except AccountError as exc:
                return BudgetGrantReply(ok=False, error=str(exc))
            except Exception as exc:
                log.warning("budget account %s not written: %s", asked.account, exc)
                return BudgetGrantReply(ok=False, error=f"not written: {exc}")
            self.writes += 1
            return BudgetGrantReply(
                grant=grant,
                room=after.room,
                spent=after.spent,
                mine=after.holders[asked.edge].spent,
                lenders=tuple(after.lenders(asked.edge).items()),
            )
        return BudgetGrantReply(ok=False, error="too many concurrent writers")


_CAS_ATTEMPTS = 20


def holder_ttl(config: Config) -> float:
    """How long a budget holder (an edge) may stay silent before its grant is freed: edges
    write every `spend.interval` while they hold one, so ten of those, and at least 30 s."""
    return max(30.0, 10 * config.spend.interval)
