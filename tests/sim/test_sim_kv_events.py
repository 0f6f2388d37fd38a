"""vLLM's KV cache events from the pure engine model (a fake clock, no sockets): what is recorded
for stores, evictions and resets, and the two wire encodings as msgpack decodes them."""

from __future__ import annotations

import random

import msgpack
import pytest

from llmgw.core.prefix import token_chain, token_root
from llmgw.services.sim.engine_model import EngineModel
from llmgw.services.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventEncoding,
    KvEventRecorder,
    ReplayRing,
    wire_batch,
)
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import hash_token_blocks

BS = 4
MS = 0.001


def make_model(recorder: KvEventRecorder, **overrides: object) -> EngineModel:
    base: dict[str, object] = dict(num_gpu_blocks=64, block_size=BS, max_model_len=200)
    base.update(overrides)
    return EngineModel(EngineParams.zero_delay(**base), random.Random(7), kv_events=recorder)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [salt * 1_000_003 + i for i in range(n)]


def encode(ts: float, events: list[KvEvent], encoding: KvEventEncoding) -> bytes:
    """A batch's payload as the publisher writes it."""
    payload: bytes = msgpack.packb(wire_batch(ts, events, encoding))
    return payload


def stored(batches: list[list[KvEvent]]) -> list[BlockStored]:
    return [event for batch in batches for event in batch if isinstance(event, BlockStored)]


def chains(events: list[BlockStored]) -> dict[int, list[int]]:
    """Each published block hash -> the tokens from the prompt's start through that block,
    rebuilt only from the events' parent links and token ids (what a consumer can do)."""
    known: dict[int, list[int]] = {}
    for event in events:
        tokens = [] if event.parent_block_hash is None else known[event.parent_block_hash]
        for index, block_hash in enumerate(event.block_hashes):
            tokens = tokens + list(event.token_ids[index * BS : (index + 1) * BS])
            known[block_hash] = tokens
    return known


def test_a_prompt_stores_its_full_blocks_once_and_a_sharer_stores_only_its_own() -> None:
    recorder = KvEventRecorder(b"salt")
    model = make_model(recorder)
    first, second = prompt(10), [*prompt(8), 77, 78, 79, 80, 81]
    model.submit(0.0, first, max_tokens=1)
    model.submit(1.0, second, max_tokens=1)
    batches = recorder.take()
    assert len(batches) == 2  # one step each
    a, b = stored(batches)
    assert (len(a.block_hashes), a.parent_block_hash) == (2, None)
    assert a.token_ids == tuple(first[:8]) and a.block_size == BS and a.lora_name is None
    # The second prompt hits both of the first's blocks and registers its third.
    assert b.parent_block_hash == a.block_hashes[1]
    assert b.token_ids == tuple(second[8:12])
    known = chains([a, b])
    assert known[a.block_hashes[-1]] == first[:8]
    assert known[b.block_hashes[-1]] == second[:12]
    assert recorder.take() == []


def test_identical_prompts_in_one_step_store_each_block_once() -> None:
    recorder = KvEventRecorder(b"salt")
    model = make_model(recorder, prefill_base=10 * MS)
    model.submit(0.0, prompt(12), max_tokens=1)
    model.submit(0.0, prompt(12), max_tokens=1)  # admitted before the first registers
    model.advance(1.0)
    (batch,) = recorder.take()
    (event,) = stored([batch])  # the second's blocks stay private, as the cache keeps them
    assert len(event.block_hashes) == 3


def test_blocks_registered_around_another_sequence_s_are_one_event_per_run() -> None:
    recorder = KvEventRecorder(b"salt")
    hashes = hash_token_blocks(prompt(20), BS)
    recorder.stored(0.0, hashes, [1, 2, 4], prompt(20), BS, "sql")
    first, second = stored(recorder.take())
    assert first.parent_block_hash == recorder.engine_hash(hashes[0])
    assert first.block_hashes == (recorder.engine_hash(hashes[1]), recorder.engine_hash(hashes[2]))
    assert first.token_ids == tuple(prompt(20)[4:12])
    assert second.parent_block_hash == recorder.engine_hash(hashes[3])
    assert second.token_ids == tuple(prompt(20)[16:20])
    assert first.lora_name == second.lora_name == "sql"


def test_evicted_blocks_are_removed_one_event_each_tail_first() -> None:
    recorder = KvEventRecorder(b"salt")
    model = make_model(recorder, num_gpu_blocks=4)
    model.submit(0.0, prompt(12), max_tokens=1)  # 3 cached blocks, 1 output block
    (old,) = stored(recorder.take())
    h0, h1, h2 = old.block_hashes
    model.submit(1.0, prompt(12, salt=1), max_tokens=1)  # needs all 4 blocks
    (batch,) = recorder.take()
    # Released tail first, so evicted tail first, as vLLM does: two for the prompt at admission,
    # then, once its blocks are stored, the last one for its output.
    assert batch[:2] == [BlockRemoved((h2,)), BlockRemoved((h1,))]
    assert batch[3] == BlockRemoved((h0,))
    (new,) = stored([batch])
    assert (new.parent_block_hash, new.token_ids) == (None, tuple(prompt(12, salt=1)))
    model.kv.check_invariants()


def test_a_reset_clears_once_and_is_refused_while_sequences_run() -> None:
    recorder = KvEventRecorder(b"salt")
    model = make_model(recorder, itl_base=10 * MS)
    model.submit(0.0, prompt(12), max_tokens=3)
    recorder.take()
    assert not model.reset_prefix_cache(0.001)
    assert recorder.take() == []
    assert model.reset_prefix_cache(0.002, reset_running_requests=True)
    assert recorder.take() == [[AllBlocksCleared()]]
    assert model.kv.cached_blocks == 0
    model.advance(1.0)  # the sequence ends: its detached blocks are freed
    assert (model.kv.free, model.kv.used_blocks) == (64, 0)
    model.kv.check_invariants()
    model.submit(2.0, prompt(12), max_tokens=1)
    (again,) = stored(recorder.take())
    assert again.parent_block_hash is None and len(again.block_hashes) == 3
    assert model.reset_prefix_cache(3.0)
    assert recorder.take() == [[AllBlocksCleared()]]


def test_a_sequence_prefilling_across_a_reset_registers_nothing() -> None:
    recorder = KvEventRecorder(b"salt")
    model = make_model(recorder, prefill_base=10 * MS)
    model.submit(0.0, prompt(8), max_tokens=1)
    model.advance(1.0)
    model.submit(2.0, [*prompt(8), 5, 6, 7, 8, 9], max_tokens=1)  # hits 2 blocks, prefilling
    recorder.take()
    assert model.reset_prefix_cache(2.001, reset_running_requests=True)
    model.advance(3.0)
    assert recorder.take() == [[AllBlocksCleared()]]  # no store whose parent is gone
    assert (model.kv.cached_blocks, model.kv.used_blocks) == (0, 0)
    model.kv.check_invariants()


def test_published_hashes_are_salted_uint64_unlike_any_chain_a_consumer_computes() -> None:
    tokens = prompt(16)
    a, b = KvEventRecorder(b"one"), KvEventRecorder(b"two")
    for recorder in (a, b):
        make_model(recorder).submit(0.0, tokens, max_tokens=1)
    (event_a,), (event_b,) = stored(a.take()), stored(b.take())
    assert all(0 <= h < 2**64 for h in event_a.block_hashes)
    assert max(event_a.block_hashes) >= 2**63  # the full unsigned range (with these salts)
    assert not set(event_a.block_hashes) & set(event_b.block_hashes)
    own = set(hash_token_blocks(tokens, BS))
    gateway = set(token_chain(tokens, BS, token_root(None)))
    assert not set(event_a.block_hashes) & (own | gateway)
    assert chains([event_a])[event_a.block_hashes[-1]] == tokens


def test_an_adapter_s_blocks_are_its_own_and_name_it() -> None:
    recorder = KvEventRecorder(b"salt")
    model = make_model(recorder)
    model.submit(0.0, prompt(12), max_tokens=1)
    seq = model.submit(1.0, prompt(12), max_tokens=1, lora="sql-lora")
    assert seq.cached_tokens == 0  # the base model's blocks do not hit for an adapter
    base, adapter = stored(recorder.take())
    assert adapter.lora_name == "sql-lora" and adapter.parent_block_hash is None
    assert not set(base.block_hashes) & set(adapter.block_hashes)
    again = model.submit(2.0, [*prompt(12), 1, 2, 3, 4], max_tokens=1, lora="sql-lora")
    assert again.cached_tokens == 12


def test_changes_at_one_simulated_instant_are_one_batch() -> None:
    recorder = KvEventRecorder(b"salt")
    recorder.cleared(1.0)
    recorder.removed(1.0, [5, 6])
    recorder.cleared(2.0)
    batches = recorder.take()
    assert [len(batch) for batch in batches] == [3, 1]
    assert batches[0][1] == BlockRemoved((recorder.engine_hash(5),))


STORED = BlockStored(
    block_hashes=(2**64 - 5, 7),
    parent_block_hash=2**63 + 1,
    token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
    block_size=4,
    lora_name=None,
)
ADAPTER_STORED = BlockStored((9,), None, (1, 2, 3, 4), 4, "sql-lora")
EVENTS: list[KvEvent] = [STORED, ADAPTER_STORED, BlockRemoved((2**64 - 5,)), AllBlocksCleared()]


def test_map_encoding_decodes_to_vllm_0_26_s_maps_in_a_positional_batch() -> None:
    decoded = msgpack.unpackb(encode(1789095808.83, EVENTS, "map"))
    assert decoded == [
        1789095808.83,
        [
            {
                "type": "BlockStored",
                "block_hashes": [2**64 - 5, 7],
                "parent_block_hash": 2**63 + 1,
                "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {
                "type": "BlockStored",
                "block_hashes": [9],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": "sql-lora",
                "extra_keys": [["sql-lora"]],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {"type": "BlockRemoved", "block_hashes": [2**64 - 5], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    assert next(iter(decoded[1][0])) == "type"  # msgspec writes the tag first


def test_positional_encoding_decodes_to_older_vllm_s_arrays_tag_first() -> None:
    decoded = msgpack.unpackb(encode(12.5, EVENTS, "positional"))
    assert decoded == [
        12.5,
        [
            # tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
            # extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
            [
                "BlockStored",
                [2**64 - 5, 7],
                2**63 + 1,
                [1, 2, 3, 4, 5, 6, 7, 8],
                4,
                None,
                "GPU",
                None,
                [None, None],
                0,
                "full_attention",
                None,
            ],
            [
                "BlockStored",
                [9],
                None,
                [1, 2, 3, 4],
                4,
                None,
                "GPU",
                "sql-lora",
                [["sql-lora"]],
                0,
                "full_attention",
                None,
            ],
            ["BlockRemoved", [2**64 - 5], "GPU", 0],
            ["AllBlocksCleared"],
        ],
        0,
    ]


def test_hashes_above_2_63_travel_as_msgpack_uint64_and_ts_as_float64() -> None:
    payload = encode(12.5, [BlockRemoved((2**64 - 5,))], "positional")
    assert payload.startswith(b"\x93\xcb")  # a 3-array, then a float64
    assert b"\xcf" + (2**64 - 5).to_bytes(8, "big") in payload


@pytest.mark.parametrize(("start", "expected"), [(0, [3, 4, 5]), (4, [4, 5]), (9, [])])
def test_replay_ring_serves_from_start_or_the_oldest_kept(start: int, expected: list[int]) -> None:
    ring = ReplayRing(capacity=3)
    for _ in range(6):
        seq = ring.number()
        ring.keep(seq, f"batch {seq}".encode())
    assert [seq for seq, _ in ring.since(start)] == expected
    assert all(payload == f"batch {seq}".encode() for seq, payload in ring.since(start))
    ring.restart()
    assert (ring.number(), ring.since(0)) == (0, [])
