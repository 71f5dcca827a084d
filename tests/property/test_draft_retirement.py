"""Regression (found by the stateful fuzzer): retirement after a verify step whose drafts
moved the running slot past the block of the accepted position.

MambaManager alone, block 2, nspec 3, align mode, synchronous (retire before each allocate).
Slot i holds the state after ``(i + 1) * 2`` tokens; the running slot for ``n`` main tokens is
``cdiv(n, 2) - 1``; a request holds at most ``2 + nspec = 5`` state blocks (DESIGN.md 5.1).

    step 1  computed 0, 1 token             running slot cdiv(1, 2) - 1 = 0
            table  R0 S S S                 4 blocks (1 + nspec)
    step 2  computed 1, 1 token + 2 drafts  running slot cdiv(4, 2) - 1 = 1 (the old scratch
            table  R0 R1 S S N              block at slot 1 becomes running), 1 new block: 5
            verify: 0 accepted -> the state at 1 + 1 + 0 = 2 tokens is in slot 1
            retire(2): slot 0 (state at 1 token) is dead; the base rule frees only
            (2 - 1) // 2 = 0 slots, so it stayed
    step 3  computed 2, 1 token + 3 drafts  running slot cdiv(6, 2) - 1 = 2, 1 new block:
            table  0 R1 R2 S S S            5 blocks; before the fix slot 0 too: 6 > 5
"""

from __future__ import annotations

from tests.helpers import held, mamba_manager


def test_retire_frees_below_the_verified_state_slot() -> None:
    m = mamba_manager(2, nspec=3, num_blocks=16)
    m.allocate_new_blocks("r", 1)
    m.take_copy_plan()
    m.remove_skipped_blocks("r", 1)
    assert held(m.req_to_blocks["r"]) == 4

    m.allocate_new_blocks("r", 4, num_draft_tokens=2)
    assert held(m.req_to_blocks["r"]) == 5
    assert m.accept_drafts("r", 0) == []  # 0 accepted: the running block holds the state
    m.remove_skipped_blocks("r", 2)
    table = m.req_to_blocks["r"]
    assert table[0].is_null and held(table) == 4
    m.check_invariants()

    m.allocate_new_blocks("r", 6, num_draft_tokens=3)
    table = m.req_to_blocks["r"]
    assert [b.is_null for b in table] == [True, False, False, False, False, False]
    assert held(table) == 5 == 2 + 3
    m.check_invariants()
    assert m.block_pool.get_num_free_blocks() == 16 - 1 - 5


def test_retire_keeps_the_verified_state_until_it_is_processed() -> None:
    """Async lag: retiring to a count below the verified position leaves its slot rule alone."""
    m = mamba_manager(2, nspec=3, num_blocks=16)
    m.allocate_new_blocks("r", 1)
    m.allocate_new_blocks("r", 4, num_draft_tokens=2)
    m.accept_drafts("r", 0)  # state at 2 tokens in slot 1
    m.remove_skipped_blocks("r", 1)  # only 1 token processed: (1 - 1) // 2 = 0 slots, slot 0 kept
    assert not m.req_to_blocks["r"][0].is_null
    m.remove_skipped_blocks("r", 2)
    assert m.req_to_blocks["r"][0].is_null
    m.check_invariants()


def test_step_below_the_running_slot_after_rejected_drafts_runs_in_place() -> None:
    """Regression (found by the deep fuzz run): block 2, nspec 3.

    allocate 3 tokens          running slot cdiv(3, 2) - 1 = 1:  [0, R1, S, S, S]
    allocate 3 + 1 + 3 drafts  running slot cdiv(7, 2) - 1 = 3; scratch slot 2 relocated to the
                               end, slot 3's scratch block becomes running, 1 new block:
                               [0, R1, 0, R3, S, S, N]
    0 accepted                 the state at 4 tokens is in slot 3
    allocate 4 + 1 + 1 draft   cdiv(6, 2) - 1 = 2 < 3: the step must run in place in slot 3
                               (the state at 4 is there), record its verify, and after 1
                               accepted copy scratch slot 3 + 1 = 4 into slot 3. Before the
                               fix it was ignored and accept_drafts raised InvalidDraftCountError.
    """
    m = mamba_manager(2, nspec=3, num_blocks=16)
    m.allocate_new_blocks("r", 3)
    m.allocate_new_blocks("r", 7, num_draft_tokens=3)
    table = m.req_to_blocks["r"]
    assert [b.is_null for b in table] == [True, False, True, False, False, False, False]
    assert m.accept_drafts("r", 0) == []
    m.remove_skipped_blocks("r", 4)  # slot 3 holds the state at 4: slot 1 is dead
    assert held(m.req_to_blocks["r"]) == 4
    assert m.allocate_new_blocks("r", 6, num_draft_tokens=1) == []
    table = m.req_to_blocks["r"]
    assert m.accept_drafts("r", 1) == [(table[4].block_id, table[3].block_id)]
    assert held(table) == 4
    m.check_invariants()
