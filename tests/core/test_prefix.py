"""Prefix chains and the indexes of what endpoints hold (llmgw.core.prefix), property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.prefix import (
    ROOT,
    HeldIndex,
    PlacementTally,
    PromptPrefix,
    SentIndex,
    canonical_chat,
    canonical_prompt,
    pack,
    text_chain,
    token_chain,
    token_root,
    unpack,
)

BLOCK = 16
texts = st.binary(min_size=0, max_size=400)
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def common(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(texts, texts)
def test_two_text_chains_share_exactly_the_blocks_of_their_common_prefix(a: bytes, b: bytes):
    ca, cb = text_chain(a, BLOCK, 1000), text_chain(b, BLOCK, 1000)
    shared = next((i for i, (x, y) in enumerate(zip(ca, cb, strict=False)) if x != y), None)
    if shared is None:
        shared = min(len(ca), len(cb))
    expected = min(common(a, b) // BLOCK, len(ca), len(cb))
    assert shared == expected


@given(texts, st.integers(1, 40))
def test_a_text_chain_has_one_hash_per_full_block_up_to_its_bound(data: bytes, bound: int):
    assert len(text_chain(data, BLOCK, bound)) == min(len(data) // BLOCK, bound)


@given(token_lists, st.integers(1, 8), st.integers(0, 200))
def test_a_token_chain_continues_from_any_block_boundary(tokens: list[int], size: int, cut: int):
    whole = token_chain(tokens, size)
    cut = (min(cut, len(tokens)) // size) * size
    head = token_chain(tokens[:cut], size)
    tail = token_chain(tokens[cut:], size, parent=head[-1] if head else ROOT)
    assert head + tail == whole


def test_an_adapters_chain_differs_from_the_base_models():
    tokens = list(range(64))
    assert token_chain(tokens, 16) != token_chain(tokens, 16, parent=token_root("sql-lora"))
    assert token_root(None) == ROOT


@given(st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_a_packed_chain_unpacks_to_itself(chain: list[int]):
    assert unpack(pack(chain)) == tuple(chain)


def test_the_canonical_chat_ignores_json_layout_and_key_order_but_not_content():
    one = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    two = [{"content": "be brief", "role": "system"}, {"content": "hi", "role": "user"}]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi"},
    ]
    assert canonical_chat(one) == canonical_chat(two) == canonical_chat(parts)
    assert canonical_chat(one) != canonical_chat([{"role": "user", "content": "be brief"}])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    assert canonical_chat(one, tools) != canonical_chat(one)
    assert canonical_chat(one, tools) == canonical_chat(
        one, [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    )
    # A later turn extends the earlier one's bytes: its chain extends the earlier chain.
    later = [*one, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    first, second = canonical_chat(one), canonical_chat(later)
    assert first is not None and second is not None and second.startswith(first)
    assert canonical_chat("no") is None and canonical_chat([1]) is None
    assert canonical_prompt("completions", {"prompt": ["abc"]}) == b"abc"
    assert canonical_prompt("embeddings", {"input": "abc"}) is None


@given(st.lists(texts, min_size=1, max_size=12), st.integers(1, 30))
def test_what_a_sent_index_holds_of_a_chain_is_a_prefix_of_it(prompts, capacity: int):
    index = SentIndex(capacity)
    chains = [text_chain(p, BLOCK, 100) for p in prompts]
    for now, chain in enumerate(chains):
        index.record("e", chain, float(now))
    assert index.size("e") <= capacity
    for chain in chains:
        held = index.match("e", chain)
        # every block past the match is gone too: eviction takes a prefix's tail first
        assert all(index.match("e", chain[i : i + 1]) == 0 or i < held for i in range(len(chain)))
    last = chains[-1]
    assert index.match("e", last) == min(len(last), capacity)  # the latest is held


def test_a_sent_index_counts_recent_sends_only_when_asked_and_follows_its_capacity():
    index = SentIndex(100)
    old, new = text_chain(b"a" * 160, BLOCK, 100), text_chain(b"b" * 160, BLOCK, 100)
    index.record("e", old, 1.0)
    index.record("e", new, 5.0)
    assert index.match("e", old) == 10 and index.match("e", old, since=2.0) == 0
    assert index.match("e", new, since=2.0) == 10 and index.match("other", new) == 0
    index.set_capacity("e", 10)
    assert index.match("e", new) == 10 and index.match("e", old) == 0
    index.drop("e")
    assert index.size() == 0


def test_a_held_index_counts_each_store_until_as_many_removes():
    index = HeldIndex()
    chain = token_chain(list(range(64)), 16)
    index.store("e", chain)
    index.store("e", chain[:2])  # two requests computed the first blocks at once
    index.remove("e", chain[:2])
    assert index.match("e", chain) == 4
    index.remove("e", chain[1:2])
    assert index.match("e", chain) == 1  # a hole ends the match
    index.remove("e", [12345])  # a block it never held: nothing happens
    index.clear("e")
    assert index.match("e", chain) == 0


def test_a_prompt_prefix_says_what_share_a_match_covers():
    prefix = PromptPrefix(chain=(1, 2, 3), length=800, block_bytes=256)
    assert prefix.share(0) == 0.0 and prefix.share(2) == 512 / 800 and prefix.share(9) == 1.0
    assert PromptPrefix((), 0, 256).share(3) == 0.0


def test_a_block_costs_what_the_board_says_it_does():
    """The memory figures `PrefixBoard.memory_bytes` reports (and docs/architecture.md
    states): measured, with a margin for the interpreter's allocator."""
    import random
    import tracemalloc

    from llmgw.services.admission.prefixes import HELD_BYTES_PER_BLOCK, SENT_BYTES_PER_BLOCK

    blocks = 100_000
    draw = random.Random(7).getrandbits
    chain = [draw(64) for _ in range(blocks)]
    tracemalloc.start()
    try:
        sent = SentIndex(blocks)
        sent.record("e", chain, 1.0)
        sent_bytes = tracemalloc.get_traced_memory()[0]
        held = HeldIndex()
        held.store("e", chain)
        held_bytes = tracemalloc.get_traced_memory()[0] - sent_bytes
    finally:
        tracemalloc.stop()
    assert 0.7 * SENT_BYTES_PER_BLOCK <= sent_bytes / blocks <= 1.2 * SENT_BYTES_PER_BLOCK
    assert 0.5 * HELD_BYTES_PER_BLOCK <= held_bytes / blocks <= 1.2 * HELD_BYTES_PER_BLOCK


def _naive_tally(keep: int, placements: list[tuple[int, int, float]]) -> list[tuple]:
    """The tally written out: a new key in a full table evicts the least placed key, the
    first counted of those tied (a scan over every key)."""
    table: dict[int, list] = {}
    for key, blocks, at in placements:
        entry = table.get(key)
        if entry is None:
            if len(table) >= keep:
                del table[min(table, key=lambda k: table[k][0])]
            table[key] = [1, blocks, at]
        else:
            entry[0] += 1
            entry[1] = max(entry[1], blocks)
            entry[2] = max(entry[2], at)
    return [(key, count, blocks, at) for key, (count, blocks, at) in table.items()]


@given(
    keep=st.integers(1, 6),
    placements=st.lists(
        st.tuples(st.integers(0, 9), st.integers(1, 50), st.floats(0, 100)), max_size=300
    ),
)
def test_the_placement_tally_keeps_what_a_scan_for_the_least_placed_would_keep(keep, placements):
    tally = PlacementTally(keep)
    for key, blocks, at in placements:
        tally.add(key, blocks, at)
        assert len(tally) <= keep
    assert tally.items() == _naive_tally(keep, placements)
