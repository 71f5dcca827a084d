"""Speculative scratch blocks are never shared, pinned or hashed (vllm-ascend #16329).

vllm-ascend #16329: the scratch blocks that follow a Mamba running state (one per draft
position) were listed with the request's states (saved / offloaded, then hashed and shared),
and a call asking for fewer tokens than the table covered crashed on a negative block count.
The kind: scratch blocks have ref count 1 and no hash at all times, are excluded from the
state list an engine saves (``get_state_block_ids``), never become prefix hits, and a smaller
request is a no-op.
"""

from __future__ import annotations

from mambakv import BlockPool, MambaManager, Request

from .util import admit, coordinator, mamba, snapshot, tokens


def test_scratch_after_8_tokens():
    # Align Mamba, B = 4, nspec 2: running slot cdiv(8, 4) - 1 = 1, table [null, S, P1, P2].
    m = MambaManager(mamba(4, nspec=2), BlockPool(16))
    m.allocate_new_blocks("r", 8)
    table = m.req_to_blocks["r"]
    assert [b.block_id for b in table] == [0, 1, 2, 3]
    s, p1, p2 = table[1:]
    assert (p1.ref_cnt, p1.block_hash, p2.ref_cnt, p2.block_hash) == (1, None, 1, None)
    assert m.get_state_block_ids("r") == [1]          # S only: scratch is not a state to save
    assert m.take_zero_plan() == [1]
    ids, free = [b.block_id for b in table], m.block_pool.get_num_free_blocks()
    for n in (1, 4, 5, 8):                            # running slot 0 or 1: within the table
        assert m.get_num_blocks_to_allocate("r", n) == 0
        assert m.allocate_new_blocks("r", n) == []     # no-op, not a crash
    assert [b.block_id for b in table] == ids and m.block_pool.get_num_free_blocks() == free
    assert m.take_copy_plan() == [] and m.take_zero_plan() == []
    m.check_invariants()


def test_scratch_never_published_or_shared():
    coord = coordinator(16, mamba(4, nspec=2))
    pool = coord.block_pool
    a = Request("a", tokens(20))
    coord.allocate(a, 8)                              # [null, 1, 2, 3]
    a.num_computed_tokens = 8
    coord.retire("a", 8)                              # the state at 8 (block 1) is published
    assert [b.block_id for b in pool.blocks if b.block_hash is not None] == [1]
    # Fewer tokens than the table covers, through the coordinator: computed 0 + 4 -> slot 0.
    a.num_computed_tokens = 0
    before = snapshot(coord)
    assert coord.allocate(a, 4).get_block_ids() == ([],)
    assert snapshot(coord) == before
    a.num_computed_tokens = 8
    # A second request with the same 8 tokens + 4: hit [null, 1]; its own scratch is new.
    b = Request("b", tokens(12))
    hit, new = admit(coord, b)
    assert hit == 8 and coord.get_block_ids("b") == ([0, 1, 4, 5, 6],)  # running 4, scratch 5, 6
    assert pool.blocks[1].ref_cnt == 2                # the published state is shared
    for bid in (2, 3, 5, 6):                          # scratch: one holder, no hash
        assert pool.blocks[bid].ref_cnt == 1 and pool.blocks[bid].block_hash is None
    mgr = coord.managers[0]
    assert mgr.get_state_block_ids("a") == [1] and mgr.get_state_block_ids("b") == [1, 4]
    coord.check_invariants()


def test_scratch_reused_as_running_state_after_verify():
    # Decode with 2 drafts after the 8-token prefill: 8 + 1 + 2 = 11 main tokens, running slot
    # cdiv(11, 4) - 1 = 2 = old scratch P1 (writable), new scratch block 4 at the end:
    # [null, S, P1, P2, 4]; copy S -> P1; accept 1 draft -> copy scratch slot 3 (P2) -> P1.
    coord = coordinator(16, mamba(4, nspec=2))
    a = Request("a", tokens(8))
    coord.allocate(a, 8)
    a.num_computed_tokens = 8
    coord.retire("a", 8)
    a.append_output_token_ids(5)                      # 9 tokens
    coord.allocate(a, 3)                              # 9 + 2 drafts = 11
    assert coord.get_block_ids("a") == ([0, 1, 2, 3, 4],)
    assert coord.take_copy_plan() == {0: [(1, 2)]}
    assert coord.accept_drafts("a", 1) == {0: [(3, 2)]}
    a.append_output_token_ids([6, 7])                 # accepted draft + bonus: 11 tokens
    coord.retire("a", 10)                             # settled 8 + 1 + 1 = 10, off boundary 12
    assert [b.block_id for b in coord.block_pool.blocks if b.block_hash is not None] == [1]
    assert coord.managers[0].get_state_block_ids("a") == [2]  # S retired (9 // 4 = 2 slots)
    coord.check_invariants()
