"""The live fleet's decisions: which endpoints take new work, what an operator may change, when.

An endpoint of the live fleet is in one of two states:

- ``active``: placement may send it new work;
- ``draining``: no new work; requests already on it run to their end (their leases are never
  revoked) and a session whose home replica it is moves on its next request. It is removed
  once no lease is left on it (or by force).

Every function here is pure: the caller passes what it read (the fleet's records, the leases
counted by the admission instances, `now`) and acts on the answer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "EndpointState",
    "FleetView",
    "HeartbeatVerdict",
    "RemoveVerdict",
    "heartbeat_verdict",
    "placeable",
    "remove_verdict",
    "seed_missing",
]


class EndpointState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the fleet holds, as placement needs it: every endpoint id with its state."""

    states: Mapping[str, EndpointState]
    revision: int = 0

    @property
    def draining(self) -> frozenset[str]:
        return frozenset(e for e, s in self.states.items() if s is EndpointState.DRAINING)


def placeable(view: FleetView, endpoint_ids: Iterable[str]) -> list[str]:
    """The endpoints, in the given order, that may take new work: active ones only."""
    return [e for e in endpoint_ids if view.states.get(e) is EndpointState.ACTIVE]


class RemoveVerdict(enum.StrEnum):
    REMOVE = "remove"  # draining and no lease left (or forced)
    NOT_DRAINING = "not_draining"  # drain it first: removing an active endpoint cuts its work
    LEASES_LEFT = "leases_left"  # still running requests: wait, or force
    UNKNOWN = "unknown"  # no such endpoint


def remove_verdict(
    state: EndpointState | None, leases: int, *, force: bool = False
) -> RemoveVerdict:
    """Whether an endpoint may be removed now. A forced removal skips the wait, never the
    accounting: leases on a removed endpoint still end and are released by id."""
    if state is None:
        return RemoveVerdict.UNKNOWN
    if force:
        return RemoveVerdict.REMOVE
    if state is not EndpointState.DRAINING:
        return RemoveVerdict.NOT_DRAINING
    if leases > 0:
        return RemoveVerdict.LEASES_LEFT
    return RemoveVerdict.REMOVE


def seed_missing(configured: Iterable[str], live: Iterable[str]) -> list[str]:
    """The configured endpoint ids the fleet lacks, in the configured order (a seeding writes
    them; the fleet's own records win for the others)."""
    present = set(live)
    return [e for e in configured if e not in present]


class HeartbeatVerdict(enum.StrEnum):
    KEEP = "keep"
    DRAIN = "drain"  # silent for its ttl: no new work, what runs on it ends
    REMOVE = "remove"  # silent for twice its ttl, drained, no lease left


def heartbeat_verdict(
    state: EndpointState, heartbeat_at: float, ttl: float, now: float, leases: int | None
) -> HeartbeatVerdict:
    """What becomes of a self-registered endpoint that heartbeats every so often: drained once
    silent for `ttl`, removed once silent for 2 x `ttl` with no lease left (`leases` None: no
    admission instance answered, so nothing is removed). A heartbeat after a drain by silence
    does not undrain it: the registrant registers again."""
    silent = now - heartbeat_at
    if silent <= ttl:
        return HeartbeatVerdict.KEEP
    if state is EndpointState.ACTIVE:
        return HeartbeatVerdict.DRAIN
    if silent > 2 * ttl and leases == 0:
        return HeartbeatVerdict.REMOVE
    return HeartbeatVerdict.KEEP
