"""The one-pass pool forms (``mambakv.core.pool_fused``) and the helpers of the chunk path,
each against hand-worked values or the two ordinary calls they stand in for."""

from __future__ import annotations

from mambakv import BlockPool, KVCacheBlock
from mambakv.core.pool_fused import cache_then_free, get_then_cache
from mambakv.groups.tables import real_slots

H = [bytes([i]) * 16 for i in range(8)]


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything the two-call and the one-pass forms must agree on."""
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash, b.cache_group_id) for b in pool.blocks],
            {g: {h: (e.block_id if isinstance(e, KVCacheBlock) else sorted(e)) for h, e in m.items()}
             for g, m in pool.cached_block_hash_to_block.items()},
            pool.num_evictions)


def cached_and_freed(num_blocks: int) -> BlockPool:
    """A pool whose blocks 1 and 2 were cached under H[0], H[1] and freed (the queue reads
    3 .. num_blocks - 1, then 1, 2)."""
    pool = BlockPool(num_blocks)
    old = pool.get_new_blocks(2)
    pool.cache_full_blocks(old, H[:2], 0)
    pool.free_blocks(old)
    return pool


def take_4_publish_3(num_blocks: int) -> tuple[BlockPool, list[KVCacheBlock] | None]:
    """``get_then_cache(4 blocks, H[4:7])`` on one ``cached_and_freed`` pool; asserts it ends
    as ``get_new_blocks(4)`` then ``cache_full_blocks`` of the first 3 does on another."""
    fused, plain = cached_and_freed(num_blocks), cached_and_freed(num_blocks)
    new = get_then_cache(fused, 4, H[4:7], 0)
    two = plain.get_new_blocks(4)
    plain.cache_full_blocks(two[:3], H[4:7], 0)
    assert snapshot(fused) == snapshot(plain)
    return fused, new


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


def test_fused_calls_is_false_for_a_pool_that_overrides_a_call() -> None:
    class NotingPool(BlockPool):
        def free_blocks(self, blocks):  # type: ignore[no-untyped-def]
            super().free_blocks(blocks)

    assert BlockPool(8).fused_calls
    pool = NotingPool(8)
    assert not pool.fused_calls
    assert get_then_cache(pool, 2, H[:2], 0) is None  # the caller makes the two calls
    assert pool.free_block_queue.num_free_blocks == 7


def test_get_then_cache_equals_get_then_cache_full_blocks() -> None:
    """Hand count: 10 blocks; blocks 1 and 2 cached and freed, so the queue reads
    3..9, 1, 2. Taking 4 with 3 hashes pops 3, 4, 5, 6 (none hashed: nothing evicted) and
    publishes 3, 4, 5 under h4..h6 in group 0."""
    fused, new = take_4_publish_3(10)
    assert new is not None and [b.block_id for b in new] == [3, 4, 5, 6]
    assert [b.block_hash for b in new] == [H[4], H[5], H[6], None]
    assert fused.cached_block_hash_to_block[0][H[5]] is new[1]


def test_get_then_cache_refuses_a_hash_the_group_has() -> None:
    pool = BlockPool(10)
    old = pool.get_new_blocks(1)
    pool.cache_full_blocks(old, [H[1]], 0)
    before = snapshot(pool)
    assert get_then_cache(pool, 2, [H[0], H[1]], 0) is None  # H[1] is group 0's already
    assert snapshot(pool) == before
    assert get_then_cache(pool, 2, [H[0], H[1]], 1) is not None  # new to group 1


def test_cache_then_free_equals_the_two_calls() -> None:
    """Three states (one per group) published under one hash, then two blocks freed: one
    cached (to the tail), one not (to the head)."""
    pools = []
    for _ in range(2):
        pool = BlockPool(10)
        held = pool.get_new_blocks(5)  # blocks 1..5
        pool.cache_full_blocks([held[3]], [H[7]], 0)  # block 4 cached: freed to the tail
        pools.append((pool, held))
    (fused, f), (plain, p) = pools
    cache_then_free(fused, f[:3], H[2], (0, 1, 2), [f[3], f[4]])
    plain.cache_state_blocks(p[:3], H[2], (0, 1, 2))
    plain.free_blocks([p[3], p[4]])
    assert snapshot(fused) == snapshot(plain)
    assert [b.block_id for b in fused.free_block_queue.get_all_free_blocks()][0] == 5  # unhashed: head
    assert [b.block_id for b in fused.free_block_queue.get_all_free_blocks()][-1] == 4  # hashed: tail


def test_cache_then_free_leaves_the_null_block_unpublished() -> None:
    """The null block is never hashed: the one-pass form declines and the ordinary call skips it."""
    pool = BlockPool(4)
    before = snapshot(pool)
    cache_then_free(pool, [pool.null_block], H[3], (0,), [])
    assert pool.null_block.block_hash is None and snapshot(pool) == before


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


def test_get_then_cache_evicts_a_cached_block_it_takes_past_the_hashes() -> None:
    """Hand count: 6 blocks; 1 and 2 cached under h0, h1 and freed (queue 3, 4, 5, 1, 2).
    Taking 4 with 3 new hashes publishes 3, 4, 5 and takes block 1 unhashed: h0 is evicted
    (one eviction), h1 stays, as with get_new_blocks(4) then cache_full_blocks of the first 3."""
    fused, new = take_4_publish_3(6)
    assert new is not None and [b.block_id for b in new] == [3, 4, 5, 1]
    assert fused.num_evictions == 1 and new[3].block_hash is None
    assert list(fused.cached_block_hash_to_block[0]) == [H[1], H[4], H[5], H[6]]
    fused.check_invariants()
