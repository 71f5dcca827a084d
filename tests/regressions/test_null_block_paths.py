"""The null block in every path (vLLM #34367 / #34418, #42547).

vLLM #34367 / #34418: with Mamba prefix caching, null placeholders in a table moved the
"already cached" cursor past real blocks, so a later state was never hashed; vLLM #42547: the
null block was counted and freed like a real one. The kind: block 0 is never hashed, freed,
queued or counted (ref count 0, not in the queue, not in the map), and placeholders never make
a real block skip publication, whatever the manager (Mamba, sliding window).
"""

from __future__ import annotations

from mambakv import Request

from .util import admit, coordinator, hashed_ids, mamba, queue_ids, sw, tokens


def assert_null_untouched(coord) -> None:
    null = coord.block_pool.null_block
    assert null.ref_cnt == 0 and null.block_hash is None
    assert 0 not in queue_ids(coord.block_pool)
    coord.check_invariants()


def test_align_mamba_null_then_state_is_published():
    # Align Mamba, N = 16 (blocks 1..15), B = 4.
    coord = coordinator(16, mamba(4))
    pool = coord.block_pool
    a = Request("a", tokens(8))
    hit, new = admit(coord, a)
    assert (hit, new.get_block_ids()) == (0, ([1],))  # running slot cdiv(8, 4) - 1 = 1: [null, S], S = 1
    assert coord.get_block_ids("a") == ([0, 1],)
    coord.retire("a", 8)                          # state at 8 = slot 1's boundary (1 + 1) * 4: published
    assert hashed_ids(pool) == [1]                # exactly one block (S) hashed, never the null
    assert pool.get_num_free_blocks() == 14       # 15 - 1: the null is not counted
    coord.free("a")
    assert sorted(queue_ids(pool)) == list(range(1, 16))  # only real blocks come back: 15 free
    assert queue_ids(pool)[-1] == 1                        # S, hashed, at the LRU tail
    assert_null_untouched(coord)

    # Same 8 tokens + 4: the hit is capped at 12 - 1 = 11 -> 8 (a multiple of 4): [null, S].
    b = Request("b", tokens(8) + tokens(4, start=5000))
    hit, new = admit(coord, b)
    assert hit == 8 and new.get_block_ids() == ([2],)      # X = queue head 2 (queue 2..15, 1)
    assert coord.get_block_ids("b") == ([0, 1, 2],)        # [null, S, X]
    assert coord.take_copy_plan() == {0: [(1, 2)]}          # resume from S
    assert_null_untouched(coord)
    coord.retire("b", 12)  # state at 12 = slot 2's boundary: X published; 11 // 4 = 2 slots retire S
    assert hashed_ids(pool) == [1, 2]
    assert coord.get_block_ids("b") == ([0, 0, 2],)
    assert pool.blocks[1].ref_cnt == 0 and queue_ids(pool)[-1] == 1  # S back at the tail, still hashed
    assert_null_untouched(coord)
    coord.free("b")
    assert pool.get_num_free_blocks() == 15
    assert_null_untouched(coord)


def test_sliding_window_placeholders_do_not_skip_publication():
    # Sliding window 8, B = 4, N = 16. A: 16 tokens -> blocks 1..4, all full, all hashed.
    coord = coordinator(16, sw(4, 8))
    pool = coord.block_pool
    a = Request("a", tokens(16))
    admit(coord, a)
    coord.free("a")                    # reversed, hashed -> tail: queue 5..15, 4, 3, 2, 1
    assert queue_ids(pool)[-4:] == [4, 3, 2, 1]
    # B: the 16 tokens + 8 more (24). Cap 23 -> 20; slot 4 (tokens 16..20) is not cached, so the
    # window hit ends at 16 and needs cdiv(8 - 1, 4) = 2 blocks: [null, null, 3, 4].
    b = Request("b", tokens(24))
    hit, new = admit(coord, b)
    assert hit == 16 and new.get_block_ids() == ([5, 6],)
    assert coord.get_block_ids("b") == ([0, 0, 3, 4, 5, 6],)
    # The cursor starts after the 4 hit entries (2 of them null): slots 4, 5 get published.
    assert hashed_ids(pool) == [1, 2, 3, 4, 5, 6]
    assert_null_untouched(coord)
    coord.retire("b", 24)              # skipped 24 - 8 + 1 = 17 -> 4 slots: frees 4, then 3
    assert coord.get_block_ids("b") == ([0, 0, 0, 0, 5, 6],)
    assert queue_ids(pool)[-2:] == [4, 3]
    # C: the 24 tokens + 1: cap 24, window run at slots 4, 5 (held by b): hit 24.
    c = Request("c", tokens(25))
    blocks, hit = coord.get_computed_blocks(c)
    assert hit == 24 and blocks.get_block_ids() == ([0, 0, 0, 0, 5, 6],)
    # 7 blocks cover 25 tokens, 6 entries held, hits 5 and 6 are not in the queue: 1 block.
    assert coord.managers[0].get_num_blocks_to_allocate("c", 25, blocks.blocks[0]) == 1
    coord.allocate(c, 1, num_new_computed_tokens=24, new_computed_blocks=blocks)
    assert pool.blocks[5].ref_cnt == 2 and pool.blocks[6].ref_cnt == 2
    assert_null_untouched(coord)
    coord.free("b"), coord.free("c")
    assert pool.get_num_free_blocks() == 15
    assert_null_untouched(coord)
