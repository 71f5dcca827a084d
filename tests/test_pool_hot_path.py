"""Pool and table helpers of the prefill hot path, against hand-worked values."""

from __future__ import annotations

from mambakv import BlockPool, KVCacheBlock
from mambakv.groups.mamba_table import real_slots

H = [bytes([i]) * 16 for i in range(8)]


def cached_and_freed(num_blocks: int) -> BlockPool:
    """A pool whose blocks 1 and 2 were cached under H[0], H[1] and freed (the queue reads
    3 .. num_blocks - 1, then 1, 2)."""
    pool = BlockPool(num_blocks)
    old = pool.get_new_blocks(2)
    pool.cache_full_blocks(old, H[:2], 0)
    pool.free_blocks(old)
    return pool


def test_real_slots_deepest_first_with_the_chunk_case_by_count() -> None:
    """Slots of `blocks` in [low, stop) that hold a real block, deepest first."""
    null, a, b = KVCacheBlock(0), KVCacheBlock(1), KVCacheBlock(2)
    blocks = [null, null, a, null, b, null]
    assert real_slots(blocks, 1, 6, null) == [4, 2]  # two real slots: the scan
    assert real_slots(blocks, 2, 4, null) == [2]  # the chunk's case: one real slot at low
    assert real_slots(blocks, 3, 4, null) == []  # all null
    assert real_slots(blocks, 1, 3, null) == [2]  # one real slot, not at low: the scan
    assert real_slots(blocks, 4, 5, null) == [4]
    assert real_slots(blocks, 2, 2, null) == []  # an empty span


def test_get_new_blocks_one_walk_keeps_queue_order_and_evicts() -> None:
    """Hand count: 6 blocks; blocks 1, 2 cached and freed (queue 3, 4, 5, 1, 2). Taking 4
    pops 3, 4, 5 and 1, evicting block 1's hash only."""
    pool = cached_and_freed(6)
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [3, 4, 5, 1]
    assert all(b.ref_cnt == 1 and b.prev_free_block is None and b.next_free_block is None for b in got)
    assert pool.num_evictions == 1 and got[3].block_hash is None
    assert list(pool.cached_block_hash_to_block[0]) == [H[1]]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [2]
    pool.check_invariants()
