"""Session affinity across engine replicas: consistent hashing with bounded loads.

Pure. A session's requests should reach the same replica, whose prefix cache holds the
conversation so far. Plain consistent hashing does that but lets one replica drown when its
sessions are busy; bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads", 2018) cap every replica at ``load_factor`` times the average:

- the ring holds ``virtual_nodes`` points per replica (scaled by its weight), hashed from its id;
- a session starts at the point after its own hash and walks clockwise to the first replica
  whose load, with this request added, stays within ceil(load_factor * (total load + 1) / n);
- so while its replica has room a session always lands there, and when it does not, the
  overflow moves to the next replica on the ring (the same one every time, so the spill keeps
  some affinity too). Adding or removing a replica moves only the sessions next to its points.

`load_factor` >= 1 (config ``scoring.session_load_factor``): 1 is perfect balance (and poor
affinity under skew), large values approach plain consistent hashing.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence

__all__ = ["HashRing", "bounded_load_choice"]

DEFAULT_VIRTUAL_NODES = 64


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Points of the replicas on a 64-bit ring; replicas keep their points whatever else changes."""

    def __init__(
        self,
        replicas: Mapping[str, float] | Sequence[str],
        *,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
    ) -> None:
        weights = dict(replicas) if isinstance(replicas, Mapping) else dict.fromkeys(replicas, 1.0)
        if not weights:
            raise ValueError("a ring needs at least one replica")
        top = max(weights.values())
        points = []
        for replica, weight in weights.items():
            if not weight > 0:
                raise ValueError(f"replica {replica!r} needs a weight > 0, got {weight}")
            count = max(1, round(virtual_nodes * weight / top))
            points += [(_point(f"{replica}#{i}"), replica) for i in range(count)]
        points.sort()
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]
        self.replicas = tuple(weights)

    def walk(self, key: str) -> list[str]:
        """Every replica once, in ring order starting after the key's point."""
        start = bisect.bisect_right(self._hashes, _point(key))
        seen: dict[str, None] = {}
        for i in range(len(self._owners)):
            seen.setdefault(self._owners[(start + i) % len(self._owners)], None)
            if len(seen) == len(self.replicas):
                break
        return list(seen)


def bounded_load_choice(
    ring: HashRing,
    key: str,
    loads: Mapping[str, int],
    load_factor: float,
    candidates: Sequence[str] | None = None,
) -> str | None:
    """The replica for ``key``: first on its walk with room under the bound; None if no candidate.

    ``loads``: requests each replica holds now (absent: 0). ``candidates``: the replicas that
    may take it (healthy ones); default all. The bound counts candidates only.
    """
    if load_factor < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    allowed = set(ring.replicas if candidates is None else candidates) & set(ring.replicas)
    if not allowed:
        return None
    total = sum(loads.get(r, 0) for r in allowed)
    bound = math.ceil(load_factor * (total + 1) / len(allowed))
    walk = [r for r in ring.walk(key) if r in allowed]
    for replica in walk:
        if loads.get(replica, 0) + 1 <= bound:
            return replica
    return walk[0]  # unreachable in practice: some replica is always at or below the average
