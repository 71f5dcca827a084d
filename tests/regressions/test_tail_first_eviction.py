"""Tail-first eviction of a freed prefix (llm-d inference-sim #704).

inference-sim #704: a freed request's blocks were queued head-first, so the next allocation
evicted the *first* block of the prefix and every later cached block became unreachable (a
hit scan stops at the first missing hash). The kind: a table is freed in reverse, so the
deepest blocks are evicted first and what remains is still a usable prefix.
"""

from __future__ import annotations

from mambakv import Request

from .util import admit, coordinator, fa, queue_ids, tokens


def test_deepest_block_is_evicted_first():
    # N = 4 (blocks 1, 2, 3), B = 4, full attention. A: 12 tokens -> [1, 2, 3], all hashed.
    coord = coordinator(4, fa(4))
    pool = coord.block_pool
    a = Request("a", tokens(12))
    admit(coord, a)
    assert coord.get_block_ids("a") == ([1, 2, 3],)
    coord.free("a")                             # reversed: 3, 2, 1 (all hashed) -> tail
    assert queue_ids(pool) == [3, 2, 1]
    one = Request("one", tokens(4, start=8000))
    hit, new = admit(coord, one)
    assert hit == 0 and new.get_block_ids() == ([3],)  # the deepest block is evicted
    a2 = Request("a2", tokens(12))
    blocks, hit = coord.get_computed_blocks(a2)
    assert hit == 8 and blocks.get_block_ids() == ([1, 2],)  # cap 11 -> 8: blocks 1, 2 still hit
    coord.check_invariants()


def test_hit_scan_stops_at_first_missing_hash():
    coord = coordinator(4, fa(4))
    pool = coord.block_pool
    admit(coord, Request("a", tokens(12)))
    coord.free("a")
    pool.evict_blocks([1])                      # the first block's data is gone
    blocks, hit = coord.get_computed_blocks(Request("a2", tokens(12)))
    assert hit == 0 and blocks.get_block_ids() == ([],)  # 2 is cached but unreachable
    coord.check_invariants()
