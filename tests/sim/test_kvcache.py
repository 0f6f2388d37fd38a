"""KV block accounting: references, registration, LRU eviction of idle cached blocks."""

from __future__ import annotations

from llmgw.services.sim.kvcache import KVCache


def test_idle_cached_blocks_are_evicted_least_recently_released_first() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    for hashes in ([1, 2], [3, 4]):
        kv.admit([], prompt_blocks=2, reserve_blocks=0)
        for block_hash in hashes:
            assert kv.register(block_hash)
        kv.release(hashes, private_blocks=0, reserved=0)
    assert (kv.free, kv.cached_blocks, kv.used_blocks) == (0, 4, 0)
    assert kv.available() == 4
    kv.admit([], prompt_blocks=1, reserve_blocks=0)
    kv.check_invariants()
    # [1, 2] was released first, tail first: block 2 goes before block 1.
    assert kv.longest_prefix([1, 2]) == 1
    assert kv.longest_prefix([3, 4]) == 2


def test_reused_blocks_are_not_evictable_and_reservations_count() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    kv.admit([], prompt_blocks=2, reserve_blocks=0)
    kv.register(10)
    kv.register(11)
    kv.release([10, 11], private_blocks=0, reserved=0)
    assert kv.can_admit([10, 11], new_blocks=2)
    assert not kv.can_admit([10, 11], new_blocks=3)
    kv.admit([10, 11], prompt_blocks=1, reserve_blocks=1)
    assert kv.available() == 0 and kv.used_blocks == 3
    kv.grow()
    assert kv.used_blocks == 4 and kv.reserved == 0
    kv.check_invariants()


def test_registering_a_duplicate_hash_keeps_the_block_private() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    kv.admit([], prompt_blocks=2, reserve_blocks=0)
    assert kv.register(5)
    assert not kv.register(5)
    assert (kv.private, kv.cached_blocks) == (1, 1)
    kv.release([5], private_blocks=1, reserved=0)
    assert (kv.free, kv.idle_blocks) == (3, 1)
    kv.check_invariants()


def test_taking_a_block_returns_the_hash_it_evicted() -> None:
    kv = KVCache(num_blocks=3, block_size=16)
    assert kv.admit([], prompt_blocks=2, reserve_blocks=1) == []
    kv.register(1)
    kv.register(2)
    assert kv.grow() is None  # the free block
    kv.release([1, 2], private_blocks=1, reserved=0)  # tail first: 2 is evicted before 1
    assert kv.admit([], prompt_blocks=2, reserve_blocks=0) == [2]  # the free block, then 2
    assert kv.admit([], prompt_blocks=0, reserve_blocks=1) == []
    assert kv.grow() == 1
    kv.check_invariants()


def test_clear_frees_idle_blocks_and_detaches_those_in_use_until_released() -> None:
    kv = KVCache(num_blocks=6, block_size=16)
    kv.admit([], prompt_blocks=2, reserve_blocks=0)
    kv.register(1)
    kv.register(2)
    kv.release([1, 2], private_blocks=0, reserved=0)  # idle, cached
    kv.admit([1], prompt_blocks=2, reserve_blocks=0)  # sequence a: holds 1, registers 3
    kv.register(3)
    kv.admit([1, 3], prompt_blocks=1, reserve_blocks=0)  # sequence b: holds 1 and 3
    keys = kv.clear()
    assert set(keys) == {1, 3}  # in use; 2 was idle and is free again
    assert all(key >= 2**64 for key in keys.values())
    assert kv.cached_blocks == 0 and kv.longest_prefix([1, 3]) == 0
    assert (kv.free, kv.used_blocks) == (2, 4)
    kv.check_invariants()
    # The same hash registered again is another block, apart from the detached one.
    kv.admit([], prompt_blocks=1, reserve_blocks=0)
    assert kv.register(1)
    kv.release([keys[1], keys[3]], private_blocks=1, reserved=0)  # a ends
    assert kv.free == 2  # b still holds both detached blocks
    kv.release([keys[1], keys[3]], private_blocks=1, reserved=0)  # b ends: they are freed
    kv.release([1], private_blocks=0, reserved=0)
    assert (kv.free, kv.cached_blocks, kv.used_blocks) == (5, 1, 0)
    kv.check_invariants()
