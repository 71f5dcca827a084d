"""Resetting the prefix cache while requests run (vLLM #12284, #35157).

vLLM #12284 / #35157: a prefix-cache reset with running requests either failed forever (the
engine never drained) or dropped hashes from blocks still being written. The contract:
``reset_prefix_cache()`` returns False and changes nothing while any block is held; the
documented way to reset with running requests is ``preempt_all()`` first, after which the map
is empty, no block has a hash, every piece of the preempted requests' bookkeeping (tables,
scheduled counts, Mamba position tags, pending copies and zeroings) is gone, and a resumed
request builds a fresh table.
"""

from __future__ import annotations

from mambakv import Request

from .util import admit, coordinator, fa, hashed_ids, mamba, queue_ids, snapshot, tokens


def test_reset_refused_while_running_then_preempt_all():
    # N = 10 (blocks 1..9), B = 4, full attention.
    coord = coordinator(10, fa(4))
    pool = coord.block_pool
    a = Request("a", tokens(12))
    admit(coord, a)                                    # [1, 2, 3], 12 // 4 = 3 hashed
    e = Request("e", tokens(8, start=6000))
    admit(coord, e)                                    # [4, 5], hashed
    coord.free("e")                                    # two cached free blocks: queue 6..9, 5, 4
    assert coord.get_block_ids("a") == ([1, 2, 3],) and queue_ids(pool) == [6, 7, 8, 9, 5, 4]
    before = snapshot(coord)
    assert coord.reset_prefix_cache() is False
    assert snapshot(coord) == before and hashed_ids(pool) == [1, 2, 3, 4, 5]

    assert coord.preempt_all() == ["a"]
    assert a.num_computed_tokens == 0                  # it recomputes from scratch
    assert coord.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and hashed_ids(pool) == []
    assert pool.get_num_free_blocks() == 9 and coord.num_running_requests == 0
    assert all(m.num_requests == 0 for m in coord.managers) and coord.request_ids == []
    # a's blocks went back reversed (hashed then) -> tail: 6..9, 5, 4, 3, 2, 1; reset keeps order.
    assert queue_ids(pool) == [6, 7, 8, 9, 5, 4, 3, 2, 1]
    hit, new = admit(coord, a)
    assert hit == 0 and coord.get_block_ids("a") == ([6, 7, 8],)  # a fresh table
    coord.check_invariants()


def test_preempt_all_drops_pending_mamba_copies():
    # Full attention + align Mamba (nspec 1), B = 4, N = 16; a 12-token prompt in chunks 8 + 4.
    coord = coordinator(16, fa(4), mamba(4, nspec=1))
    a = Request("a", tokens(12))
    coord.allocate(a, 8)                               # full [1, 2]; Mamba [null, 3, 4] (4 scratch)
    a.num_computed_tokens = 8
    assert coord.take_zero_plan() == {1: [3]} and coord.take_copy_plan() == {}
    coord.retire("a", 8)                               # state at 8 (block 3) published
    coord.allocate(a, 4)                               # full [1, 2, 5]; running slot 2 reuses
    a.num_computed_tokens = 12                         # scratch 4, new scratch 6; copy 3 -> 4 pending
    assert coord.get_block_ids("a") == ([1, 2, 5], [0, 3, 4, 6])
    assert coord.reset_prefix_cache() is False
    assert coord.preempt_all() == ["a"]                # preempted before its step ran
    assert coord.take_copy_plan() == {} and coord.take_zero_plan() == {}  # the copy 3 -> 4 is gone
    assert coord.reset_prefix_cache() is True and hashed_ids(coord.block_pool) == []
    # Free order: full [5, 2, 1] (hashed) -> tail; Mamba [6, 4] (unhashed) -> head, 3 -> tail:
    # queue 6, 4, 7..15, 5, 2, 1, 3.
    assert queue_ids(coord.block_pool) == [6, 4, *range(7, 16), 5, 2, 1, 3]
    hit, _ = admit(coord, a)
    assert hit == 0
    assert coord.get_block_ids("a") == ([6, 4, 7], [0, 0, 8, 9])
    assert coord.take_zero_plan() == {1: [8]} and coord.take_copy_plan() == {}  # starts from zero
    coord.check_invariants()
