"""A paged KV cache with prefix caching, as vLLM's block manager does it (pure, no I/O).

The cache holds ``num_blocks`` blocks of ``block_size`` tokens. A block is in one of five states:

- *free*: holds nothing;
- *private*: in use by exactly one sequence and not shareable (partial prompt blocks, output
  blocks, and prompt blocks whose hash another block already registered);
- *cached in use*: a full prompt block registered under its chain hash, refcount >= 1;
- *cached idle*: a registered block whose sequences all finished (refcount 0). It still serves
  prefix hits and is evicted least-recently-released first when a free block is needed;
- *detached*: was cached in use when the prefix cache was cleared (`clear`); it no longer hits
  and is freed when its last holder releases it.

Sequences also hold *reservations*: blocks promised for output tokens not generated yet. Admission
counts them, so a running sequence can always grow and the simulator never needs preemption.

Invariant (checked by `check_invariants`): free + private + registered + detached == num_blocks
and reserved <= free + cached idle.

The transitions that take a block (`admit`, `grow`) return the hashes they evicted, so a caller
can report them (vLLM's ``BlockRemoved`` KV cache events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KVCache"]

_DETACHED_BASE = 1 << 64  # detached keys start above every signed 64-bit hash


class KVCache:
    """Block accounting for one engine; callers keep the per-sequence bookkeeping."""

    __slots__ = (
        "_detached",
        "_idle",
        "_next_detached",
        "_refcount",
        "block_size",
        "free",
        "num_blocks",
        "private",
        "reserved",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks
        self.private = 0
        self.reserved = 0
        self._refcount: dict[int, int] = {}  # every registered block hash -> refcount
        self._idle: OrderedDict[int, None] = OrderedDict()  # refcount-0 hashes, eviction order
        self._detached: dict[int, int] = {}  # detached key -> refcount
        self._next_detached = _DETACHED_BASE

    # -- queries ---------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        """Registered blocks (in use or idle)."""
        return len(self._refcount)

    @property
    def idle_blocks(self) -> int:
        return len(self._idle)

    @property
    def used_blocks(self) -> int:
        """Blocks holding tokens of running sequences (what vLLM reports as usage)."""
        return self.private + len(self._refcount) - len(self._idle) + len(self._detached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running sequences, 0..1."""
        return self.used_blocks / self.num_blocks

    def available(self) -> int:
        """Blocks a new sequence could still claim (free or evictable, minus reservations)."""
        return self.free + len(self._idle) - self.reserved

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading block hashes are registered (a prefix-cache hit of that many blocks)."""
        hits = 0
        for block_hash in hashes:
            if block_hash not in self._refcount:
                break
            hits += 1
        return hits

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._refcount

    def can_admit(self, hit_hashes: Sequence[int], new_blocks: int) -> bool:
        """Whether a sequence reusing `hit_hashes` and needing `new_blocks` more blocks fits.

        Idle hit blocks stop being evictable once reused, so they don't count as available.
        """
        idle_hits = sum(1 for block_hash in hit_hashes if block_hash in self._idle)
        return self.available() - idle_hits >= new_blocks

    # -- transitions -----------------------------------------------------------------------
    def admit(
        self, hit_hashes: Sequence[int], prompt_blocks: int, reserve_blocks: int
    ) -> list[int]:
        """Take references on `hit_hashes`, allocate `prompt_blocks` private blocks, reserve more;
        the hashes evicted to make room, in eviction order.

        The caller checked `can_admit` for ``prompt_blocks + reserve_blocks``.
        """
        for block_hash in hit_hashes:
            self._ref(block_hash)
        evicted = []
        for _ in range(prompt_blocks):
            gone = self._allocate()
            if gone is not None:
                evicted.append(gone)
        self.reserved += reserve_blocks
        return evicted

    def grow(self) -> int | None:
        """Turn one of a sequence's reservations into a private block (a new output block); the
        hash evicted to make room, if any."""
        self.reserved -= 1
        return self._allocate()

    def register(self, block_hash: int) -> bool:
        """Publish one of the caller's private full prompt blocks under `block_hash`.

        Returns False (the block stays private) when that hash is already registered, e.g. two
        identical prompts prefilled at the same time.
        """
        if block_hash in self._refcount:
            return False
        self.private -= 1
        self._refcount[block_hash] = 1
        return True

    def release(self, held_hashes: Sequence[int], private_blocks: int, reserved: int) -> None:
        """A sequence ended: drop its references, free its private blocks and reservations.

        Hashes are released tail first so that, among one prompt's blocks, the last ones are
        evicted first and the shared head of the chain survives longest (vLLM does the same).
        `held_hashes` may hold detached keys (from `clear`) too.
        """
        for block_hash in reversed(held_hashes):
            if block_hash in self._detached:
                self._unref_detached(block_hash)
                continue
            count = self._refcount[block_hash] - 1
            self._refcount[block_hash] = count
            if count == 0:
                self._idle[block_hash] = None
        self.private -= private_blocks
        self.free += private_blocks
        self.reserved -= reserved

    def clear(self) -> dict[int, int]:
        """Forget every registered hash (vLLM's prefix-cache reset): nothing hits any more.

        Idle blocks become free. Blocks in use stay with their sequences as detached blocks;
        returns each such hash's detached key, which its holders must release instead of the
        hash. Keys are at least 2**64, so they never equal a hash (a signed 64-bit int).
        """
        keys: dict[int, int] = {}
        for block_hash, count in self._refcount.items():
            if count > 0:
                keys[block_hash] = self._next_detached
                self._detached[self._next_detached] = count
                self._next_detached += 1
        self.free += len(self._idle)
        self._refcount.clear()
        self._idle.clear()
        return keys

    def check_invariants(self) -> None:
        """Raise AssertionError when the accounting is inconsistent (used by tests)."""
        assert self.free >= 0 and self.private >= 0 and self.reserved >= 0
        registered = len(self._refcount) + len(self._detached)
        assert self.free + self.private + registered == self.num_blocks
        assert self.reserved <= self.free + len(self._idle)
        assert all((count == 0) == (h in self._idle) for h, count in self._refcount.items())
        assert all(count > 0 for count in self._detached.values())

    # -- internals -------------------------------------------------------------------------
    def _ref(self, block_hash: int) -> None:
        count = self._refcount[block_hash]
        if count == 0:
            del self._idle[block_hash]
        self._refcount[block_hash] = count + 1

    def _unref_detached(self, key: int) -> None:
        count = self._detached[key] - 1
        if count:
            self._detached[key] = count
        else:
            del self._detached[key]
            self.free += 1

    def _allocate(self) -> int | None:
        """Take a free block, else evict one; the evicted hash, if any."""
        self.private += 1
        if self.free > 0:
            self.free -= 1
            return None
        # Evict the least recently released idle block; its hash no longer hits.
        block_hash, _ = self._idle.popitem(last=False)
        del self._refcount[block_hash]
        return block_hash
