"""Adoption's reading and its aftermath (the sequence itself is `Handovers.adopt`).

`gather`: a claimed shard's state, its leases from the edges (a roll call on
``llmgw.v1.admission.rollcall``, answers collected for ``admission.rollcall_window``) and its
pins from the bucket.

`DeadQuota`: a dead instance's quota. Once no shard key names a dead G as its owner, and every
other adoption from G has had time to move its counts (``settle_after`` its claim: shards.py's
``_ADOPTION_SETTLE``),
each adopter drops what is left of G's entry from the books (one CAS per book; the first wins,
the others find nothing), instead of leaving it to the reaper's grace. Dead means not live:
G's key was removed (a successor, `successor.py`) or not renewed for ``member_ttl`` (G fenced
itself before that: it never spends its entry again). A transfer from G that lands after the
drop moves nothing, and its receiver takes in what its own quota covers (docs/adr/0002,
"Changed (2026-12-03)").

Both read the store and the edges; `DeadQuota` writes only the dead instance's entries (through
`drop_dead_quota`) and hands the freed books to the quota keeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.core.ledger import LeaseRecord, PinRecord, ShardState
from llmgw.events import QuotaReclaimed
from llmgw.services.admission.successor import drop_dead_quota
from llmgw.wire import ADMISSION_ROLLCALL_SUBJECT, RollCall, RollCallAnswer

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from llmgw.services.admission.shards import ShardContext, ShardKeeper

log = logging.getLogger("llmgw.admission.shards")


async def gather(ctx: ShardContext, shards: list[int]) -> list[ShardState]:
    """The shards' leases from the edges (a roll call) and pins from the bucket."""
    now = ctx.clock()
    announced = await rollcall(ctx, shards)
    states: list[ShardState] = []
    for shard in shards:
        pins = []
        for key, stored in await ctx.store.shard_pins(shard):
            value = stored.value
            pins.append(
                PinRecord(
                    key,
                    value.pin_id,
                    value.provider,
                    value.model,
                    value.session,
                    shard,
                    value.created_at,
                    value.since,
                    max(value.refreshed_at, now),
                    value.refreshed_at,
                    stored.revision,
                    uses=2,  # its history is unknown: a conversation, not a one-shot
                    parent=value.parent,
                )
            )
            ctx.pins.known(key, stored.revision)
        states.append(ShardState(shard, tuple(pins), tuple(announced.get(shard, ()))))
    return states


async def rollcall(ctx: ShardContext, shards: Iterable[int]) -> dict[int, list[LeaseRecord]]:
    """Ask every edge which leases it holds in `shards`; answers within the window."""
    wanted = set(shards)
    found: dict[int, dict[str, LeaseRecord]] = {}

    async def collect(msg: Msg) -> None:
        try:
            answer = RollCallAnswer.model_validate_json(msg.data)
        except ValidationError:
            return
        for lease in answer.leases:
            if lease.shard in wanted:
                found.setdefault(lease.shard, {})[lease.lease_id] = lease

    inbox = ctx.nc.new_inbox()
    sub = await ctx.nc.subscribe(inbox, cb=collect)
    try:
        call = RollCall(owner=ctx.instance, shards=tuple(sorted(wanted)))
        await ctx.nc.publish(
            ADMISSION_ROLLCALL_SUBJECT, call.model_dump_json().encode(), reply=inbox
        )
        # Not a guess at synchronisation: a roll call has no count of answers to wait for
        # (edges come and go); the window is its documented deadline.
        await asyncio.sleep(ctx.settings.rollcall_window)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return {shard: list(leases.values()) for shard, leases in found.items()}


class DeadQuota:
    """Drops what is left of dead instances' quota once their shards are adopted."""

    def __init__(self, ctx: ShardContext, keeper: ShardKeeper, *, settle_after: float) -> None:
        self.ctx = ctx
        self.keeper = keeper
        # How long after another instance's claim of a dead instance's shard its adoption may
        # still be moving counts from the dead entry: only then is the entry dropped.
        self.settle_after = settle_after
        self._settling: dict[str, asyncio.Task[None]] = {}  # dead instances' quota, by id

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._settling.values())

    def settle(self, dead: str) -> None:
        """Drop what is left of the dead instance's quota once its shards are adopted."""
        if self.keeper.stopping or dead in self._settling:
            return
        task = asyncio.create_task(self._drop(dead), name=f"settle-{dead}")
        self._settling[dead] = task
        task.add_done_callback(lambda _: self._settling.pop(dead, None))

    async def _drop(self, dead: str) -> None:
        settings = self.ctx.settings
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 3 * settings.member_ttl  # then the reaper's grace does it
        while not self.keeper.stopping and loop.time() < give_up:
            wait = await self.settle_once(dead)
            if wait is None:
                return
            await asyncio.sleep(min(wait, settings.member_ttl))

    async def settle_once(self, dead: str) -> float | None:
        """Drop the dead instance's quota if its shards are adopted (None: done, or it is not
        dead after all); else how long to wait before looking again."""
        ctx = self.ctx
        membership = ctx.membership
        heartbeat = ctx.settings.heartbeat
        if membership.is_live(dead):
            return None  # not dead: a live member's entry is its own
        me = membership.instance
        wait = 0.0
        try:
            now = ctx.clock()
            serving = self.keeper.serving
            for shard, stored in (await ctx.store.shard_owners()).items():
                value = stored.value
                if (
                    value.owner == dead
                    or (value.owner is None and value.previous == dead)
                    or (value.owner == me and shard not in serving)
                ):
                    wait = max(wait, heartbeat)  # a shard still to be adopted
                elif value.previous == dead and value.owner != me:
                    wait = max(wait, self.settle_after - (now - value.since))
            if wait > 0:
                return wait
            dropped = await drop_dead_quota(ctx.store, dead)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("quota of %s not settled yet (%s)", dead, exc)
            return heartbeat
        quotas = ctx.quotas
        for held, book in dropped:
            pair = (book.value.provider, book.value.model)
            if pair in quotas.books and book.revision > quotas.books[pair].revision:
                quotas.books[pair] = book  # the keeper takes what was freed at once
            ctx.events.emit(
                QuotaReclaimed,
                provider=book.value.provider,
                model=book.value.model,
                member=dead,
                leases=held.g,
                unreserved=held.u,
                pins=held.p,
            )
        if dropped:
            log.info(
                "dropped what was left of %s's quota in %d books: its shards are adopted",
                dead,
                len(dropped),
            )
            await quotas.adjust()
        return None
