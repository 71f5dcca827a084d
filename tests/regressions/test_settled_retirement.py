"""Retirement on settled counts only (vLLM #47728).

vLLM #47728: blocks were retired with the optimistic (scheduled) token count while a step was
still in flight, freeing KV that the in-flight step still reads. ``retire`` takes the settled
count from the engine; the library refuses a count it can prove unsettled (more than any
``allocate`` covered, or more than the request's tokens) before changing anything, in every
group: a Mamba table retired past its running slot would lose its running state.
"""

from __future__ import annotations

import pytest

from mambakv import InvalidTokenCountError, Request

from .util import coordinator, mamba, snapshot, sw, tokens


def test_in_flight_step_is_not_retired():
    # Sliding window 128, B = 32. Skipped tokens at n processed: max(0, n - 128 + 1).
    coord = coordinator(16, sw(32, 128))
    pool = coord.block_pool
    req = Request("r", tokens(158))
    assert coord.allocate(req, 158).get_block_ids() == ([1, 2, 3, 4, 5],)  # cdiv(158, 32) = 5
    req.num_computed_tokens = 158
    coord.retire("r", 158)                  # 158 - 127 = 31 skipped -> 31 // 32 = 0 blocks
    req.append_output_token_ids(7)          # 159 tokens
    assert coord.allocate(req, 1).get_block_ids() == ([],)  # decode 158 -> 159: 5 blocks cover 160
    req.num_computed_tokens = 159           # scheduled, in flight: it attends tokens 31..158
    free = pool.get_num_free_blocks()
    coord.retire("r", 158)                  # settled count: frees 0
    assert pool.get_num_free_blocks() == free and coord.get_block_ids("r") == ([1, 2, 3, 4, 5],)
    coord.check_invariants()
    coord.retire("r", 159)                  # once the step settles: 159 - 127 = 32 -> 1 block
    assert pool.get_num_free_blocks() == free + 1 and coord.get_block_ids("r") == ([0, 2, 3, 4, 5],)
    coord.check_invariants()


def test_rejected_drafts_retire_to_the_settled_count():
    # Sliding window 8 + align Mamba (nspec 3), B = 4. Prompt 16, one output -> 17 tokens;
    # a verify step schedules 16 + 1 + 3 drafts = 20 main tokens; all 3 drafts are rejected.
    coord = coordinator(32, sw(4, 8), mamba(4, nspec=3))
    req = Request("r", tokens(16))
    coord.allocate(req, 16)
    req.num_computed_tokens = 16
    coord.retire("r", 16)
    req.append_output_token_ids(1)
    coord.allocate(req, 4)                  # 20 main tokens, 20 - 17 = 3 of them drafts
    req.num_computed_tokens = 20
    assert coord.accept_drafts("r", 0) == {}  # 0 accepted: the running block already holds 17
    req.num_computed_tokens = 17
    req.append_output_token_ids(2)          # the bonus token: 18 tokens
    before = snapshot(coord)
    with pytest.raises(InvalidTokenCountError):
        coord.retire("r", 20)               # 20 > 18 tokens: the optimistic count is refused
    assert snapshot(coord) == before
    # Settled 17: window skip 17 - 7 = 10 -> 2 blocks; 20 would have been 13 -> 3 blocks and
    # dropped tokens 10, 11, which the next step (position 17) still attends.
    # Tables by hand: step 1 gives the window [1, 2, 3, 4] and Mamba 1 + 3 blocks at running
    # slot 3: [0, 0, 0, 5, 6, 7, 8]; retire(16) frees window slots 0, 1 (16 - 7 = 9 -> 2).
    # Step 2 (20 tokens): the window gets block 9 (queue head), Mamba block 10 (running slot 4
    # reuses scratch 6; copy 5 -> 6).
    assert coord.get_block_ids("r") == ([0, 0, 3, 4, 9], [0, 0, 0, 5, 6, 7, 8, 10])
    coord.retire("r", 17)   # window: 2 slots, already retired; Mamba: 16 // 4 = 4 slots -> frees 5
    assert coord.get_block_ids("r") == ([0, 0, 3, 4, 9], [0, 0, 0, 0, 6, 7, 8, 10])
    assert coord.block_pool.blocks[6].block_hash is None  # the state at 17 is off its boundary 20
    coord.check_invariants()


def test_retire_past_anything_scheduled_is_refused():
    # Align Mamba, B = 4, nspec 2: a 20-token prompt of which only 8 are scheduled:
    # table [null, S, P1, P2]. retire(20) would skip 19 // 4 = 4 slots, freeing S, P1 and P2.
    coord = coordinator(16, mamba(4, nspec=2))
    req = Request("r", tokens(20))
    coord.allocate(req, 8)
    assert coord.get_block_ids("r") == ([0, 1, 2, 3],)
    before = snapshot(coord)
    for n in (9, 20):
        with pytest.raises(InvalidTokenCountError):
            coord.retire("r", n)            # never scheduled: 9 > 8
        assert snapshot(coord) == before
        with pytest.raises(InvalidTokenCountError):
            coord.managers[0].remove_skipped_blocks("r", n)  # the manager alone refuses it too
        assert snapshot(coord) == before
    coord.retire("r", 8)                    # fine: 7 // 4 = 1 slot (the null)
    assert coord.get_block_ids("r") == ([0, 1, 2, 3],)
    coord.check_invariants()
