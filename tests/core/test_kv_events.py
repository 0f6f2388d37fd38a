"""vLLM's KV cache events read and translated into our token chains (llmgw.core.kv_events):
both encodings, the chains, reference counts, sequence numbers and gaps, malformed payloads;
property-tested against a model engine."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_kv import STORED_FIELDS, cleared, encode_batch, removed, stored

from llmgw.core.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BatchResult,
    BlockRemoved,
    BlockStored,
    Dropped,
    HeldUpdate,
    KvBatch,
    KvEventsError,
    KvSync,
    KvTranslator,
    decode_batch,
    decode_seq,
)
from llmgw.core.prefix import HeldIndex, token_chain, token_root

BS = 4
tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=3 * BS)
u64 = st.integers(0, 2**64 - 1)
adapters = st.sampled_from([None, "sql-lora"])


# -- a model engine ----------------------------------------------------------------------------


class Engine:
    """What an engine's prefix cache holds, and the events it publishes: each block's engine
    hash comes from its parent's and its tokens (so the same prompt stored twice is the same
    block twice), and we know each block's tokens from its prompt's start."""

    def __init__(self) -> None:
        self.copies: Counter[int] = Counter()
        self.path: dict[int, tuple[tuple[int, ...], str | None]] = {}

    @staticmethod
    def block_hash(parent: int | None, block: tuple[int, ...], adapter: str | None) -> int:
        return xxhash.xxh64_intdigest(repr((parent, block, adapter)).encode())

    def held(self) -> list[int]:
        return [h for h, n in self.copies.items() if n > 0]

    def store(
        self, parent: int | None, tokens: list[int], adapter: str | None, partial: int = 0
    ) -> dict[str, Any]:
        """Store `tokens`' full blocks after `parent` (a held block, or None); `partial`
        tokens of a last block the event carries without a hash."""
        prefix, adapter = self.path[parent] if parent is not None else ((), adapter)
        hashes = []
        previous = parent
        for start in range(0, len(tokens) - len(tokens) % BS, BS):
            block = tuple(tokens[start : start + BS])
            h = self.block_hash(previous, block, adapter)
            prefix = prefix + block
            self.path[h] = (prefix, adapter)
            self.copies[h] += 1
            hashes.append(h)
            previous = h
        full = tokens[: len(tokens) - len(tokens) % BS]
        return stored(hashes, parent, full + [7] * partial, BS, lora_name=adapter)

    def remove(self, h: int) -> dict[str, Any]:
        self.copies[h] -= 1
        return removed([h])

    def clear(self) -> dict[str, Any]:
        self.copies.clear()
        return cleared()

    def ours(self, h: int) -> int:
        prefix, adapter = self.path[h]
        return token_chain(prefix, BS, parent=token_root(adapter))[-1]

    def expected(self) -> Counter[int]:
        """Our index of this engine: our hash of each block held, once per engine block."""
        return Counter(self.ours(h) for h in self.held())


def apply(index: Counter[int], update: HeldUpdate | None) -> None:
    """A `PrefixHeld` applied as `HeldIndex` does (a count per hash, never below zero)."""
    if update is None:
        return
    if update.cleared:
        index.clear()
    index.update(update.stored)
    for h in update.removed:
        if index[h] > 1:
            index[h] -= 1
        else:
            index.pop(h, None)


def batch(*events: dict[str, Any]) -> KvBatch:
    return decode_batch(encode_batch(list(events)))


@st.composite
def engine_runs(draw: st.DrawFn, clears: bool = True) -> tuple[Engine, list[list[dict[str, Any]]]]:
    """A model engine and the batches of events it published, in order: prompts stored (new
    or continuing a held block, sometimes stored again), blocks evicted, caches cleared, and
    events for other media, groups and cache kinds that must change nothing."""
    engine = Engine()
    batches: list[list[dict[str, Any]]] = []
    for _ in range(draw(st.integers(1, 8))):
        events: list[dict[str, Any]] = []
        for _ in range(draw(st.integers(1, 5))):
            held = engine.held()
            kind = draw(st.sampled_from(["store", "store", "again", "remove", "clear", "other"]))
            if kind == "clear" and not clears:
                kind = "store"
            if kind == "store" or (kind in ("again", "remove") and not held):
                parent = draw(st.sampled_from([None, *held]))
                tokens = draw(st.lists(st.integers(0, 9), min_size=BS, max_size=3 * BS))
                partial = draw(st.integers(0, BS - 1))
                events.append(engine.store(parent, tokens, draw(adapters), partial))
            elif kind == "again":  # the same block computed by a second request
                h = draw(st.sampled_from(held))
                prefix, adapter = engine.path[h]
                parent_prefix = prefix[:-BS]
                parent = next(
                    (p for p in engine.held() if engine.path[p][0] == parent_prefix), None
                )
                if parent is None and parent_prefix:
                    continue  # its parent is gone: no request can compute it again
                events.append(engine.store(parent, list(prefix[-BS:]), adapter))
            elif kind == "remove":
                events.append(engine.remove(draw(st.sampled_from(held))))
            elif kind == "clear":
                events.append(engine.clear())
            else:  # what the translator must skip: it never changes what we hold
                other = draw(
                    st.sampled_from(
                        [{"medium": "CPU"}, {"group_idx": 1}, {"kind": "sliding_window"}]
                    )
                )
                tokens = draw(st.lists(st.integers(0, 9), min_size=BS, max_size=2 * BS))
                hashes = [draw(u64) for _ in range(len(tokens) // BS)]
                events.append(stored(hashes, None, tokens, BS, **other))
        batches.append(events)
    return engine, batches


# -- decoding ----------------------------------------------------------------------------------


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    engine_runs(),
    st.sampled_from(["u64", "i64", "bytes"]),
    st.sampled_from(["array", "array2", "map"]),
)
def test_both_encodings_and_every_hash_form_decode_to_the_same_batch(
    run: tuple[Engine, list[list[dict[str, Any]]]], hashes: Any, outer: Any
) -> None:
    _, batches = run
    for events in batches:
        reference = decode_batch(encode_batch(events, encoding="array", dp_rank=None))
        for encoding in ("array", "map"):
            payload = encode_batch(
                events, encoding=encoding, hashes=hashes, batch=outer, dp_rank=None
            )
            assert decode_batch(payload) == reference


@pytest.mark.parametrize("fields", range(4, len(STORED_FIELDS) + 1))
def test_an_older_engines_shorter_positional_events_decode(fields: int) -> None:
    event = stored([1, 2], None, list(range(2 * BS)), BS, lora_name="a", group_idx=0)
    event["kv_cache_spec_kind"] = "full_attention"
    got = decode_batch(encode_batch([event, removed([1])], encoding="array", fields=fields))
    first, second = got.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockRemoved)
    assert first.block_hashes == (1, 2) and first.token_ids == tuple(range(2 * BS))
    assert first.medium == ("GPU" if fields > 5 else None)
    assert first.lora_name == ("a" if fields > 6 else None)
    assert first.group_idx == (0 if fields > 8 else None)
    assert first.spec_kind == ("full_attention" if fields > 9 else None)


def test_a_batch_as_a_map_and_a_capture_of_vllm_0_26_decode() -> None:
    # A BlockStored as vLLM v0.26 sent it (inner map, outer array), with fields yet unknown.
    capture = [
        1789095808.83,
        [
            {
                "type": "BlockStored",
                "block_hashes": [15763041963231146235],
                "parent_block_hash": None,
                "token_ids": list(range(16)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
                "locality": "local",
            },
            {"type": "SomethingNew", "x": 1},
            ["AlsoNew", 1, 2],
        ],
        0,
    ]
    got = decode_batch(msgpack.packb(capture))
    assert got.ts == 1789095808.83 and got.dp_rank == 0 and got.unknown == 2
    (event,) = got.events
    assert event == BlockStored(
        (15763041963231146235,), None, tuple(range(16)), 16, None, "GPU", 0, "full_attention"
    )
    as_map = {"ts": 1.5, "events": [["AllBlocksCleared"]], "data_parallel_rank": None}
    assert decode_batch(msgpack.packb(as_map)) == KvBatch(1.5, None, (AllBlocksCleared(),))


def test_sequence_numbers_and_the_end_marker() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(b"\xff" * 8) == END_SEQ
    with pytest.raises(KvEventsError, match="8 bytes"):
        decode_seq(b"\x00" * 4)


_MALFORMED = {
    "not-msgpack": b"\xc1",
    "truncated": msgpack.packb([1.0, [["BlockStored", [1]]], 0])[:-3],
    "a-bare-int": msgpack.packb(7),
    "short-batch": msgpack.packb([1.0]),
    "ts-a-string": msgpack.packb(["now", [], 0]),
    "ts-infinite": msgpack.packb([float("inf"), [], 0]),
    "events-a-map": msgpack.packb([1.0, {"a": 1}, 0]),
    "rank-a-string": msgpack.packb([1.0, [], "0"]),
    "event-a-number": msgpack.packb([1.0, [3], 0]),
    "event-untagged": msgpack.packb([1.0, [{"block_hashes": []}], 0]),
    "stored-too-short": msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2]]], 0]),
    "map-missing-tokens": msgpack.packb(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "block_size": 4,
                }
            ],
            0,
        ]
    ),
    "hash-a-string": msgpack.packb([1.0, [["BlockRemoved", ["ab"], "GPU"]], 0]),
    "hash-empty-bytes": msgpack.packb([1.0, [["BlockRemoved", [b""], "GPU"]], 0]),
    "hash-a-bool": msgpack.packb([1.0, [["BlockRemoved", [True], "GPU"]], 0]),
    "token-negative": msgpack.packb([1.0, [["BlockStored", [1], None, [-1, 2, 3, 4], 4]], 0]),
    "token-too-big": msgpack.packb([1.0, [["BlockStored", [1], None, [2**32, 2, 3, 4], 4]], 0]),
    "block-size-zero": msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0]], 0]),
    "medium-a-number": msgpack.packb([1.0, [["BlockRemoved", [1], 5]], 0]),
    "group-a-string": msgpack.packb([1.0, [["BlockRemoved", [1], "GPU", "0"]], 0]),
}


@pytest.mark.parametrize("payload", _MALFORMED.values(), ids=_MALFORMED.keys())
def test_a_malformed_payload_raises_the_one_error_saying_what_was_wrong(payload: bytes) -> None:
    with pytest.raises(KvEventsError) as error:
        decode_batch(payload)
    assert str(error.value)


def _msgpack_values() -> st.SearchStrategy[Any]:
    ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
    leaves = (
        st.none()
        | st.booleans()
        | ints
        | st.floats(allow_nan=True)
        | st.text(max_size=12)
        | st.binary(max_size=12)
        | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "ts"])
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=6)
            | st.dictionaries(st.text(max_size=8) | ints, inner, max_size=6)
        ),
        max_leaves=20,
    )


def _decodes_or_raises_the_one_error(payload: bytes) -> None:
    try:
        decode_batch(payload)
    except KvEventsError:
        pass


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_the_one_error(payload: bytes) -> None:
    _decodes_or_raises_the_one_error(payload)


@settings(max_examples=200)
@given(_msgpack_values(), _msgpack_values())
def test_random_shapes_decode_or_raise_the_one_error(events: Any, other: Any) -> None:
    for shape in ([1.0, events, 0], [1.0, [events, other]], {"ts": 1.0, "events": events}, events):
        _decodes_or_raises_the_one_error(msgpack.packb(shape))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(engine_runs(), st.data())
def test_a_valid_batch_with_any_part_replaced_decodes_or_raises_the_one_error(
    run: tuple[Engine, list[list[dict[str, Any]]]], data: st.DataObject
) -> None:
    _, batches = run
    for encoding in ("array", "map"):
        raw = msgpack.unpackb(encode_batch(batches[0], encoding=encoding), strict_map_key=False)
        _replace_somewhere(raw, data)
        _decodes_or_raises_the_one_error(msgpack.packb(raw))


def _replace_somewhere(value: Any, data: st.DataObject) -> None:
    """Replace one element, at any depth, with any msgpack value."""
    while True:
        if isinstance(value, list) and value:
            index = data.draw(st.integers(0, len(value) - 1))
        elif isinstance(value, dict) and value:
            index = data.draw(st.sampled_from(sorted(value, key=repr)))
        else:
            return
        if data.draw(st.booleans()) or not isinstance(value[index], list | dict):
            value[index] = data.draw(_msgpack_values())
            return
        value = value[index]


# -- translating -------------------------------------------------------------------------------


@given(tokens_st, st.lists(st.integers(1, 3), max_size=4), adapters, st.integers(0, BS - 1))
def test_a_chain_stored_over_several_events_is_the_token_chain_of_all_its_tokens(
    tokens: list[int], cuts: list[int], adapter: str | None, partial: int
) -> None:
    full = tokens[: len(tokens) - len(tokens) % BS]
    engine, translator, ours = Engine(), KvTranslator(), []
    parent, start = None, 0
    for blocks in [*cuts, len(full) // BS]:  # events of a few blocks each, then the rest
        piece = full[start : start + blocks * BS]
        if not piece:
            break
        event = engine.store(parent, piece, adapter, partial)
        parent, start = event["block_hashes"][-1], start + len(piece)
        ours += translator.apply(batch(event), Counter()).stored
    assert ours == token_chain(full, BS, parent=token_root(adapter))


def test_a_block_stored_twice_is_held_until_removed_twice() -> None:
    engine, sync, index = Engine(), KvSync(), Counter[int]()
    first = engine.store(None, list(range(2 * BS)), None)
    again = engine.store(None, list(range(2 * BS)), None)
    h = first["block_hashes"][1]
    for seq, events in enumerate([[first], [again], [engine.remove(h)]]):
        apply(index, sync.receive(seq, batch(*events)).update)
    assert index == engine.expected() and len(index) == 2
    apply(index, sync.receive(3, batch(engine.remove(h))).update)
    assert index == engine.expected() and len(index) == 1


def test_a_store_after_a_parent_never_seen_is_left_out_and_counted() -> None:
    dropped: Counter[Dropped] = Counter()
    translator = KvTranslator()
    update = translator.apply(batch(stored([5], 4242, list(range(BS)), BS)), dropped)
    assert not update and dropped == {Dropped.UNKNOWN_PARENT: 1} and len(translator) == 0
    # ...and so is what continues it; a removal of a block never seen changes nothing.
    update = translator.apply(batch(stored([6], 5, list(range(BS)), BS), removed([5])), dropped)
    assert not update and dropped == {Dropped.UNKNOWN_PARENT: 2}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"medium": "CPU"}, Dropped.MEDIUM),
        ({"medium": "STORAGE"}, Dropped.MEDIUM),
        ({"group_idx": 1}, Dropped.GROUP),
        ({"kind": "sliding_window"}, Dropped.SPEC_KIND),
        ({"kind": "mamba"}, Dropped.SPEC_KIND),
        ({"medium": None}, None),
        ({"group_idx": 0, "kind": "mla_attention"}, None),
        ({"kind": "sink_full_attention"}, None),
    ],
    ids=["cpu", "storage", "group-1", "sliding", "mamba", "no-medium", "mla", "sink"],
)
def test_only_full_attention_gpu_blocks_of_the_first_group_count(
    fields: dict[str, Any], reason: Dropped | None
) -> None:
    dropped: Counter[Dropped] = Counter()
    update = KvTranslator().apply(batch(stored([1], None, list(range(BS)), BS, **fields)), dropped)
    assert bool(update.stored) == (reason is None)
    assert dropped == (Counter({reason: 1}) if reason else Counter())


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(engine_runs())
def test_the_translator_follows_a_model_engine_through_any_interleaving(
    run: tuple[Engine, list[list[dict[str, Any]]]],
) -> None:
    engine, batches = run
    sync, index, held = KvSync(), Counter[int](), HeldIndex()
    for seq, events in enumerate(batches):
        update = sync.receive(seq, batch(*events)).update
        apply(index, update)
        if update is not None:
            if update.cleared:
                held.clear("e")
            held.store("e", update.stored)
            held.remove("e", update.removed)
    assert index == engine.expected()
    assert held.size("e") == len(index)
    assert all(held.match("e", [h]) == 1 for h in index)
    assert sorted(sync.snapshot().stored) == sorted(index.elements())


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(engine_runs(), st.integers(1, 7))
def test_updates_merged_or_split_mean_the_same_as_one_by_one(
    run: tuple[Engine, list[list[dict[str, Any]]]], most: int
) -> None:
    engine, batches = run
    sync, merged = KvSync(), HeldUpdate()
    for seq, events in enumerate(batches):
        merged.then(sync.receive(seq, batch(*events)).update or HeldUpdate())
    index = Counter[int]()
    parts = merged.split(most)
    for part in parts:
        apply(index, part)
    assert index == engine.expected()
    assert all(len(part) <= most for part in parts) and not any(p.cleared for p in parts[1:])


# -- sequence numbers --------------------------------------------------------------------------


def _store(engine: Engine, start: int) -> list[dict[str, Any]]:
    return [engine.store(None, [start] * BS, None)]


def replay_of(
    payloads: dict[int, list[dict[str, Any]]], start: int
) -> list[tuple[int, KvBatch | None]]:
    return [(seq, batch(*events)) for seq, events in sorted(payloads.items()) if seq >= start]


def test_batches_in_order_are_applied_and_the_first_is_joined() -> None:
    engine, sync = Engine(), KvSync()
    results = [sync.receive(seq, batch(*_store(engine, seq))).result for seq in range(3)]
    assert results == [BatchResult.JOINED, BatchResult.APPLIED, BatchResult.APPLIED]
    assert sync.gap(3) is None and sync.gap(5) == 3 and sync.expected == 3


def test_a_gap_a_replay_fills_is_applied_in_order() -> None:
    engine, sync, index = Engine(), KvSync(), Counter[int]()
    sent = {seq: _store(engine, seq) for seq in range(6)}
    for seq in (0, 1):
        apply(index, sync.receive(seq, batch(*sent[seq])).update)
    assert sync.gap(4) == 2
    got = sync.receive(4, batch(*sent[4]), replay_of(sent, 2))
    apply(index, got.update)
    assert got.result is BatchResult.GAP_FILLED and got.filled is True
    assert got.update is not None and not got.update.cleared
    assert index == index_of(sent, range(5)) and sync.expected == 5


def index_of(sent: dict[int, list[dict[str, Any]]], seqs: Iterable[int]) -> Counter[int]:
    """Our index of an engine that published `sent`'s batches `seqs` (stores only)."""
    translator, index = KvTranslator(), Counter[int]()
    for seq in seqs:
        apply(index, translator.apply(batch(*sent[seq]), Counter()))
    return index


@pytest.mark.parametrize(
    ("replayed", "tail"),
    [(None, [4]), ([], [4]), ([3], [3, 4]), ([1, 3], [3, 4]), ([1, 2], [4]), ([1, -2, 3], [3, 4])],
    ids=["no-replay", "nothing", "buffer-too-short", "hole", "stops-short", "unreadable"],
)
def test_a_gap_no_replay_fills_clears_then_applies_what_follows_without_a_hole(
    replayed: list[int] | None, tail: list[int]
) -> None:
    """Batch 0 applied, then 4: the replay from 1 returned `replayed` (-2: batch 2 unreadable)."""
    engine, sync, index = Engine(), KvSync(), Counter[int]()
    sent = {seq: _store(engine, seq) for seq in range(5)}
    apply(index, sync.receive(0, batch(*sent[0])).update)
    pairs = None
    if replayed is not None:
        pairs = [(s, batch(*sent[s])) if s >= 0 else (-s, None) for s in replayed]
    got = sync.receive(4, batch(*sent[4]), pairs)
    apply(index, got.update)
    assert got.result is BatchResult.GAP_LOST and got.filled is False
    assert got.update is not None and got.update.cleared
    assert index == index_of(sent, tail)


def test_a_sequence_going_back_is_a_restart_cleared_then_applied() -> None:
    engine, sync, index = Engine(), KvSync(), Counter[int]()
    for seq in range(3):
        apply(index, sync.receive(seq, batch(*_store(engine, seq))).update)
    fresh = Engine()
    first = _store(fresh, 100)
    assert sync.gap(0) is None
    got = sync.receive(0, batch(*first))
    apply(index, got.update)
    assert got.result is BatchResult.RESTARTED and got.update is not None and got.update.cleared
    assert got.update.emptied  # the engine's own cache went: what was sent there too
    assert index == fresh.expected()


def test_only_an_engine_that_emptied_its_cache_says_so() -> None:
    """AllBlocksCleared and a restart empty the engine's cache (`emptied`: the admission
    instances forget what they sent there too); a gap lost or a lost connection only empties
    what we know of it."""
    engine, sync = Engine(), KvSync()
    sent = {seq: _store(engine, seq) for seq in range(5)}
    sync.receive(0, batch(*sent[0]))
    lost = sync.receive(3, batch(*sent[3]), None)
    assert lost.update is not None and lost.update.cleared and not lost.update.emptied
    wiped = sync.receive(4, batch({"type": "AllBlocksCleared"}))
    assert wiped.update is not None and wiped.update.cleared and wiped.update.emptied
    reset = sync.reset()
    assert reset is None or not reset.emptied


def test_a_restart_seen_late_replays_the_new_engine_from_its_start() -> None:
    engine, sync, index = Engine(), KvSync(), Counter[int]()
    for seq in range(5):
        apply(index, sync.receive(seq, batch(*_store(engine, seq))).update)
    fresh = Engine()
    sent = {seq: _store(fresh, 100 + seq) for seq in range(3)}
    assert sync.gap(2) == 0
    got = sync.receive(2, batch(*sent[2]), replay_of(sent, 0))
    apply(index, got.update)
    assert got.result is BatchResult.RESTARTED and got.filled is True
    assert index == fresh.expected()


def test_a_reset_clears_once_and_joins_again_from_a_replay_from_zero() -> None:
    engine, sync, index = Engine(), KvSync(), Counter[int]()
    sent = {seq: _store(engine, seq) for seq in range(4)}
    apply(index, sync.receive(0, batch(*sent[0])).update)
    update = sync.reset()
    assert update is not None and update.cleared and sync.reset() is None
    apply(index, update)
    assert not index and sync.gap(3) == 0
    got = sync.receive(3, batch(*sent[3]), replay_of(sent, 0))
    apply(index, got.update)
    assert got.result is BatchResult.JOINED and got.filled is True
    assert index == engine.expected()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_what_is_held_never_exceeds_the_engine_and_equals_it_when_replays_fill_every_gap(
    data: st.DataObject,
) -> None:
    """Batches dropped on the way, replays that fail or reach only so far back, engines that
    restart (the subscriber's connection drops with them): what the updates add up to is always
    a subset of what the engine holds, and all of it when every replay filled its gap."""
    sync, index, exact = KvSync(), Counter[int](), True
    buffer_steps = data.draw(st.sampled_from([1, 3, 1000]))
    engine, sent = Engine(), {}
    for _ in range(data.draw(st.integers(1, 12))):
        if data.draw(st.integers(0, 9)) == 0:  # the engine restarts; the connection drops
            apply(index, sync.reset())
            engine, sent, exact = Engine(), {}, True
        held = engine.held()
        if held and data.draw(st.booleans()):
            events = [engine.remove(data.draw(st.sampled_from(held)))]
        else:
            parent = data.draw(st.sampled_from([None, *held]))
            tokens = data.draw(st.lists(st.integers(0, 3), min_size=BS, max_size=2 * BS))
            events = [engine.store(parent, tokens, None)]
        seq = len(sent)
        sent[seq] = events
        if data.draw(st.integers(0, 3)) == 0:
            continue  # lost on the way
        start = sync.gap(seq)
        replayed = None
        if start is not None and data.draw(st.integers(0, 4)) > 0:  # else the replay failed
            kept = [s for s in sent if s >= len(sent) - buffer_steps]
            replayed = [(s, batch(*sent[s])) for s in kept if s >= start]
        got = sync.receive(seq, batch(*events), replayed)
        apply(index, got.update)
        if got.filled is False:
            exact = False
        truth = engine.expected()
        assert not (index - truth), "holds a block the engine does not"
        if exact:
            assert index == truth
