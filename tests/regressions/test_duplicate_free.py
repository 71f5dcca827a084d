"""A repeated block id in one external list (vLLM #42571).

vLLM #42571: one ``free_blocks`` call listing the same block twice took its ref count below
zero and queued it twice, so the free count grew past the pool. The kind: every public entry
point that takes an external list of blocks must refuse a repeated (non-null) block before
any change: ``BlockPool.free_blocks``, ``BlockPool.touch`` (a table would hold the block twice
and could never be freed), ``FreeBlockQueue.append`` / ``append_n`` / ``prepend_n`` (a block
queued twice makes a cycle), and ``BlockPool.evict_blocks`` ids (out-of-range or negative ids
would index another block).
"""

from __future__ import annotations

import pytest

from mambakv import BlockPool, DoubleFreeError, FreeBlockQueue, InvalidBlockError, KVCacheBlock, MambaKVError

from .util import pool_snapshot, queue_ids


def holding_b1():
    """N = 4 (null + blocks 1, 2, 3), B = 4: a request holds [1]; free count 3 - 1 = 2."""
    pool = BlockPool(4)
    (b1,) = pool.get_new_blocks(1)
    assert b1.block_id == 1 and pool.get_num_free_blocks() == 2
    return pool, b1


def test_free_same_block_twice_raises_and_changes_nothing():
    pool, b1 = holding_b1()
    before = pool_snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b1, b1])
    assert pool_snapshot(pool) == before
    assert b1.ref_cnt == 1 and pool.get_num_free_blocks() == 2  # never -1 / never 4
    pool.check_invariants()
    pool.free_blocks([b1])  # the single free still works: 2 + 1 = 3 free
    assert b1.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    pool.check_invariants()


def test_free_shared_block_listed_twice_is_refused():
    # b1 at ref 2 (two tables): listing it twice in one call could pass a plain ref check
    # (2 - 1 - 1 = 0) but no table holds a block twice: refused.
    pool, b1 = holding_b1()
    pool.touch([b1])
    before = pool_snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b1, pool.null_block, b1])
    assert pool_snapshot(pool) == before and b1.ref_cnt == 2


def test_touch_repeated_block_raises_and_changes_nothing():
    # A hit list [b1, b1] would put b1 twice in one table (ref 2, one holder); its free would
    # then raise DoubleFreeError forever. Nulls may repeat: [null, null, b1] is a window hit.
    pool, b1 = holding_b1()
    pool.free_blocks([b1])  # b1 free (ref 0, queued)
    before = pool_snapshot(pool)
    for bad in ([b1, b1], [pool.null_block, b1, pool.null_block, b1], iter([b1, b1])):
        with pytest.raises(InvalidBlockError):
            pool.touch(bad)
        assert pool_snapshot(pool) == before
    pool.touch([pool.null_block, pool.null_block, b1])
    assert b1.ref_cnt == 1 and pool.null_block.ref_cnt == 0 and pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_queue_refuses_a_block_twice_and_rolls_back():
    b = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(b[:2])  # 0 1
    calls = [lambda: q.append(b[1]),                   # already queued
             lambda: q.append_n([b[2], b[3], b[2]]),   # repeated within the call
             lambda: q.append_n([b[2], b[0]]),         # second one already queued
             lambda: q.prepend_n([b[4], b[5], b[4]]),
             lambda: q.prepend_n([b[4], b[1]])]
    for call in calls:
        with pytest.raises(DoubleFreeError):
            call()
        q.check_invariants()
        assert [x.block_id for x in q.get_all_free_blocks()] == [0, 1] and q.num_free_blocks == 2
        assert all(x.prev_free_block is None and x.next_free_block is None for x in b[2:])
    q.append_n([b[2], b[3]])
    q.prepend_n([b[5], b[4]])
    assert [x.block_id for x in q.get_all_free_blocks()] == [5, 4, 0, 1, 2, 3]


def test_evict_blocks_bad_ids_raise_and_change_nothing():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [bytes([i]) * 16 for i in (1, 2, 3)], 0)
    pool.free_blocks(blocks)
    before = pool_snapshot(pool)
    for bad in ([-1], [4], [1, 99], [1.0]):  # -1 would silently evict block 3
        with pytest.raises(InvalidBlockError):
            pool.evict_blocks(bad)
        assert pool_snapshot(pool) == before
    pool.evict_blocks([3, 3, 0])  # a repeat and the null block are ignored
    assert [b.block_id for b in pool.blocks if b.block_hash is not None] == [1, 2]
    assert queue_ids(pool) == [3, 1, 2]  # block 3, unhashed now, is reused first
    pool.check_invariants()
    assert issubclass(InvalidBlockError, MambaKVError) and issubclass(DoubleFreeError, MambaKVError)
