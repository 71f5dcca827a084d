"""MambaManager in align mode (DESIGN.md 5.1): the worked example, the 480k replay bound,
relocation, speculative decoding, mode NONE and bad input. Values are worked out by hand in
the comments; the manager is driven directly (no coordinator)."""

from __future__ import annotations

import pytest

from mambakv import BlockPool, InvalidDraftCountError, InvalidTokenCountError, MambaKVError, MambaManager, Request
from tests.helpers import held, mamba_manager, mamba_spec, pattern, replay_480k


def slot_of(blocks, block_id: int) -> int:
    return next(i for i, b in enumerate(blocks) if b.block_id == block_id)


def slot_pairs(manager: MambaManager, rid: str, pairs) -> list[tuple[int, int]]:
    """(src, dst) block-id pairs as (slot, slot) in the request's current table."""
    blocks = manager.req_to_blocks[rid]
    return [(slot_of(blocks, s), slot_of(blocks, d)) for s, d in pairs]


# ---------------------------------------------------------------- the worked example
# block 560, nspec 3; prompt 5600 scheduled 2800, 2240, 560, then 1 token + 3 drafts.
#   step 1: running slot cdiv(2800, 560) - 1 = 4; 4 nulls, running + 3 scratch      -> 8 entries
#   step 2: retire to 2800 (skipped 2799 -> 4 slots, all null); running cdiv(5040,560)-1 = 8;
#           scratch 5,6,7 lie below 8 -> relocated to 8,9,10, one new block at 11; copy 4 -> 8
#   step 3: retire to 5040 (5039 // 560 = 8 slots: frees slot 4); running 10 - 1 = 9, which is
#           the old scratch slot 9: nothing relocated, 1 new block (slot 12); copy 8 -> 9
#   step 4: retire to 5600 (5599 // 560 = 9 slots: frees slot 8); running cdiv(5604,560)-1 = 10;
#           1 new block (slot 13); copy 9 -> 10
WORKED = [
    (0, 2800, 0, "0 0 0 0 1 1 1 1", []),
    (2800, 2240, 0, "0 0 0 0 1 0 0 0 1 1 1 1", [(4, 8)]),
    (5040, 560, 0, "0 0 0 0 0 0 0 0 1 1 1 1 1", [(8, 9)]),
    (5600, 4, 3, "0 0 0 0 0 0 0 0 0 1 1 1 1 1", [(9, 10)]),
]


def test_worked_example_tables_and_copies():
    m = mamba_manager(560, nspec=3)
    free0 = m.block_pool.get_num_free_blocks()
    for computed, scheduled, drafts, table, copies in WORKED:
        m.remove_skipped_blocks("r", computed)
        m.allocate_new_blocks("r", computed + scheduled, num_draft_tokens=drafts)
        m.check_invariants()
        blocks = m.req_to_blocks["r"]
        assert pattern(blocks) == table
        assert slot_pairs(m, "r", m.take_copy_plan()) == copies
        # held = running + 3 scratch (+ the copy source from step 2 on)
        assert free0 - m.block_pool.get_num_free_blocks() == held(blocks)
    # step 1 had no hit: its running block (slot 4 then) starts from zero; later steps copy.
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == free0


def test_worked_example_first_step_zeroes_running_block():
    m = mamba_manager(560, nspec=3)
    m.allocate_new_blocks("r", 2800)
    assert m.take_zero_plan() == [m.req_to_blocks["r"][4].block_id]
    assert m.take_copy_plan() == []


def test_worked_example_relocation_reuses_scratch_blocks():
    # Step 2: the scratch blocks of slots 5, 6, 7 move to 8, 9, 10 (same block ids, no copy);
    # only slot 11 is new, so exactly one block leaves the free queue.
    m = mamba_manager(560, nspec=3)
    m.allocate_new_blocks("r", 2800)
    scratch = [b.block_id for b in m.req_to_blocks["r"][5:8]]
    free_before = m.block_pool.get_num_free_blocks()
    m.remove_skipped_blocks("r", 2800)
    new = m.allocate_new_blocks("r", 5040)
    blocks = m.req_to_blocks["r"]
    assert [b.block_id for b in blocks[8:11]] == scratch
    assert len(new) == 1 and new[0] is blocks[11]
    assert free_before - m.block_pool.get_num_free_blocks() == 1
    for b in blocks[8:]:  # running (relocated) + scratch: writable, unshared, unpublished
        assert b.ref_cnt == 1 and b.block_hash is None
    m.check_invariants()


# ---------------------------------------------------------------- the 480k replay bound
# Bound 2 + nspec + in_flight = 2 + 5 + {0, 1, 2} = 7, 8, 9 (DESIGN.md 5.1, "The bound").
@pytest.mark.parametrize("block_size", [3584, 4608])
@pytest.mark.parametrize("in_flight,peak", [(0, 7), (1, 8), (2, 9)])
def test_480k_replay_peak_and_all_blocks_back(block_size, in_flight, peak):
    m = mamba_manager(block_size, nspec=5, num_blocks=128)
    free0 = m.block_pool.get_num_free_blocks()
    assert replay_480k(m, in_flight=in_flight) == peak
    m.free("r")
    m.check_invariants()
    m.block_pool.check_invariants()
    assert m.block_pool.get_num_free_blocks() == free0 == 127
    assert "r" not in m.req_to_blocks


# ---------------------------------------------------------------- speculative decoding
def test_accept_drafts_copies_last_accepted_scratch():
    # Worked example step 4: running slot 10, scratch slots 11, 12, 13 hold the states after
    # drafts 1, 2, 3. Accepting 3 drafts -> scratch of draft 3 (slot 13) into slot 10.
    m = mamba_manager(560, nspec=3)
    for computed, scheduled, drafts, _, _ in WORKED:
        m.remove_skipped_blocks("r", computed)
        m.allocate_new_blocks("r", computed + scheduled, num_draft_tokens=drafts)
    m.take_copy_plan()
    assert slot_pairs(m, "r", m.accept_drafts("r", 3)) == [(13, 10)]
    m.check_invariants()


@pytest.mark.parametrize("accepted,pairs", [(0, []), (1, [(3, 2)]), (2, [(4, 2)])])
def test_accept_drafts_pairs(accepted, pairs):
    # block 4, nspec 2: prefill 8 (running slot 1), decode 1 (running slot 2 = 9 tokens),
    # verify step 1 + 2 drafts = 12 tokens: still slot 2 (cdiv(12, 4) - 1), scratch 3 and 4.
    m = mamba_manager(4, nspec=2)
    m.allocate_new_blocks("r", 8)
    m.allocate_new_blocks("r", 9)
    assert m.allocate_new_blocks("r", 12, num_draft_tokens=2) == []
    assert slot_pairs(m, "r", m.accept_drafts("r", accepted)) == pairs
    m.check_invariants()


@pytest.mark.parametrize("accepted,published", [(2, True), (1, False), (0, False)])
def test_accept_drafts_position_tag_decides_publication(accepted, published):
    # Same steps as above. The running block (slot 2) holds the state after token
    # 12 - 2 drafts + accepted = 10 + accepted; only 12 == (2 + 1) * 4 is its boundary.
    req = Request("r", list(range(100, 113)))  # 13 tokens: block keys for slots 0..2
    m = mamba_manager(4, nspec=2)
    m.allocate_new_blocks("r", 8)
    m.allocate_new_blocks("r", 9)
    m.allocate_new_blocks("r", 12, num_draft_tokens=2)
    m.accept_drafts("r", accepted)
    m.cache_blocks(req, 12)
    blocks = m.req_to_blocks["r"]
    assert blocks[1].block_hash == req.block_hashes[1]  # state at 8 = slot 1's boundary
    assert (blocks[2].block_hash is not None) is published
    assert all(b.block_hash is None for b in blocks[3:])  # scratch never published
    m.check_invariants()


def test_accept_drafts_bad_count_raises_and_changes_nothing():
    m = mamba_manager(4, nspec=2)
    m.allocate_new_blocks("r", 8)
    m.allocate_new_blocks("r", 11, num_draft_tokens=2)
    for bad in (3, -1):
        with pytest.raises(InvalidDraftCountError):
            m.accept_drafts("r", bad)
    with pytest.raises(MambaKVError):
        m.accept_drafts("unknown", 1)
    # the pending verify step is still there: a valid count now works (1 accepted: slot 3 -> 2)
    assert slot_pairs(m, "r", m.accept_drafts("r", 1)) == [(3, 2)]


# ---------------------------------------------------------------- mode NONE
def test_mode_none_holds_one_plus_nspec_blocks():
    # Mamba-only model: block size = max_model_len = 1024; nspec 2 -> 3 blocks at any length.
    m = MambaManager(mamba_spec(1024, nspec=2, mode="none"), BlockPool(16))
    for n in (1, 10, 500, 1000, 1024):
        m.remove_skipped_blocks("r", max(0, n - 1))
        m.allocate_new_blocks("r", n)
        assert pattern(m.req_to_blocks["r"]) == "1 1 1"
        assert m.get_num_blocks_to_allocate("r", n) == 0  # running: never a new block
        m.check_invariants()
    assert m.block_pool.get_num_free_blocks() == 15 - 3
    assert m.take_copy_plan() == []
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == 15


# ---------------------------------------------------------------- counting and bad input
def test_get_num_blocks_to_allocate_matches_allocation():
    # new request: 1 + nspec = 4; running: 1 when the running slot moves, else 0; lookahead
    # tokens never add a Mamba block.
    m = mamba_manager(560, nspec=3)
    assert m.get_num_blocks_to_allocate("r", 2800) == 4
    m.allocate_new_blocks("r", 2800)
    assert m.get_num_blocks_to_allocate("r", 2800, num_lookahead_tokens=2000) == 0
    assert m.get_num_blocks_to_allocate("r", 5040) == 1
    free = m.block_pool.get_num_free_blocks()
    m.allocate_new_blocks("r", 5040, num_lookahead_tokens=3000)
    assert free - m.block_pool.get_num_free_blocks() == 1
    assert len(m.req_to_blocks["r"]) == 12  # cdiv(5040, 560) + 3, lookahead ignored


def test_fewer_tokens_than_table_covers_changes_nothing():
    m = mamba_manager(560, nspec=3)
    m.allocate_new_blocks("r", 2800)
    m.allocate_new_blocks("r", 5040)
    m.take_copy_plan(), m.take_zero_plan()
    ids = [b.block_id for b in m.req_to_blocks["r"]]
    free = m.block_pool.get_num_free_blocks()
    for n in (2800, 4000, 4480):  # all within slots the table already covers (running slot <= 8)
        assert m.get_num_blocks_to_allocate("r", n) == 0
        assert m.allocate_new_blocks("r", n) == []
    assert [b.block_id for b in m.req_to_blocks["r"]] == ids
    assert m.block_pool.get_num_free_blocks() == free
    assert m.take_copy_plan() == [] and m.take_zero_plan() == []
    m.check_invariants()


def test_bad_input_raises_and_changes_nothing():
    m = mamba_manager(4, nspec=1)
    m.allocate_new_blocks("r", 8)
    ids = [b.block_id for b in m.req_to_blocks["r"]]
    free = m.block_pool.get_num_free_blocks()
    for call in (lambda: m.remove_skipped_blocks("r", -1), lambda: m.allocate_new_blocks("r", 0),
                 lambda: m.allocate_new_blocks("r", -4), lambda: m.allocate_new_blocks("r", 12, num_draft_tokens=-1),
                 lambda: m.allocate_new_blocks("new", 0)):
        with pytest.raises(InvalidTokenCountError):
            call()
    assert issubclass(InvalidTokenCountError, MambaKVError)
    assert [b.block_id for b in m.req_to_blocks["r"]] == ids
    assert m.block_pool.get_num_free_blocks() == free
    assert set(m.req_to_blocks) == {"r"}
    m.check_invariants()


def test_retiring_or_freeing_unknown_request_is_noop():
    m = mamba_manager(4, nspec=1)
    free = m.block_pool.get_num_free_blocks()
    m.remove_skipped_blocks("ghost", 100)
    m.remove_skipped_blocks("ghost", 0)
    m.free("ghost")
    assert m.block_pool.get_num_free_blocks() == free and len(m.req_to_blocks) == 0
    m.check_invariants()
