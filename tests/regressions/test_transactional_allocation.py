"""Allocation is all or nothing (llm-d inference-sim #1061, SGLang #39787).

inference-sim #1061 / SGLang #39787: an allocation that ran out part way kept what it had
taken (a table grown by one block of two, a group allocated while another failed). The kind:
``allocate`` counts every group's need (new blocks + hits still in the free queue) first and
returns None with nothing changed when the pool is short; and once it proceeds, no group's new
blocks may come from another group's hits (all hits are pinned before any new block is taken).
"""

from __future__ import annotations

from mambakv import Request

from .util import admit, coordinator, fa, hashed_ids, mamba, queue_ids, snapshot, sw, tokens


def test_short_pool_changes_nothing():
    # N = 6 (blocks 1..5), B = 4. A holds [1, 2] (exactly 8 tokens), C holds [3, 4]: 1 free.
    coord = coordinator(6, fa(4))
    a, c = Request("a", tokens(16)), Request("c", tokens(8, start=5000))
    coord.allocate(a, 8)
    a.num_computed_tokens = 8
    coord.allocate(c, 8)
    assert coord.get_block_ids("a") == ([1, 2],) and coord.get_block_ids("c") == ([3, 4],)
    assert coord.block_pool.get_num_free_blocks() == 1
    before = snapshot(coord)
    assert coord.allocate(a, 5) is None      # 8 + 5 = 13 tokens -> cdiv(13, 4) = 4 blocks: 2 > 1 free
    assert snapshot(coord) == before
    assert coord.get_block_ids("a") == ([1, 2],) and [b.ref_cnt for b in coord.block_pool.blocks[1:]] == [1, 1, 1, 1, 0]
    coord.free("a"), coord.free("c")
    assert coord.block_pool.get_num_free_blocks() == 5
    coord.check_invariants()


def test_one_group_fits_the_other_does_not():
    # Full attention + align Mamba, B = 4, N = 5 (blocks 1..4). A: 8 tokens -> full [1, 2],
    # Mamba [null, 3]; 1 block free. 4 more tokens: full needs cdiv(12, 4) - 2 = 1 (fits alone),
    # Mamba's running slot moves 1 -> 2: 1 more. 2 > 1: None, neither group changes.
    coord = coordinator(5, fa(4), mamba(4))
    a = Request("a", tokens(12))
    coord.allocate(a, 8)
    a.num_computed_tokens = 8
    coord.take_zero_plan()
    assert coord.get_block_ids("a") == ([1, 2], [0, 3])
    before = snapshot(coord)
    assert coord.allocate(a, 4) is None
    assert snapshot(coord) == before
    assert coord.take_copy_plan() == {} and coord.take_zero_plan() == {}  # no copy was planned
    coord.retire("a", 8)                     # frees nothing (7 // 4 = 1 slot, a null)
    assert coord.block_pool.get_num_free_blocks() == 1
    coord.check_invariants()


def test_new_blocks_never_come_from_another_groups_hit():
    # Full attention + sliding window 8, B = 4, N = 9 (blocks 1..8).
    # P (8 tokens): full [1, 2], window [3, 4]; R (8 other tokens): full [5, 6], window [7, 8];
    # all hashed. Free P, then R: queue 2, 1, 4, 3, 6, 5, 8, 7 (each table reversed).
    coord = coordinator(9, fa(4), sw(4, 8))
    pool = coord.block_pool
    admit(coord, Request("p", tokens(8)))
    admit(coord, Request("r", tokens(8, start=3000)))
    coord.free("p"), coord.free("r")
    assert queue_ids(pool) == [2, 1, 4, 3, 6, 5, 8, 7]
    # Q: P's 8 tokens + 1. Hit 8: full [1, 2], window [3, 4] (cdiv(7, 4) = 2 blocks).
    # Need: full 1 new + 2 queued hits, window 1 new + 2 queued hits = 6 <= 8 free.
    # Pinning every hit first leaves 6, 5, 8, 7: full gets 6, window gets 5. Taking full's
    # block before the window's hits were pinned would hand out block 4 (a window hit) twice.
    q = Request("q", tokens(9))
    hit, new = admit(coord, q)
    assert hit == 8 and new.get_block_ids() == ([6], [5])
    assert coord.get_block_ids("q") == ([1, 2, 6], [3, 4, 5])
    assert pool.blocks[4].block_hash is not None and pool.blocks[4].ref_cnt == 1
    assert hashed_ids(pool) == [1, 2, 3, 4, 7, 8]  # 6 and 5 were evicted to be reused
    coord.check_invariants()                  # includes: no block in two groups' tables
