"""Unhashed blocks first in the free queue (vLLM #42656).

vLLM #42656: freed blocks that held nothing reusable (partial, never hashed) went to the tail
with the cached ones, so the next allocation evicted cached prefixes while worthless blocks
waited. The kind: whatever frees a block (``free``, retirement, an unpublished Mamba state)
puts unhashed blocks at the head, hashed ones at the tail, and allocation takes the head.
"""

from __future__ import annotations

from mambakv import Request

from .util import admit, coordinator, fa, hashed_ids, mamba, queue_ids, tokens


def test_free_puts_unhashed_at_head_hashed_at_tail():
    # N = 8 (blocks 1..7), B = 4, full attention.
    coord = coordinator(8, fa(4))
    pool = coord.block_pool
    a = Request("a", tokens(10))
    b = Request("b", tokens(10, start=7000))
    admit(coord, a)                           # cdiv(10, 4) = 3 blocks: [1, 2, 3]; 10 // 4 = 2 hashed
    admit(coord, b)                           # [4, 5, 6]; 4, 5 hashed
    assert coord.get_block_ids("a") == ([1, 2, 3],) and coord.get_block_ids("b") == ([4, 5, 6],)
    assert hashed_ids(pool) == [1, 2, 4, 5]
    coord.free("a")                           # reversed 3, 2, 1: 3 -> head, 2, 1 -> tail
    assert queue_ids(pool) == [3, 7, 2, 1]
    coord.free("b")                           # reversed 6, 5, 4: 6 -> head, 5, 4 -> tail
    assert queue_ids(pool) == [6, 3, 7, 2, 1, 5, 4]
    c = Request("c", tokens(12, start=9000))
    hit, new = admit(coord, c)
    assert hit == 0 and new.get_block_ids() == ([6, 3, 7],)  # nothing cached was evicted
    assert hashed_ids(pool) == [1, 2, 3, 4, 5, 6, 7]  # c's 3 full blocks are hashed now too
    coord.free("c")
    a2 = Request("a2", tokens(10))
    hit, _ = admit(coord, a2)
    assert hit == 8 and coord.get_block_ids("a2")[0][:2] == [1, 2]  # cap 9 -> 8: [1, 2]
    coord.check_invariants()


def test_retired_unpublished_mamba_state_goes_to_head():
    # Align Mamba, B = 4, N = 8. A chunk ending at 6 leaves a state at 6 in slot 1 (boundary 8):
    # settled off its boundary, never published. The next chunk (to 12) puts the state at 12 in
    # slot 2 (block 2, copy 1 -> 2); retire(12) publishes it and retires 11 // 4 = 2 slots,
    # freeing block 1 (unhashed) -> head.
    coord = coordinator(8, mamba(4))
    pool = coord.block_pool
    a = Request("a", tokens(16))
    coord.allocate(a, 6)
    a.num_computed_tokens = 6
    coord.retire("a", 6)
    assert coord.get_block_ids("a") == ([0, 1],) and hashed_ids(pool) == []
    coord.allocate(a, 6)
    a.num_computed_tokens = 12
    coord.retire("a", 12)
    assert coord.get_block_ids("a") == ([0, 0, 2],) and hashed_ids(pool) == [2]
    assert queue_ids(pool) == [1, 3, 4, 5, 6, 7]
    coord.free("a")                           # block 2, hashed -> tail
    assert queue_ids(pool) == [1, 3, 4, 5, 6, 7, 2]
    coord.check_invariants()
