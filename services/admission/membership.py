"""This admission instance's membership, and its view of every member and shard owner.

- **Join**: create ``member.<instance>`` (a unique id per process start).
- **Heartbeat** every ``admission.heartbeat``: CAS the member key with a new ``renewed_at``.
  Others treat a member as dead once ``renewed_at + admission.member_ttl`` has passed.
- **Fencing**: this instance serves only while its last successful heartbeat is younger than
  ``fence_after`` (the TTL less a safety margin of max(2 s, 20%), measured on its own monotonic
  clock), so it stops deciding before anyone may take its shards or quota (hosts' clocks may
  differ by less than that margin). The TTL is long enough (15 s by default) to ride out a NATS
  stream leader election (4-9 s after a node dies) without fencing: while the bucket has no
  leader nobody can claim anything anyway, and decisions need no KV write.
- **Lost**: a heartbeat whose CAS fails (the reaper removed the key after this instance was
  paused for long), or the first heartbeat after having been fenced (others may have claimed
  its shards and moved its quota meanwhile; it deletes its old key first), or the member watch
  showing its own key removed (a successor took it for dead: `--supersedes`, or a second
  process under its stable name; it stops deciding at once instead of at the next heartbeat):
  it decides nothing from then on (`fenced_at`: since when, its fence's moment if the fence
  came first), and `on_lost` drops everything it held and it joins again under a new id. A
  fenced instance never resumes deciding with what it held before.
- **View**: watches of ``member.`` and ``shard.`` keep `members` and `owners` current; every
  change calls `on_change`.

Nothing here decides; `ShardKeeper` plans from this view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of, wall_of
from llmgw.core.keys import MEMBER_PREFIX, SHARD_PREFIX, MemberValue, ShardValue, ValueFormatError
from llmgw.core.shards import Member, live_members
from llmgw.state.kv import CasConflict
from llmgw.tasks import cancel_and_wait

if TYPE_CHECKING:
    from llmgw.state.store import RoutingStore

log = logging.getLogger("llmgw.admission.membership")


class Membership:
    def __init__(
        self,
        store: RoutingStore,
        instance: str,
        *,
        heartbeat: float,
        ttl: float,
        clock: Clock | TimeSource = SYSTEM,
        monotonic: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.store = store
        self.instance = instance
        self.heartbeat = heartbeat
        self.ttl = ttl
        # Stop serving a safety margin before the TTL runs out without a successful heartbeat:
        # the margin covers clock skew between hosts and a heartbeat's own latency.
        self.fence_after = ttl - max(2.0, 0.2 * ttl) if ttl > 4.0 else 0.5 * ttl
        self._clock = wall_of(clock)
        self._monotonic = monotonic_of(monotonic)
        self._revision = 0
        # One renewal at a time: two at the same revision (the heartbeat's and
        # announce_leaving's) would have the second refused and the instance think itself lost.
        self._renewing = asyncio.Lock()
        self._joined_at = 0.0
        self._renewed_mono = float("-inf")
        self.members: dict[str, Member] = {}
        self.owners: dict[int, ShardValue] = {}
        self.owner_revisions: dict[int, int] = {}
        self.on_change: Callable[[], None] = lambda: None
        self.on_lost: Callable[[], None] = lambda: None
        self._tasks: list[asyncio.Task[None]] = []
        self.stopping = False
        self._closed = False
        # The deployment's stable name for this process (MemberValue.name), if it gave one.
        self.name: str | None = None
        self._lost = False  # on_lost called for the current id (once per id)
        # When it last stopped deciding (wall clock): its fence, or the moment it learnt it was
        # lost, whichever came first. For the audit trail: nothing it held is used after it.
        self.fenced_at: float | None = None
        self._epoch = 0  # one heartbeat loop per id: a loop of an earlier id stops

    # ---- state ------------------------------------------------------------------------------

    def can_serve(self) -> bool:
        """Renewed recently enough to decide (see fencing in the module docstring)."""
        return self._monotonic() - self._renewed_mono < self.fence_after

    def _stop_deciding(self) -> None:
        """Lost: `can_serve` is False from here on (if the fence has not made it so already),
        and `fenced_at` says since when (the fence's moment, if it came first)."""
        if self._renewed_mono == float("-inf"):
            return  # stopped already (or never joined)
        late = self._monotonic() - (self._renewed_mono + self.fence_after)
        self.fenced_at = self._clock() - max(late, 0.0)  # late > 0: the fence came first
        self._renewed_mono = float("-inf")

    def live(self) -> dict[str, Member]:
        members = live_members(self.members.values(), self._clock(), self.ttl)
        members.setdefault(
            self.instance, Member(self.instance, self._clock(), self._joined_at or self._clock())
        )
        return members

    def has_peers(self) -> bool:
        """Whether another instance is live (cheap when none is known at all)."""
        if not any(name != self.instance for name in self.members):
            return False
        return len(self.live()) > 1

    def is_live(self, instance: str | None) -> bool:
        return instance is not None and instance in self.live()

    # ---- lifetime ---------------------------------------------------------------------------

    async def join(self) -> None:
        now = self._clock()
        self._joined_at = now
        self._revision = await self.store.join(MemberValue(self.instance, now, now, name=self.name))
        self._renewed_mono = self._monotonic()
        # Beating from the moment the key exists: the fence counts from here, and reading the
        # view below (two listings) may take a while on a loaded host.
        self._tasks.append(asyncio.create_task(self._beat(), name="heartbeat"))
        # The current view first (a list), then the watches keep it current: the first plan
        # sees every owner, and a watch's replay of what was listed changes nothing.
        for stored in await self.store.members():
            m = stored.value
            self.members[m.instance] = Member(m.instance, m.renewed_at, m.joined_at, m.leaving)
        await self.refresh_owners()
        self._tasks.append(asyncio.create_task(self._follow(MEMBER_PREFIX), name="members"))
        self._tasks.append(asyncio.create_task(self._follow(SHARD_PREFIX), name="shards"))

    async def renew_now(self) -> bool:
        """One heartbeat; False if the instance is lost: its member key was taken away, or it
        has been fenced (its last renewal is ``fence_after`` old, measured when this one starts
        and again when it lands). A fenced instance must not pick up where it stopped: others
        may have claimed its shards and moved its quota meanwhile, so what its ledger holds can
        no longer be trusted. It deletes its member key (its remaining shards can be claimed at
        once) and is dropped and joins again under a new id, like a lost one. Lost, it decides
        nothing more from here on (`fenced_at`: since when).
        """
        if self._monotonic() - self._renewed_mono >= self.fence_after:
            # Fenced already: no need to wait behind a renewal that hangs in flight.
            self._stop_deciding()
            await self._abandon()
            return False
        async with self._renewing:
            started = self._monotonic()
            if started - self._renewed_mono >= self.fence_after:
                self._stop_deciding()
                await self._abandon()
                return False
            now = self._clock()
            revision = await self.store.renew_member(
                MemberValue(self.instance, self._joined_at, now, self.stopping, self.name),
                self._revision,
            )
            if revision is None:  # the key changed hands: not this instance's to decide with
                self._stop_deciding()
                return False
            self._revision = revision
            if self._monotonic() - self._renewed_mono >= self.fence_after:
                self._stop_deciding()
                await self._abandon()  # it landed after the previous renewal's protection ran out
                return False
            self._renewed_mono = started
            return True

    async def _abandon(self) -> None:
        with contextlib.suppress(CasConflict, Exception):
            await self.store.leave(self.instance, self._revision, self._joined_at)

    async def _beat(self) -> None:
        epoch = self._epoch
        while not self._closed:
            await asyncio.sleep(self.heartbeat)
            if self._closed or self._lost or epoch != self._epoch:
                return
            try:
                renewed = await self.renew_now()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS unreachable: keep trying; fencing protects us
                log.warning("heartbeat failed: %s", exc)
                continue
            if not renewed:
                if self.stopping:
                    return  # leaving anyway: whoever claims its shards adopts what is left
                if self._lost or epoch != self._epoch:
                    return  # the member watch saw the key go first
                log.error(
                    "member %s is lost (fenced, or its key was taken away: it could not renew "
                    "it for too long; stopped deciding %.1f s ago): dropping everything and "
                    "joining again",
                    self.instance,
                    self._clock() - (self.fenced_at or self._clock()),
                )
                self._lost = True
                self.on_lost()
                return

    async def rejoin(self, instance: str) -> None:
        """Join again under a new id (after being lost); the watches keep running."""
        self.instance = instance
        now = self._clock()
        self._joined_at = now
        self._revision = await self.store.join(MemberValue(instance, now, now, name=self.name))
        self._renewed_mono = self._monotonic()
        self._lost = False
        self._epoch += 1
        self._tasks = [t for t in self._tasks if t.get_name() != "heartbeat" or not t.done()]
        self._tasks.append(asyncio.create_task(self._beat(), name="heartbeat"))

    async def _follow(self, prefix: str) -> None:
        while not self._closed:
            try:
                async for entry in self.store.watch(prefix):
                    self._apply(prefix, entry.key, entry.value, entry.revision, entry.deleted)
                    self.on_change()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("watch of %s ended; retrying in 1 s", prefix, exc_info=True)
                await asyncio.sleep(1.0)

    def _apply(self, prefix: str, key: str, value: bytes, revision: int, deleted: bool) -> None:
        name = key[len(prefix) :]
        if prefix == MEMBER_PREFIX:
            if deleted:
                self.members.pop(name, None)
                if name == self.instance:
                    self._taken_away()
                return
            try:
                member = MemberValue.from_json(value)
            except ValueFormatError:
                return
            self.members[name] = Member(
                member.instance, member.renewed_at, member.joined_at, member.leaving
            )
        else:
            try:
                shard = int(name)
            except ValueError:
                return
            if revision < self.owner_revisions.get(shard, 0):
                return  # older than what a direct read showed
            if deleted:
                self.owners.pop(shard, None)
                self.owner_revisions.pop(shard, None)
                return
            try:
                self.owners[shard] = ShardValue.from_json(value)
            except ValueFormatError:
                return
            self.owner_revisions[shard] = revision

    def _taken_away(self) -> None:
        """The watch shows this instance's own key removed: a successor took it for dead
        (`--supersedes`, a stable name's next process), or the reaper did after a long pause.
        Stop deciding now (not at the next heartbeat) and drop everything."""
        if self.stopping or self._closed or self._lost or self._revision == 0:
            return  # leaving (it removes the key itself), or lost already
        log.error(
            "member %s is lost: its key was removed (a successor took it for dead); dropping "
            "everything and joining again",
            self.instance,
        )
        self._stop_deciding()
        self._lost = True
        self.on_lost()

    async def refresh_members(self) -> None:
        """Read every member key now (before a handover: the watch may lag a departure)."""
        stored = await self.store.members()
        self.members = {
            m.value.instance: Member(
                m.value.instance, m.value.renewed_at, m.value.joined_at, m.value.leaving
            )
            for m in stored
        }

    async def refresh_owners(self) -> None:
        """Read every shard key now (after a fence: do not trust what the watch had)."""
        owners = await self.store.shard_owners()
        for shard, stored in owners.items():
            if stored.revision >= self.owner_revisions.get(shard, 0):
                self.owners[shard] = stored.value
                self.owner_revisions[shard] = stored.revision

    async def announce_leaving(self) -> None:
        """Say in the member key that this instance is stopping, so nobody hands it shards."""
        self.stopping = True
        # Bounded: a heartbeat hung in flight holds the renewal; past the fence it is moot.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.renew_now(), timeout=self.fence_after)

    async def leave(self, *, write: bool = True) -> None:
        """Stop the heartbeat and watches; delete the member key (unless `write` is False:
        NATS is unreachable, and the key expires on its own after the TTL)."""
        self.stopping = True
        self._closed = True
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if not write:
            return
        with contextlib.suppress(CasConflict, Exception):
            await self.store.leave(self.instance, self._revision, self._joined_at)
