"""Session shards and who owns them: the pure rules behind session-sharded admission.

Every request belongs to one of ``shards`` shards (config ``admission.shards``, the same in every
service of a gateway): a request of a session to the shard its session id hashes to, a request
without a session to any shard (the edge picks one at random, which spreads them). Exactly one
admission instance *owns* a shard at a time; it alone decides the shard's requests, keeps the
shard's pins and leases in memory and writes pins to the routing bucket. Ownership is a key per
shard in that bucket (compare-and-swap), and a member key per instance says it is alive.

Which instance should own a shard is rendezvous (highest random weight) hashing over the live
members: every instance computes the same answer from the same member list, a member that joins
takes about 1/n of the shards from the others, and one that leaves gives its shards to the
others without moving any other shard.

The lifecycle of one shard at one instance (`ShardPhase`, `ShardStep`, `SHARD_TRANSITIONS`:
docs/adr/0002-admission-at-memory-speed.md, "Shard lifecycle") is a small state machine: its
adapter (`llmgw.services.admission.shards`) keeps one record per shard and moves it only
through `next_phase`, which refuses an illegal step (a bug).

Pure: no clock, no I/O. Callers pass ``now`` (unix seconds, the same domain as the member keys'
``renewed_at``).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "SHARD_TRANSITIONS",
    "IllegalShardStep",
    "Member",
    "ShardPhase",
    "ShardPlan",
    "ShardStep",
    "desired_owner",
    "live_members",
    "next_phase",
    "plan_shards",
    "shard_of",
]


def shard_of(session: str, shards: int) -> int:
    """The shard of a session id (a hex digest, llmgw.core.sessions): its first 8 hex digits
    modulo ``shards``. Any other text is hashed first, so every string has a shard."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    try:
        value = int(session[:8], 16)
    except ValueError:
        value = int.from_bytes(hashlib.blake2b(session.encode(), digest_size=4).digest(), "big")
    return value % shards


def _weight(shard: int, member: str) -> bytes:
    return hashlib.blake2b(f"{shard}/{member}".encode(), digest_size=8).digest()


def desired_owner(shard: int, members: Iterable[str]) -> str | None:
    """The live member that should own `shard` (rendezvous hashing); None if there is none."""
    best: tuple[bytes, str] | None = None
    for member in members:
        candidate = (_weight(shard, member), member)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else best[1]


@dataclass(frozen=True, slots=True)
class Member:
    """An admission instance as its member key shows it (`leaving`: stopping, take nothing)."""

    instance: str
    renewed_at: float
    joined_at: float
    leaving: bool = False

    def alive(self, now: float, ttl: float) -> bool:
        """Renewed within ``ttl`` of ``now`` (a member that stopped renewing is dead)."""
        return now < self.renewed_at + ttl


def live_members(members: Iterable[Member], now: float, ttl: float) -> dict[str, Member]:
    return {m.instance: m for m in members if m.alive(now, ttl)}


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What one instance should do with shard ownership now.

    ``claim``: shards it should own that nobody live owns (take them by CAS); ``release``:
    shards it owns that a settled live member should own instead (hand them over), at most the
    caller's per-round limit, lowest first.
    """

    claim: tuple[int, ...]
    release: tuple[tuple[int, str], ...]  # (shard, the member to hand it to)


def plan_shards(
    me: str,
    shards: int,
    owners: Mapping[int, str | None],
    members: Mapping[str, Member],
    now: float,
    *,
    settle: float,
    max_release: int,
    stopping: Collection[str] = (),
) -> ShardPlan:
    """Claims and handovers for `me`, given current owners (shard -> instance or None) and the
    *live* members (`live_members`).

    A member counts for the desired assignment once it has been a member for ``settle`` seconds
    (so a starting instance is not handed shards before it is ready, and a flapping one does not
    move shards back and forth); `me` always counts for itself. Members in `stopping`, or whose
    key says `leaving` (stopping gracefully), count for nobody. A shard whose owner is not live is free to claim.
    Guarantees: a shard is never both claimed and released; claims are shards whose desired
    owner is `me`; releases go to the shard's desired owner, never to `me`.
    """
    eligible = sorted(
        m
        for m, member in members.items()
        if m not in stopping
        and not member.leaving
        and (m == me or now - member.joined_at >= settle)
    )
    if me not in eligible and me not in stopping:
        eligible.append(me)
    claim: list[int] = []
    release: list[tuple[int, str]] = []
    for shard in range(shards):
        wanted = desired_owner(shard, eligible)
        owner = owners.get(shard)
        owner_live = owner is not None and owner in members
        if wanted == me and not owner_live:
            claim.append(shard)
        elif owner == me and wanted is not None and wanted != me and len(release) < max_release:
            release.append((shard, wanted))
    return ShardPlan(tuple(claim), tuple(release))


# ---- one shard's lifecycle at one instance -------------------------------------------------


class ShardPhase(enum.StrEnum):
    """Where a shard is at this instance (its ledger, its subscriptions, its quota)."""

    GONE = "gone"  # not this instance's: no record, nothing of it here
    CLAIMING = "claiming"  # its key names this instance; a live giver's handover is awaited
    RECEIVING = "receiving"  # being taken in: a handover's state, or an adoption (roll call)
    SERVING = "serving"  # in the ledger and subscribed: this instance decides its requests
    LEAVING = "leaving"  # drained: being handed over, released or dropped


class ShardStep(enum.StrEnum):
    """What happens to a shard at this instance."""

    CLAIM = "claim"  # its key names this instance (a claim by CAS, or a handover written to it)
    RECEIVE = "receive"  # a handover's message arrives, or an adoption starts
    SERVE = "serve"  # taken in (leases and pins in the ledger, quota spendable) and subscribed
    ABANDON = "abandon"  # taking it in failed, or a claim ends without taking it in
    LEAVE = "leave"  # stops serving: subscriptions drained, queued requests answered moved
    END = "end"  # out of the ledger and done: handed over, released or dropped


class IllegalShardStep(RuntimeError):
    """A step the lifecycle does not allow from the shard's phase: a bug in its caller."""


SHARD_TRANSITIONS: Mapping[tuple[ShardPhase, ShardStep], ShardPhase] = {
    (ShardPhase.GONE, ShardStep.CLAIM): ShardPhase.CLAIMING,
    (ShardPhase.GONE, ShardStep.RECEIVE): ShardPhase.RECEIVING,  # a handover before the claim
    (ShardPhase.CLAIMING, ShardStep.RECEIVE): ShardPhase.RECEIVING,
    (ShardPhase.CLAIMING, ShardStep.ABANDON): ShardPhase.GONE,
    (ShardPhase.RECEIVING, ShardStep.SERVE): ShardPhase.SERVING,
    (ShardPhase.RECEIVING, ShardStep.ABANDON): ShardPhase.GONE,
    # Handed a shard while stopping: taken in, then released at once (never subscribed).
    (ShardPhase.RECEIVING, ShardStep.LEAVE): ShardPhase.LEAVING,
    (ShardPhase.SERVING, ShardStep.LEAVE): ShardPhase.LEAVING,
    # Dropped while being handed over (the instance lost its key and joins again).
    (ShardPhase.LEAVING, ShardStep.LEAVE): ShardPhase.LEAVING,
    (ShardPhase.LEAVING, ShardStep.END): ShardPhase.GONE,
}


def next_phase(phase: ShardPhase, step: ShardStep) -> ShardPhase:
    """The phase after `step`; raises IllegalShardStep if `step` is not allowed from `phase`."""
    try:
        return SHARD_TRANSITIONS[(phase, step)]
    except KeyError:
        raise IllegalShardStep(f"a shard {phase} cannot {step}") from None
