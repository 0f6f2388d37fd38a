"""Taking over from an admission instance that is known to be dead, in seconds instead of after
``admission.member_ttl`` (docs/adr/0002-admission-at-memory-speed.md, "Changed (2026-12-03)").

Two ways to know:

- **A supervisor saw the process end** (`llmgw up` restarting an edge with admission in process,
  or an admission process): it names the dead instance (``--supersedes``), and the new one
  removes its member key before it joins (`remove_exited_member`).
- **A stable name from the deployment** (``--instance-name``, ``admission.instance_name``: a
  StatefulSet pod's name, a compose service run as one replica), which promises that at most one
  process runs under it. The member key records the name; a process starting under it takes an
  earlier incarnation's key for dead once that key has not been renewed for
  ``2 x heartbeat + 0.5 s`` (`supersede_name`; a live incarnation renews every heartbeat). A
  key that is renewed meanwhile belongs to a process that is running: the new one refuses to
  start (`NameInUse`) rather than decide the same shards. The key is removed by CAS at the
  revision it watched, so a renewal that lands in between also refuses.

Either way the dead instance's shards are claimed at once by the usual rules, and its quota is
returned as soon as its shards are adopted (`drop_dead_quota`, called by the shard keeper's
`Handovers` once no shard names the dead instance as its owner and every adoption from it has
had time to move its counts). A live instance whose key is removed stops deciding when its member watch shows
the removal (`Membership`), at the latest at its next heartbeat, whose CAS fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of

if TYPE_CHECKING:
    from llmgw.core.keys import MemberValue
    from llmgw.core.quota import Quota, QuotaBook
    from llmgw.state.store import RoutingStore, Stored

log = logging.getLogger("llmgw.admission.successor")


class NameInUse(RuntimeError):
    """Another process runs under this stable name: its member key is being renewed."""


async def remove_exited_member(store: RoutingStore, instance: str) -> bool:
    """Delete the member key of `instance` (the process that held it has exited), or of what
    it had become by joining again under a new id (``<instance>-r<token>``, after a fence);
    False when there is none (it left gracefully, or the reaper removed it)."""
    removed = False
    for stored in await store.members():
        name = stored.value.instance
        if name == instance or name.startswith(f"{instance}-r"):
            if await store.remove_member(name, stored.revision):
                log.info("removed the member key of %s: its process exited", name)
                removed = True
    return removed


async def supersede_name(
    store: RoutingStore,
    name: str,
    *,
    heartbeat: float,
    member_ttl: float,
    clock: Clock | TimeSource = SYSTEM,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[str]:
    """Remove the member keys of the earlier incarnations of the stable `name`, each once it
    has not been renewed for ``2 x heartbeat + 0.5 s`` (by its own `renewed_at`: hosts' clocks
    agree within the fencing margin, ADR 0002). Returns the ids removed. Raises `NameInUse` when
    one is renewed meanwhile (another process runs under the name), unless it is leaving: then
    it is waited for, up to ``2 x member_ttl``."""
    clock = wall_of(clock)
    quiet = 2 * heartbeat + 0.5
    removed: list[str] = []
    for first in [s for s in await store.members() if s.value.name == name]:
        stored: Stored[MemberValue] | None = first
        deadline = clock() + 2 * member_ttl
        while stored is not None:
            wait = stored.value.renewed_at + quiet - clock()
            if wait <= 0:
                break
            if clock() > deadline:
                raise NameInUse(_in_use(name, stored.value.instance, "is still leaving"))
            await sleep(min(wait, heartbeat / 4))
            now = await _member(store, stored.value.instance)
            if now is not None and now.revision != stored.revision and not now.value.leaving:
                raise NameInUse(_in_use(name, now.value.instance, "renews its member key"))
            stored = now
        if stored is None:
            continue  # it left meanwhile
        instance = stored.value.instance
        if await store.remove_member(instance, stored.revision):
            log.info(
                "removed the member key of %s, an earlier incarnation of %s: not renewed for "
                "%.1f s",
                instance,
                name,
                clock() - stored.value.renewed_at,
            )
            removed.append(instance)
        elif await _member(store, instance) is not None:
            raise NameInUse(_in_use(name, instance, "renewed its member key"))
    return removed


def _in_use(name: str, instance: str, what: str) -> str:
    return (
        f"another admission process runs under the name {name!r}: {instance} {what}; refusing "
        "to start (two instances under one name would decide the same shards)"
    )


async def _member(store: RoutingStore, instance: str) -> Stored[MemberValue] | None:
    return next((s for s in await store.members() if s.value.instance == instance), None)


async def drop_dead_quota(
    store: RoutingStore, instance: str, *, attempts: int = 20
) -> list[tuple[Quota, Stored[QuotaBook]]]:
    """Drop what is left of the dead `instance`'s entry (and its earmarks) from every quota
    book, one CAS per book; returns, per book changed, what it held and the book written.

    The caller knows `instance` is dead (it will never spend its entry again) and that its
    shards' adoptions have moved what they adopted. A transfer from it that lands later moves
    nothing (nothing is left to move) and its receiver takes in what its own quota covers: each
    count is in exactly one entry at every revision of the book, so none is spent twice."""
    from llmgw.state.store import Stored

    dropped: list[tuple[Quota, Stored[QuotaBook]]] = []
    for stored in await store.quota_books():
        current = stored
        for _ in range(attempts):
            book = current.value
            if instance not in book.holders and not any(
                e.source == instance for e in book.handing.values()
            ):
                break
            reduced = book.drop(instance)
            revision = await store.write_quota_book(reduced, current.revision)
            if revision is not None:
                dropped.append((book.quota(instance), Stored(reduced, revision)))
                break
            current = await store.quota_book(book.provider, book.model)
    return dropped
