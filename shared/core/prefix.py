"""Prefix chains, and what each endpoint's prefix cache is believed to hold. Pure: no I/O, no
clock (callers pass ``now``).

An engine's prefix cache keeps the KV blocks of prompts it computed; a request whose prompt
starts with a cached prefix skips that part of its prefill. Placement prefers the endpoint
that holds the longest prefix of the request (`llmgw.core.placement`), which needs two things:

- **chains**: a prompt cut into fixed blocks, each block's hash covering every block before it
  (``h[i] = xxh3_64(block i, seed=h[i-1])``, ``h[-1] = ROOT``). Two prompts share ``h[i]``
  exactly when their first ``i + 1`` blocks are equal (up to 64-bit collisions), so the length
  of the common prefix of a request and what an endpoint holds is the number of leading hashes
  it holds. A *text chain* cuts the canonical bytes of a prompt (`canonical_prompt`: the same
  conversation gives the same bytes whatever API it came through) into ``block_bytes`` blocks;
  a *token chain* cuts the engine's token ids into its own KV blocks (``block_size`` tokens,
  each id as 4 little-endian bytes), the engine's own unit;
- **indexes**, per endpoint: `SentIndex`, the text chains recently sent there (each rooted at
  its model, `model_root`), an LRU bounded by what the engine can hold (its KV capacity),
  learned from placements, for any engine; `HeldIndex`, the token chains the engine says it
  holds (vLLM's KV cache events, reference-counted: an engine may hold the same block twice).

Invariants: an LRU touches a chain deepest block first, so a chain's shallower blocks are always
at least as recent as its deeper ones and eviction takes the tail of a prefix first (what
engines do): what a `SentIndex` holds of one chain is always a prefix of it. `match` never
counts a block past the first one missing.
"""

from __future__ import annotations

import array
import heapq
import itertools
import json
import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import xxhash

from llmgw.core.records import record

__all__ = [
    "ROOT",
    "HeldIndex",
    "PlacementTally",
    "PromptPrefix",
    "SentIndex",
    "TokenStore",
    "canonical_chat",
    "canonical_prompt",
    "model_root",
    "pack",
    "text_chain",
    "token_chain",
    "token_root",
    "unpack",
]

ROOT = 0  # the parent of a chain's first block

_hash = xxhash.xxh3_64_intdigest

# Separators of the canonical form: bytes that never occur in UTF-8 text of a message.
_MESSAGE = b"\x1e"
_FIELD = b"\x1f"
_PART = b"\x1d"


def model_root(model: str) -> int:
    """The parent of a text chain's first block for `model`: the same prompt for two models
    gives two chains (an engine's cache holds one model's KV)."""
    return _hash(model.encode())


def text_chain(data: bytes, block_bytes: int, max_blocks: int, root: int = ROOT) -> tuple[int, ...]:
    """The chain of `data`'s full `block_bytes` blocks (at most `max_blocks`; a partial last
    block is left out: no engine caches half a block either), from `root`."""
    count = min(len(data) // block_bytes, max_blocks)
    chain = []
    parent = root
    for start in range(0, count * block_bytes, block_bytes):
        parent = _hash(data[start : start + block_bytes], seed=parent)
        chain.append(parent)
    return tuple(chain)


def token_chain(
    tokens: Sequence[int], block_size: int, parent: int = ROOT, max_blocks: int | None = None
) -> list[int]:
    """The chain of `tokens`' full blocks of `block_size` ids, continuing from `parent` (the
    hash of the block before the first one; ROOT at a prompt's start)."""
    count = len(tokens) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    packed = array.array("I", tokens[: count * block_size])
    if sys.byteorder != "little":
        packed.byteswap()
    data = packed.tobytes()
    step = block_size * 4
    chain = []
    for start in range(0, count * step, step):
        parent = _hash(data[start : start + step], seed=parent)
        chain.append(parent)
    return chain


def token_root(adapter: str | None) -> int:
    """The parent of a token chain's first block: ROOT for the base model, else a seed of the
    LoRA adapter's name (an engine keys an adapter's blocks apart from the base model's)."""
    return ROOT if adapter is None else _hash(adapter.encode())


def pack(chain: Sequence[int]) -> bytes:
    """A chain as 8 bytes per hash (big-endian): its form on the wire."""
    packed = array.array("Q", chain)
    if sys.byteorder != "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> tuple[int, ...]:
    """`pack`'s inverse; a length that is not a multiple of 8 is a ValueError."""
    if len(data) % 8:
        raise ValueError(f"a packed chain has 8 bytes per hash, got {len(data)} bytes")
    packed = array.array("Q")
    packed.frombytes(data)
    if sys.byteorder != "big":
        packed.byteswap()
    return tuple(packed)


# -- the canonical form of a prompt -------------------------------------------------------------


# One encoder for every prompt (`json.dumps` with arguments makes one per call).
_canonical_json = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


def _json(value: Any) -> bytes:
    return _canonical_json(value).encode("utf-8", "surrogatepass")


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _content(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        return _PART + _json(content)
    pieces = []
    for part in content:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            pieces.append(_text(part["text"]))
        else:  # an image, a file, audio: the part itself (its URL or data) is its identity
            pieces.append(_PART + _json(part))
    return b"\n".join(pieces)


def canonical_chat(messages: Any, tools: Any = None) -> bytes | None:
    """The canonical bytes of a chat conversation: its tools, then each message's role and
    content (text parts joined by newlines, other parts and tool calls as sorted JSON). None
    when `messages` is not a list of messages. Field order, whitespace in JSON and keys a
    prompt does not depend on (``name`` aside) do not change the result."""
    if not isinstance(messages, list):
        return None
    pieces: list[bytes] = []
    if tools:
        pieces += (_MESSAGE, b"tools", _FIELD, _json(tools))
    for message in messages:
        if not isinstance(message, Mapping):
            return None
        role = message.get("role")
        pieces += (_MESSAGE, _text(role) if isinstance(role, str) else b"?", _FIELD)
        name = message.get("name")
        if isinstance(name, str):
            pieces += (_text(name), _FIELD)
        pieces.append(_content(message.get("content")))
        for key in ("tool_calls", "tool_call_id"):
            if message.get(key) is not None:
                pieces += (_PART, _json(message[key]))
    return b"".join(pieces)


def canonical_prompt(feature: str, body: Mapping[str, Any]) -> bytes | None:
    """The canonical bytes of a chat (``messages``, ``tools``) or completions (``prompt``)
    request body; None for anything else (embeddings: no prefix cache to aim at)."""
    if feature == "chat":
        return canonical_chat(body.get("messages"), body.get("tools"))
    if feature == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return _text(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return _PART + b",".join(str(t).encode() for t in prompt)
    return None


@record
class PromptPrefix:
    """What placement knows of a request's prompt: its text chain and the length it covers of
    the canonical bytes (``length``: all of them, with the partial last block); with the
    model's tokenizer, also its token chain (`token_chain` of its tokens, blocks of
    `token_block` ids, to match the engines' KV cache events) and its token count."""

    chain: tuple[int, ...]
    length: int
    block_bytes: int
    tokens: tuple[int, ...] = ()
    token_count: int = 0
    token_block: int = 0

    def share(self, blocks: int) -> float:
        """The part of the prompt `blocks` leading text blocks cover, 0..1."""
        if self.length <= 0:
            return 0.0
        return min(1.0, blocks * self.block_bytes / self.length)

    def token_share(self, blocks: int) -> float:
        """The part of the prompt `blocks` leading token blocks cover, 0..1."""
        if self.token_count <= 0:
            return 0.0
        return min(1.0, blocks * self.token_block / self.token_count)


# -- the indexes ---------------------------------------------------------------------------------


class SentIndex:
    """The text chains recently sent to each key (an endpoint): an LRU per key,
    bounded by the key's capacity in blocks (`set_capacity`; `default_capacity` until then).
    Each entry remembers when it was last sent (``now`` of `record`).

    Memory: one OrderedDict entry per block held (about 100 bytes with its int key and float
    value in CPython), so the bound is the sum of the keys' capacities."""

    def __init__(self, default_capacity: int) -> None:
        if default_capacity < 1:
            raise ValueError("default_capacity must be >= 1")
        self.default_capacity = default_capacity
        self._lru: dict[Hashable, OrderedDict[int, float]] = {}
        self._capacity: dict[Hashable, int] = {}

    def capacity(self, key: Hashable) -> int:
        return self._capacity.get(key, self.default_capacity)

    def set_capacity(self, key: Hashable, blocks: int) -> None:
        """The most blocks `key` holds; a smaller bound evicts its least recent blocks now."""
        self._capacity[key] = max(1, blocks)
        lru = self._lru.get(key)
        if lru is not None:
            self._evict(lru, self._capacity[key])

    def record(self, key: Hashable, chain: Sequence[int], now: float) -> None:
        """`chain` was sent to `key` at `now`: its blocks become the most recent there."""
        if not chain:
            return
        lru = self._lru.get(key)
        if lru is None:
            lru = self._lru[key] = OrderedDict()
        capacity = self.capacity(key)
        for block in reversed(chain[:capacity]):  # deepest first: the root ends most recent
            lru[block] = now
            lru.move_to_end(block)
        self._evict(lru, capacity)

    @staticmethod
    def _evict(lru: OrderedDict[int, float], capacity: int) -> None:
        while len(lru) > capacity:
            lru.popitem(last=False)

    def match(self, key: Hashable, chain: Sequence[int], since: float | None = None) -> int:
        """How many leading blocks of `chain` `key` holds (sent at or after `since`, if
        given)."""
        lru = self._lru.get(key)
        if not lru:
            return 0
        held = 0
        for block in chain:
            sent = lru.get(block)
            if sent is None or (since is not None and sent < since):
                break
            held += 1
        return held

    def drop(self, key: Hashable) -> None:
        self._lru.pop(key, None)

    def keys(self) -> list[Hashable]:
        return list(self._lru)

    def size(self, key: Hashable | None = None) -> int:
        """Blocks held by `key`, or by every key."""
        if key is not None:
            return len(self._lru.get(key, ()))
        return sum(len(lru) for lru in self._lru.values())

    def top(self, key: Hashable, roots: int) -> list[tuple[int, float]]:
        """The most recent chain roots of `key` (first blocks: blocks no other block of the
        same chain precedes cannot be told apart here, so this is its most recent blocks)."""
        lru = self._lru.get(key)
        if not lru:
            return []
        return [(block, lru[block]) for block in reversed(list(lru)[-roots:])]


class HeldIndex:
    """The token chains each key's engine says it holds (its KV cache events), with a count per
    block: a block stored twice (two requests computed it at once) is held until removed twice.
    `cleared` drops a key's blocks (the engine restarted, or cleared its cache)."""

    def __init__(self) -> None:
        self._held: dict[Hashable, dict[int, int]] = {}

    def store(self, key: Hashable, blocks: Iterable[int]) -> None:
        held = self._held.setdefault(key, {})
        for block in blocks:
            held[block] = held.get(block, 0) + 1

    def remove(self, key: Hashable, blocks: Iterable[int]) -> None:
        held = self._held.get(key)
        if not held:
            return
        for block in blocks:
            count = held.get(block)
            if count is None:
                continue
            if count <= 1:
                del held[block]
            else:
                held[block] = count - 1

    def clear(self, key: Hashable) -> None:
        self._held.pop(key, None)

    def match(self, key: Hashable, chain: Sequence[int]) -> int:
        held = self._held.get(key)
        if not held:
            return 0
        count = 0
        for block in chain:
            if block not in held:
                break
            count += 1
        return count

    def keys(self) -> list[Hashable]:
        return list(self._held)

    def size(self, key: Hashable | None = None) -> int:
        if key is not None:
            return len(self._held.get(key, ()))
        return sum(len(held) for held in self._held.values())


class PlacementTally:
    """Placements counted per key (an endpoint's prompts, by their chain's first block), at
    most `keep` keys: a new key in a full tally evicts the least placed one (ties: the one
    first counted). `items` lists the keys in the order they were first counted.

    A placement costs O(log keep): a heap of (count, arrival, key) is kept beside the counts,
    an entry older than its key's count is skipped when it comes to the top, and the heap is
    rebuilt when such entries outnumber the live ones. (Looking for the least placed key among
    them all cost ~40 us a placement at 256 keys, on every decision that placed a new prompt.)"""

    __slots__ = ("_arrivals", "_entries", "_heap", "keep")

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._entries: dict[int, list[Any]] = {}  # key -> [count, blocks, last at, arrival]
        self._heap: list[tuple[int, int, int]] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: int, blocks: int, at: float) -> None:
        """One more placement of `key`, of a chain of `blocks` blocks, at `at`."""
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.keep:
                self._evict()
            arrival = next(self._arrivals)
            self._entries[key] = [1, blocks, at, arrival]
            heapq.heappush(self._heap, (1, arrival, key))
            return
        entry[0] += 1
        entry[1] = max(entry[1], blocks)
        entry[2] = max(entry[2], at)
        heapq.heappush(self._heap, (entry[0], entry[3], key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(e[0], e[3], k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

    def _evict(self) -> None:
        while self._heap:
            count, arrival, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry[0] == count and entry[3] == arrival:
                del self._entries[key]
                return

    def items(self) -> list[tuple[int, int, int, float]]:
        """(key, placements, most blocks, last placed at), in the order first counted."""
        return [(key, e[0], e[1], e[2]) for key, e in self._entries.items()]


class TokenStore:
    """A prefix cache of tokenizations: a prompt's text cut into `chunk` character chunks, each
    chunk (chained like a text chain) remembering the tokens that end inside it. A prompt whose
    leading chunks were tokenized before (a tenant's system prompt, a conversation's earlier
    turns) gets those tokens without tokenizing again (`lookup`), when they cover at least
    `min_cover` of it: matching needs the prompt's leading tokens only. A token that crosses the
    last covered chunk's end may differ from a fresh tokenization's: it can cost at most the
    last block of a match. LRU, at most `entries` chunks."""

    def __init__(self, chunk: int = 256, entries: int = 100_000, min_cover: float = 0.8) -> None:
        self.chunk = chunk
        self.entries = entries
        self.min_cover = min_cover
        self._chunks: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def lookup(self, text: str) -> list[int] | None:
        """The tokens of `text`'s longest remembered leading chunks, if they cover at least
        `min_cover` of it; None: tokenize it."""
        tokens: list[int] = []
        parent = ROOT
        covered = 0
        for start in range(0, len(text) - self.chunk + 1, self.chunk):
            parent = _hash(
                text[start : start + self.chunk].encode("utf-8", "surrogatepass"), seed=parent
            )
            found = self._chunks.get(parent)
            if found is None:
                break
            self._chunks.move_to_end(parent)
            tokens.extend(found)
            covered = start + self.chunk
        if not text or covered < self.min_cover * len(text):
            return None
        return tokens

    def store(self, text: str, ids: Sequence[int], ends: Sequence[int]) -> None:
        """Remember `text`'s tokenization (`ids`, each token's end offset in `ends`) by its full
        chunks."""
        parent = ROOT
        index = 0
        for start in range(0, len(text) - self.chunk + 1, self.chunk):
            stop = start + self.chunk
            parent = _hash(text[start:stop].encode("utf-8", "surrogatepass"), seed=parent)
            first = index
            while index < len(ids) and ends[index] <= stop:
                index += 1
            self._chunks[parent] = tuple(ids[first:index])
            self._chunks.move_to_end(parent)
        while len(self._chunks) > self.entries:
            self._chunks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._chunks)
