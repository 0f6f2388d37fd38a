"""vLLM's KV cache events, as a simulated engine publishes them (pure: no sockets, no clock).

vLLM started with ``--kv-events-config`` reports what its prefix cache holds
(``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``):

- ``BlockStored``: full prompt blocks of one request entered the cache. One event per request per
  engine step, covering the blocks that request registered in that step: one hash per block,
  ``parent_block_hash`` the hash of the block before the first one (None at a prompt's start),
  ``token_ids`` exactly those blocks' tokens;
- ``BlockRemoved``: one cached block was evicted (one event per block);
- ``AllBlocksCleared``: the prefix cache was reset.

An engine step's events travel together as one batch ``[ts, [event, ...], data_parallel_rank]``;
a step without events sends nothing (there is no heartbeat).

`KvEventRecorder` turns the engine model's cache changes into those events, one batch per
simulated instant. Its block hashes are what vLLM publishes, a uint64, and like vLLM's (salted
SHA-256) they cannot be computed from the tokens: a keyed BLAKE2b of the model's own block hash
under a random per-engine salt. A consumer has to map them from ``token_ids`` and the parent
links, as it must with vLLM. `wire_batch` gives a batch's msgpack-ready form in either encoding;
`ReplayRing` numbers batches and keeps the latest for replay, as vLLM's publisher does.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmgw.config.simulate import KvEventEncoding

__all__ = [
    "KV_EVENT_ENCODINGS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventEncoding",
    "KvEventRecorder",
    "ReplayRing",
    "wire_batch",
    "wire_event",
]

KV_EVENT_ENCODINGS: tuple[KvEventEncoding, ...] = ("map", "positional")

MEDIUM = "GPU"  # where the blocks live: the simulator models the GPU cache only
SPEC_KIND = "full_attention"  # the one KV cache group of a plain decoder


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventRecorder:
    """Collects one engine model's cache changes as vLLM events, one batch per step.

    A step is a simulated instant: the model reports changes in time order with their exact
    simulated time, and changes at the same time form one batch (vLLM's scheduler step).
    `take` hands over the batches recorded so far; the caller owns them from then on.
    """

    __slots__ = ("_batches", "_salt")

    def __init__(self, salt: bytes) -> None:
        self._salt = salt
        self._batches: list[tuple[float, list[KvEvent]]] = []

    def resalt(self, salt: bytes) -> None:
        """Hash with a new salt from now on: a restarted engine publishes other hashes."""
        self._salt = salt

    def engine_hash(self, block_hash: int) -> int:
        """The uint64 published for the model's `block_hash` (a signed 64-bit int)."""
        data = block_hash.to_bytes(8, "big", signed=True)
        digest = hashlib.blake2b(data, digest_size=8, key=self._salt).digest()
        return int.from_bytes(digest, "big")

    def stored(
        self,
        at: float,
        block_hashes: Sequence[int],
        indexes: Sequence[int],
        tokens: Sequence[int],
        block_size: int,
        lora_name: str | None,
    ) -> None:
        """A sequence registered its prompt blocks `indexes` (ascending) of its chain
        `block_hashes`, whose tokens are `tokens`: one event per run of consecutive blocks
        (a single run unless another sequence registered some of them first)."""
        runs: list[list[int]] = []
        for index in indexes:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            parent = None if first == 0 else self.engine_hash(block_hashes[first - 1])
            event = BlockStored(
                block_hashes=tuple(self.engine_hash(block_hashes[i]) for i in run),
                parent_block_hash=parent,
                token_ids=tuple(tokens[first * block_size : (last + 1) * block_size]),
                block_size=block_size,
                lora_name=lora_name,
            )
            self._add(at, event)

    def removed(self, at: float, block_hashes: Sequence[int]) -> None:
        """Cached blocks were evicted: one event per block, as vLLM sends them."""
        for block_hash in block_hashes:
            self._add(at, BlockRemoved((self.engine_hash(block_hash),)))

    def cleared(self, at: float) -> None:
        self._add(at, AllBlocksCleared())

    def take(self) -> list[list[KvEvent]]:
        """The batches recorded since the last call, oldest first (each non-empty)."""
        batches = [events for _, events in self._batches]
        self._batches = []
        return batches

    def _add(self, at: float, event: KvEvent) -> None:
        if self._batches and self._batches[-1][0] == at:
            self._batches[-1][1].append(event)
        else:
            self._batches.append((at, [event]))


def wire_event(event: KvEvent, encoding: KvEventEncoding) -> list[Any] | dict[str, Any]:
    """One event as vLLM's msgspec encodes it (``tag=True``: the tag is the class name).

    ``map`` (vLLM 0.26 and later): a map whose ``type`` is the tag; optional fields equal to
    their default are left out, as ``omit_defaults`` does, so ``kv_cache_spec_sliding_window``
    (None) is absent. ``positional`` (older vLLM, ``array_like=True``): an array with the tag
    first and every field in declaration order, defaults included.
    """
    if isinstance(event, BlockStored):
        extra = [lora] if (lora := event.lora_name) is not None else None
        fields: dict[str, Any] = {
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,  # deprecated in vLLM in favour of lora_name
            "medium": MEDIUM,
            "lora_name": event.lora_name,
            # The extra keys of each block's hash: the adapter's name, or none.
            "extra_keys": [extra] * len(event.block_hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": SPEC_KIND,
        }
        if encoding == "positional":
            return ["BlockStored", *fields.values(), None]  # kv_cache_spec_sliding_window
        return {"type": "BlockStored", **fields}
    if isinstance(event, BlockRemoved):
        if encoding == "positional":
            return ["BlockRemoved", list(event.block_hashes), MEDIUM, 0]
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": MEDIUM,
            "group_idx": 0,
        }
    return ["AllBlocksCleared"] if encoding == "positional" else {"type": "AllBlocksCleared"}


def wire_batch(
    ts: float, events: Sequence[KvEvent], encoding: KvEventEncoding, data_parallel_rank: int = 0
) -> list[Any]:
    """A batch as vLLM's ``KVEventBatch`` (``array_like``: positional in every version):
    ``[ts, [event, ...], data_parallel_rank]``. vLLM's publisher fills in its data-parallel
    rank, 0 for an engine without data parallelism."""
    return [ts, [wire_event(event, encoding) for event in events], data_parallel_rank]


class ReplayRing:
    """Sequence numbers and the replay buffer of one publisher (vLLM's ``_seq_gen`` and
    ``_buffer``): batches are numbered from 0 and the last `capacity` kept are replayable."""

    __slots__ = ("_ring", "next_seq")

    def __init__(self, capacity: int) -> None:
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self.next_seq = 0

    def number(self) -> int:
        """The next batch's sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def keep(self, seq: int, payload: bytes) -> None:
        """Keep a batch for replay (callers keep batches in sequence order)."""
        self._ring.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The kept batches numbered `start` or later; from the oldest kept when `start` is
        older than the ring (no error: the consumer sees the gap in the numbers)."""
        return [(seq, payload) for seq, payload in self._ring if seq >= start]

    def restart(self) -> None:
        """An engine restart: numbering starts again at 0 and nothing is replayable."""
        self._ring.clear()
        self.next_seq = 0
