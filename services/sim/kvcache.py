"""A paged KV cache with prefix caching, as vLLM's block manager does it (pure, no I/O).

The cache holds ``num_blocks`` blocks of ``block_size`` tokens. A block is in one of four states:

- *free*: holds nothing;
- *private*: in use by exactly one sequence and not shareable (partial prompt blocks, output
  blocks, and prompt blocks whose hash another block already registered);
- *cached in use*: a full prompt block registered under its chain hash, refcount >= 1;
- *cached idle*: a registered block whose sequences all finished (refcount 0). It still serves
  prefix hits and is evicted least-recently-released first when a free block is needed.

Sequences also hold *reservations*: blocks promised for output tokens not generated yet. Admission
counts them, so a running sequence can always grow and the simulator never needs preemption.

Invariant (checked by `check_invariants`): free + private + registered == num_blocks and
reserved <= free + cached idle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KVCache"]


class KVCache:
    """Block accounting for one engine; callers keep the per-sequence bookkeeping."""

    __slots__ = ("_idle", "_refcount", "block_size", "free", "num_blocks", "private", "reserved")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks
        self.private = 0
        self.reserved = 0
        self._refcount: dict[int, int] = {}  # every registered block hash -> refcount
        self._idle: OrderedDict[int, None] = OrderedDict()  # refcount-0 hashes, eviction order

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
        return self.private + len(self._refcount) - len(self._idle)

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
    def admit(self, hit_hashes: Sequence[int], prompt_blocks: int, reserve_blocks: int) -> None:
        """Take references on `hit_hashes`, allocate `prompt_blocks` private blocks, reserve more.

        The caller checked `can_admit` for ``prompt_blocks + reserve_blocks``.
        """
        for block_hash in hit_hashes:
            self._ref(block_hash)
        for _ in range(prompt_blocks):
            self._allocate()
        self.reserved += reserve_blocks

    def grow(self) -> None:
        """Turn one of a sequence's reservations into a private block (a new output block)."""
        self.reserved -= 1
        self._allocate()

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
        """
        for block_hash in reversed(held_hashes):
            count = self._refcount[block_hash] - 1
            self._refcount[block_hash] = count
            if count == 0:
                self._idle[block_hash] = None
        self.private -= private_blocks
        self.free += private_blocks
        self.reserved -= reserved

    def check_invariants(self) -> None:
        """Raise AssertionError when the accounting is inconsistent (used by tests)."""
        assert self.free >= 0 and self.private >= 0 and self.reserved >= 0
        assert self.free + self.private + len(self._refcount) == self.num_blocks
        assert self.reserved <= self.free + len(self._idle)
        assert all((count == 0) == (h in self._idle) for h, count in self._refcount.items())

    # -- internals -------------------------------------------------------------------------
    def _ref(self, block_hash: int) -> None:
        count = self._refcount[block_hash]
        if count == 0:
            del self._idle[block_hash]
        self._refcount[block_hash] = count + 1

    def _allocate(self) -> None:
        if self.free > 0:
            self.free -= 1
        else:
            # Evict the least recently released idle block; its hash no longer hits.
            block_hash, _ = self._idle.popitem(last=False)
            del self._refcount[block_hash]
        self.private += 1
