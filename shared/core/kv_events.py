"""vLLM's KV cache events, read and turned into what each endpoint's prefix cache holds as our
token chains. Pure: no I/O, no clock.

An engine publishes batches of events on a ZMQ PUB socket, three frames each: its topic, an
8-byte big-endian sequence number (per batch, from 0 at each start of the engine) and a
msgpack payload. Three steps turn them into `HeldUpdate`s (published as
`llmgw.wire.PrefixHeld`):

- `decode_batch`: the payload as a `KvBatch`, in either encoding vLLM has shipped (events as
  positional arrays tagged by their first element, or as maps tagged ``"type"``; the batch as
  a 2- or 3-element array or a map). Unknown fields are ignored and events of an unknown type
  left out (counted); anything else unexpected raises `KvEventsError`, the one error here.
- `KvTranslator`: the engine's block hashes (its own, unrelated to ours) mapped to our token
  chain hashes (`llmgw.core.prefix.token_chain`): a stored block's hash continues the chain of
  its parent, so the parent must be known; a block stored with a parent never seen (its event
  was lost, or came before we listened) is left out, as are the blocks that follow from it.
  What the engine holds twice is counted twice; our hash is removed when the last copy goes.
- `KvSync`: the sequence numbers. A batch that follows the last one is applied; one past it is
  a gap (a replay of the missing batches fills it, or it cannot be filled and what the engine
  holds is unknown: cleared); one before it means the engine restarted (cleared).

Invariant: what the updates add up to is always a subset of what the engine holds (as far as
the events said): a lost event either leaves blocks out or clears; it never keeps a block the
engine no longer holds. Ownership: one `KvSync` per endpoint, used by one task.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.core.prefix import token_chain, token_root

__all__ = [
    "END_SEQ",
    "FULL_ATTENTION",
    "AllBlocksCleared",
    "BatchResult",
    "BlockRemoved",
    "BlockStored",
    "Dropped",
    "HeldUpdate",
    "KvBatch",
    "KvEvent",
    "KvEventsError",
    "KvSync",
    "KvTranslator",
    "Received",
    "ReplayResult",
    "decode_batch",
    "decode_seq",
]

END_SEQ = -1  # a replay's end marker (8 bytes of 0xFF)
_U64 = 2**64 - 1
_TOKEN_LIMIT = 2**32  # token ids travel as 4 bytes each in our chains
# The kinds of KV cache whose blocks are a prompt's prefix (a sliding window's or a state
# space model's are not).
FULL_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
GPU = "GPU"

# Positional field order of each event after its tag (vLLM appended fields over time, so an
# older engine sends a shorter array).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_STORED_REQUIRED = 4  # block_hashes .. block_size: in every version
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED = 1


class KvEventsError(ValueError):
    """A KV events payload (or frame) that is not what vLLM sends; the message says what was
    wrong. The batch is unusable: the caller counts it and goes on with the next one."""


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine computed and cached: `block_hashes[i]` holds tokens
    ``token_ids[i*block_size:(i+1)*block_size]``, the first continuing `parent` (None: the
    start of a prompt, of `lora_name`'s adapter when set)."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None
    spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One published batch: the engine's wall clock at publishing (`ts`), its data parallel
    rank, its events in order, and how many events of unknown types were left out."""

    ts: float
    dp_rank: int | None
    events: tuple[KvEvent, ...]
    unknown: int = 0


# -- decoding --------------------------------------------------------------------------------


def decode_seq(frame: bytes) -> int:
    """A sequence number frame: 8 bytes, big-endian (`END_SEQ` ends a replay)."""
    if len(frame) != 8:
        raise KvEventsError(f"a sequence number has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> KvBatch:
    """`payload` (msgpack) as a batch; `KvEventsError` says what is wrong with a bad one."""
    # Imported here: msgpack comes with the kv-events extra, and this module's enums are
    # the scraper's metric labels whether it is installed or not.
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack's own errors, bad UTF-8, a truncated payload...
        raise KvEventsError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
    else:
        raise KvEventsError(f"a batch is [ts, events, dp_rank] or a map, got {_shape(raw)}")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise KvEventsError(f"ts: expected a time, got {ts!r:.40}")
    if not isinstance(events, list):
        raise KvEventsError(f"events: expected a list, got {_shape(events)}")
    decoded: list[KvEvent] = []
    unknown = 0
    for index, event in enumerate(events):
        one = _event(event, index)
        if one is None:
            unknown += 1
        else:
            decoded.append(one)
    return KvBatch(float(ts), _optional_int(rank, "data_parallel_rank"), tuple(decoded), unknown)


def _event(raw: Any, index: int) -> KvEvent | None:
    """One event (None: a type this decoder does not know)."""
    where = f"events[{index}]"
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields: Mapping[Any, Any] = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventsError(f"{where}: expected a tagged array or map, got {_shape(raw)}")
    if not isinstance(tag, str):
        raise KvEventsError(f"{where}: no event type (got {_shape(tag)})")
    if tag == "BlockStored":
        _require(fields, _STORED_FIELDS[:_STORED_REQUIRED], where)
        parent = fields["parent_block_hash"]
        block_size = fields["block_size"]
        if type(block_size) is not int or block_size < 1:
            raise KvEventsError(f"{where}.block_size: expected an int >= 1, got {block_size!r}")
        return BlockStored(
            block_hashes=_hashes(fields["block_hashes"], f"{where}.block_hashes"),
            parent=None if parent is None else _hash(parent, f"{where}.parent_block_hash"),
            token_ids=_tokens(fields["token_ids"], f"{where}.token_ids"),
            block_size=block_size,
            lora_name=_optional_str(fields.get("lora_name"), f"{where}.lora_name"),
            medium=_optional_str(fields.get("medium"), f"{where}.medium"),
            group_idx=_optional_int(fields.get("group_idx"), f"{where}.group_idx"),
            spec_kind=_optional_str(
                fields.get("kv_cache_spec_kind"), f"{where}.kv_cache_spec_kind"
            ),
        )
    if tag == "BlockRemoved":
        _require(fields, _REMOVED_FIELDS[:_REMOVED_REQUIRED], where)
        return BlockRemoved(
            block_hashes=_hashes(fields["block_hashes"], f"{where}.block_hashes"),
            medium=_optional_str(fields.get("medium"), f"{where}.medium"),
            group_idx=_optional_int(fields.get("group_idx"), f"{where}.group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _require(fields: Mapping[Any, Any], names: Iterable[str], where: str) -> None:
    missing = [name for name in names if name not in fields]
    if missing:
        raise KvEventsError(f"{where}: missing {', '.join(missing)}")


def _hash(value: Any, where: str) -> int:
    """An engine's block hash as 64 bits: an int (negative from older vLLM: its two's
    complement) or a digest (its last 8 bytes, big-endian, as vLLM's int form takes them)."""
    if type(value) is int:
        return value & _U64
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise KvEventsError(f"{where}: expected an int or bytes block hash, got {_shape(value)}")


def _hashes(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventsError(f"{where}: expected a list, got {_shape(value)}")
    return tuple(_hash(item, f"{where}[{i}]") for i, item in enumerate(value))


def _tokens(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventsError(f"{where}: expected a list, got {_shape(value)}")
    for i, token in enumerate(value):
        if type(token) is not int or not 0 <= token < _TOKEN_LIMIT:
            raise KvEventsError(f"{where}[{i}]: expected a token id, got {token!r:.40}")
    return tuple(value)


def _optional_str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventsError(f"{where}: expected a string or null, got {_shape(value)}")


def _optional_int(value: Any, where: str) -> int | None:
    if value is None or type(value) is int:
        return value
    raise KvEventsError(f"{where}: expected an int or null, got {_shape(value)}")


def _shape(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    return type(value).__name__


# -- what an endpoint holds ------------------------------------------------------------------


@dataclass(slots=True)
class HeldUpdate:
    """What changed in an endpoint's cache, in our hashes: `cleared` first (forget all it
    held), then `stored`, then `removed` (`llmgw.wire.PrefixHeld`). Applying stores before
    removes is exact for reference-counted holders: a block removed then stored again within
    one update ends held once either way. `block_size`: the engine's KV block in tokens, when
    known. `emptied`: the engine's own cache was emptied (AllBlocksCleared, or it restarted),
    not only our knowledge of it: what was sent there is gone too."""

    cleared: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    block_size: int | None = None
    emptied: bool = False

    def __bool__(self) -> bool:
        return self.cleared or bool(self.stored) or bool(self.removed)

    def __len__(self) -> int:
        return len(self.stored) + len(self.removed)

    def then(self, later: HeldUpdate) -> None:
        """Append `later` (a later update of the same endpoint) to this one."""
        if later.cleared:
            self.cleared = True
            self.stored = list(later.stored)
            self.removed = list(later.removed)
        else:
            self.stored += later.stored
            self.removed += later.removed
        if later.block_size is not None:
            self.block_size = later.block_size
        self.emptied = self.emptied or later.emptied

    def split(self, most: int) -> list[HeldUpdate]:
        """This update as consecutive updates of at most `most` hashes each (the first one
        carries `cleared`); in order, they mean the same."""
        if most < 1:
            raise ValueError("an update holds at least one hash")
        parts = [HeldUpdate(self.cleared, block_size=self.block_size, emptied=self.emptied)]
        for name in ("stored", "removed"):
            hashes: list[int] = getattr(self, name)
            start = 0
            while start < len(hashes):
                part = parts[-1]
                if len(part) >= most:
                    part = HeldUpdate(block_size=self.block_size)
                    parts.append(part)
                take = hashes[start : start + most - len(part)]
                getattr(part, name).extend(take)
                start += len(take)
        return parts


class Dropped(enum.Enum):
    """Why an event was left out (a metrics label)."""

    UNKNOWN_TYPE = "unknown_type"  # an event type this decoder does not know
    MEDIUM = "medium"  # a block kept off the GPU (CPU, disk: a connector's offload)
    GROUP = "group"  # a KV cache group other than the first (hybrid models)
    SPEC_KIND = "spec_kind"  # a cache that is not full attention (a sliding window...)
    UNKNOWN_PARENT = "unknown_parent"  # stored after a block never seen: its chain is unknown


@dataclass(slots=True)
class _Block:
    ours: int
    copies: int


class KvTranslator:
    """One endpoint's engine block hashes -> our token chain hashes, each with a count of the
    copies the engine holds. A store of a block already held adds a copy (vLLM does not
    de-duplicate); our hash is stored at the first copy and removed with the last one."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        self.block_size: int | None = None  # the last one an event said

    def __len__(self) -> int:
        return len(self._blocks)

    def held(self) -> list[int]:
        """Our hash of every block held, once per engine block (a `HeldIndex`'s counts)."""
        return [block.ours for block in self._blocks.values()]

    def clear(self) -> None:
        self._blocks.clear()

    def apply(self, batch: KvBatch, dropped: Counter[Dropped]) -> HeldUpdate:
        """The update `batch`'s events make; events left out are counted in `dropped`."""
        update = HeldUpdate()
        if batch.unknown:
            dropped[Dropped.UNKNOWN_TYPE] += batch.unknown
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._blocks.clear()
                update = HeldUpdate(cleared=True, emptied=True)
                continue
            reason = _skip(event)
            if reason is not None:
                dropped[reason] += 1
            elif isinstance(event, BlockStored):
                if not self._store(event, update):
                    dropped[Dropped.UNKNOWN_PARENT] += 1
            else:
                self._remove(event, update)
        update.block_size = self.block_size
        return update

    def _store(self, event: BlockStored, update: HeldUpdate) -> bool:
        if event.parent is None:
            parent = token_root(event.lora_name)
        else:
            known = self._blocks.get(event.parent)
            if known is None:
                return False
            parent = known.ours
        self.block_size = event.block_size
        chain = token_chain(event.token_ids, event.block_size, parent=parent)
        for engine, ours in zip(event.block_hashes, chain, strict=False):
            block = self._blocks.get(engine)
            if block is None:
                self._blocks[engine] = _Block(ours, 1)
                update.stored.append(ours)
            else:
                block.copies += 1
        return True

    def _remove(self, event: BlockRemoved, update: HeldUpdate) -> None:
        for engine in event.block_hashes:
            block = self._blocks.get(engine)
            if block is None:  # stored before we listened, or left out: nothing of ours
                continue
            block.copies -= 1
            if block.copies == 0:
                del self._blocks[engine]
                update.removed.append(block.ours)


def _skip(event: BlockStored | BlockRemoved) -> Dropped | None:
    if event.medium not in (None, GPU):
        return Dropped.MEDIUM
    if event.group_idx not in (None, 0):
        return Dropped.GROUP
    if isinstance(event, BlockStored) and event.spec_kind not in (None, *FULL_ATTENTION):
        return Dropped.SPEC_KIND
    return None


# -- sequence numbers ------------------------------------------------------------------------


class BatchResult(enum.Enum):
    """What became of one batch read from an engine's socket (a metrics label)."""

    APPLIED = "applied"  # the next one in sequence
    JOINED = "joined"  # the first since we (re)connected: what came before is replayed or lost
    GAP_FILLED = "gap_filled"  # batches were missed; a replay brought them, then this one
    GAP_LOST = "gap_lost"  # batches were missed for good: cleared, then this one
    RESTARTED = "restarted"  # the sequence went back: the engine restarted; cleared
    MALFORMED = "malformed"  # unreadable: left out (the batches after it see a gap)
    OTHER_TOPIC = "other_topic"  # another publisher's topic that shares our topic's prefix


class ReplayResult(enum.Enum):
    """What became of one replay asked of an engine (a metrics label)."""

    FILLED = "filled"  # it brought every missed batch
    LOST = "lost"  # it answered without all of them (older than its buffer, or unreadable)
    FAILED = "failed"  # no answer in time, or one that is not a replay's

    @classmethod
    def of(cls, filled: bool | None) -> ReplayResult:
        """The result of a replay that answered, by `Received.filled`."""
        return cls.FILLED if filled else cls.LOST


@dataclass(frozen=True, slots=True)
class Received:
    """A live batch's outcome: its result, the update to publish (None: nothing changed),
    events left out by reason, and whether the replay it needed filled its gap (None: none
    was needed)."""

    result: BatchResult
    update: HeldUpdate | None
    dropped: Counter[Dropped]
    filled: bool | None = None


class KvSync:
    """One endpoint's batches in order, translated (see the module docstring).

    Use: `gap(seq)` says whether a replay is needed before the live batch `seq` (and from
    where); `receive(seq, batch, replayed)` then applies what the replay returned and the
    batch. `reset()` after losing the publisher's connection. The first batch after a start
    or reset starts a replay from 0: an engine that has not published more than its replay
    buffer holds is then known whole."""

    def __init__(self) -> None:
        self.translator = KvTranslator()
        self.expected = 0
        self.joining = True
        self.last_seq = -1
        self._dirty = False  # published anything since the last `cleared`

    def reset(self) -> HeldUpdate | None:
        """Forget what the endpoint holds and where its sequence was (its publisher went
        away); the `cleared` update to publish, if anything was published since the last."""
        self.expected, self.joining = 0, True
        return self._clear()

    def snapshot(self) -> HeldUpdate:
        """All the endpoint holds, from scratch: `cleared` then every block (to publish when
        earlier updates may not have reached the stream, or have aged out of it)."""
        self._dirty = bool(self.translator)
        return HeldUpdate(True, self.translator.held(), block_size=self.translator.block_size)

    def gap(self, seq: int) -> int | None:
        """Where a replay must start before the live batch `seq` can be applied; None: it
        follows the last one."""
        if seq == self.expected:
            return None
        if seq > self.expected:
            return self.expected
        return 0 if seq > 0 else None  # restarted: the new engine's batches from its start

    def receive(
        self,
        seq: int,
        batch: KvBatch,
        replayed: Sequence[tuple[int, KvBatch | None]] | None = None,
    ) -> Received:
        """Apply the live batch `seq` after `replayed`, the (seq, batch) pairs a replay from
        `gap(seq)` returned in order (a batch None: unreadable), or None (no replay: none
        possible, or it failed)."""
        dropped: Counter[Dropped] = Counter()
        update = HeldUpdate()
        restarted = seq < self.expected
        if restarted:
            update.then(self._clear() or HeldUpdate())
            update.emptied = True  # a new engine process: its cache started empty
            self.expected = 0
        filled: bool | None = None
        if seq > self.expected:
            run, filled = _contiguous(replayed or (), self.expected, seq)
            if not filled:
                update.then(self._clear() or HeldUpdate())
            for batch_seq, one in run:
                update.then(self.translator.apply(one, dropped))
                self.last_seq = batch_seq
        update.then(self.translator.apply(batch, dropped))
        if restarted:
            result = BatchResult.RESTARTED
        elif self.joining:
            result = BatchResult.JOINED
        elif filled is None:
            result = BatchResult.APPLIED
        else:
            result = BatchResult.GAP_FILLED if filled else BatchResult.GAP_LOST
        self.expected, self.last_seq, self.joining = seq + 1, seq, False
        if not update:
            return Received(result, None, dropped, filled)
        self._dirty = True
        return Received(result, update, dropped, filled)

    def _clear(self) -> HeldUpdate | None:
        self.translator.clear()
        if not self._dirty:
            return None
        self._dirty = False
        return HeldUpdate(cleared=True, block_size=self.translator.block_size)


def _contiguous(
    replayed: Iterable[tuple[int, KvBatch | None]], start: int, end: int
) -> tuple[list[tuple[int, KvBatch]], bool]:
    """The replayed batches that lead without a hole up to `end` (excluded), and whether they
    cover all from `start`. A hole (a missing or unreadable batch) loses what came before it."""
    run: list[tuple[int, KvBatch]] = []
    previous: int | None = None
    for seq, batch in replayed:
        if not start <= seq < end:
            continue
        if batch is None or (previous is not None and seq != previous + 1):
            run = []
        if batch is not None:
            run.append((seq, batch))
        previous = seq
    if not run or run[-1][0] != end - 1:
        return [], False
    return run, run[0][0] == start
