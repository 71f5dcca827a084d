"""The step rules of the core restructure, each with its value worked out by hand: explicit draft
counts (and the loud async mistake), checks in the group's own code, lookahead capped at
max_model_len, verified KV published at retire, all-or-nothing free / retire, the linear
sliding-window lookup, typed step plans and read-only views."""

from __future__ import annotations

import pytest

from mambakv import (
    BlockPool,
    DoubleFreeError,
    InvalidDraftCountError,
    InvalidRequestError,
    MambaManager,
    Request,
    SlidingWindowManager,
)
from mambakv.groups import AlignStep, GroupKind
from mambakv.plans import EMPTY_STEP_PLAN
from tests.coord_helpers import coordinator, fa_spec, sw_spec, tokens
from tests.helpers import mamba_spec
from tests.regressions.util import admit, snapshot


def mamba_hashed(coord, gid: int) -> list[int]:
    return sorted(b.block_id for b in coord.block_pool.blocks if b.block_hash is not None and b.cache_group_id == gid)


# ---------------------------------------------------------------- explicit draft counts
def _async_decode(num_draft_tokens):
    """8-token prompt, FA + Mamba (block 4, nspec 2); 40 decode steps scheduled one step ahead
    of their outputs (the next token before the sampled one is appended)."""
    coord = coordinator(128, fa_spec(4), mamba_spec(4, nspec=2))
    req = Request("r", tokens(8))
    admit(coord, req)                                   # prefill 8: samples token 9
    pending = 8                                         # processed once the prefill's output is back
    for _ in range(40):
        kw = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
        assert coord.allocate(req, 1, **kw) is not None  # 1 token beyond the known ones
        req.num_computed_tokens += 1
        req.append_output_token_ids(7)                  # the previous step's output arrives
        coord.retire("r", pending)
        pending = req.num_computed_tokens
        coord.check_invariants()
    return coord


def test_async_placeholders_counted_as_drafts_fail_loudly():
    # Derived: computed 8 + 1 - num_tokens 8 = 1 "draft": the step is recorded as a verify step
    # starting at 7, so retiring the prefill's 8 processed tokens without its accept_drafts raises.
    with pytest.raises(InvalidDraftCountError, match="accept_drafts"):
        _async_decode(None)


def test_async_decode_with_explicit_draft_count_publishes_every_boundary():
    # num_draft_tokens=0: steps ending on 12, 16, ..., 44 tag their running block; after the last
    # retire (to 8 + 39 = 47 processed) the states at 8 (prefill) and 12..44 are published:
    # 1 + 9 = 10 Mamba states (the state at 48 is not processed yet).
    coord = _async_decode(0)
    assert len(mamba_hashed(coord, 1)) == 10


def test_retire_past_an_unverified_step_raises_and_changes_nothing():
    coord = coordinator(64, mamba_spec(4, nspec=2))
    req = Request("r", tokens(8))
    admit(coord, req)
    req.append_output_token_ids(5)                      # 9 tokens
    coord.retire("r", 8)
    assert coord.allocate(req, 3, num_draft_tokens=2) is not None  # 9 + 2 drafts = 11
    req.num_computed_tokens = 11
    before = snapshot(coord)
    with pytest.raises(InvalidDraftCountError):
        coord.retire("r", 9)                            # the step's results without accept_drafts
    assert snapshot(coord) == before
    coord.accept_drafts("r", 0)
    coord.retire("r", 9)                                # now settled: 8 + 1
    coord.check_invariants()


def test_manager_alone_refuses_more_drafts_than_scratch_blocks():
    m = MambaManager(mamba_spec(4, nspec=1), BlockPool(16))
    m.allocate_new_blocks("r", 8)
    before = (list(m.req_to_blocks["r"]), m.block_pool.get_num_free_blocks())
    with pytest.raises(InvalidDraftCountError):
        m.allocate_new_blocks("r", 12, num_draft_tokens=3)  # 1 + 3 drafts, 1 scratch block
    assert (list(m.req_to_blocks["r"]), m.block_pool.get_num_free_blocks()) == before
    assert m.accept_drafts("r", 0) == []                # no verify step was recorded
    with pytest.raises(InvalidDraftCountError):
        m.accept_drafts("r", 1)


def test_align_steps_are_named_cases():
    m = MambaManager(mamba_spec(4, nspec=0), BlockPool(16))
    cases = []
    for n in (6, 7, 8, 10, 5):  # new (slot 1); in place (7, 8 in slot 1); grow to slot 2; covered
        m.allocate_new_blocks("r", n)
        cases.append(m.get_table("r").last_step)
    assert cases == [AlignStep.NEW, AlignStep.IN_PLACE, AlignStep.IN_PLACE, AlignStep.GROW, AlignStep.COVERED]


# ---------------------------------------------------------------- lookahead capped
def test_lookahead_is_capped_at_max_model_len():
    # max_model_len 16, block 4: 14 tokens + 6 lookahead would need cdiv(20, 4) = 5 blocks; the
    # cap leaves 16 tokens = 4 blocks, and the call is not refused.
    coord = coordinator(32, fa_spec(4), max_model_len=16)
    req = Request("r", tokens(14))
    assert coord.allocate(req, 14, num_lookahead_tokens=6) is not None
    assert len(coord.get_block_ids("r")[0]) == 4
    assert coord.num_blocks_needed(Request("s", tokens(14)), 14, num_lookahead_tokens=6) == 4


# ---------------------------------------------------------------- verified KV at retire
def test_retire_publishes_attention_blocks_of_verified_tokens():
    # 6-token prompt (FA block 4): prefill publishes block 0 (tokens 0-3). One step of 1 token +
    # 3 drafts (6 + 4 = 10), all accepted: 4 tokens appended (11 known). retire(10) publishes
    # block 1 (tokens 4-7). A repeat of the first 10 tokens hits (10 - 1) // 4 * 4 = 8 tokens.
    coord = coordinator(32, fa_spec(4))
    req = Request("r", tokens(6))
    admit(coord, req)
    req.append_output_token_ids(50)
    coord.retire("r", 6)
    assert coord.allocate(req, 4, num_draft_tokens=3) is not None
    req.num_computed_tokens = 10
    req.append_output_token_ids([51, 52, 53])          # 3 accepted drafts + the bonus token: 10 tokens
    req.append_output_token_ids(54)
    coord.retire("r", 10)
    coord.free("r")
    _, hit = coord.get_computed_blocks(Request("again", list(req.all_token_ids[:10])))
    assert hit == 8


# ---------------------------------------------------------------- all or nothing
def test_free_after_a_misuse_raises_and_keeps_every_table():
    coord = coordinator(32, fa_spec(4), mamba_spec(4))
    req = Request("r", tokens(8))
    admit(coord, req)
    mamba_block = coord.block_pool.blocks[coord.get_block_ids("r")[1][-1]]
    coord.block_pool.free_blocks([mamba_block])          # the misuse: freed behind the coordinator
    free, ids = coord.block_pool.get_num_free_blocks(), coord.get_block_ids("r")
    with pytest.raises(DoubleFreeError):
        coord.free("r")
    assert coord.get_block_ids("r") == ids and coord.block_pool.get_num_free_blocks() == free
    assert coord.describe("r") is not None             # not forgotten: nothing leaked


def test_retire_that_cannot_free_leaves_the_table_as_it_was():
    # Sliding window 4, block 2: 8 processed tokens skip 8 - 3 = 5 tokens = 2 slots.
    m = SlidingWindowManager(sw_spec(2, 4), BlockPool(16))
    m.allocate_new_blocks("r", 8)
    table = list(m.req_to_blocks["r"])
    m.block_pool.free_blocks([table[1]])                 # the misuse
    with pytest.raises(DoubleFreeError):
        m.remove_skipped_blocks("r", 8)
    assert list(m.req_to_blocks["r"]) == table and m.get_table("r").retired_below == 0


# ---------------------------------------------------------------- sliding-window lookup
@pytest.mark.parametrize(("cached", "want"), [
    # block 2, window 5 (2 blocks before the end), hits end on a multiple of 4 tokens (2 blocks)
    ("yn yyyyn", 12),   # rightmost run: top 6, aligned end 6 -> blocks 4, 5: [null x 4, b4, b5]
    ("yynyn", 4),       # run 3..3 too short (end 4 needs blocks 2, 3); run 0..1 reaches block 0
    ("nyyy", 8),        # end 4 needs blocks 2, 3 (cached): [null, null, b2, b3]
    ("nnnn", 0),
])
def test_sliding_window_hit_is_found_in_one_right_to_left_scan(cached, want):
    cached = cached.replace(" ", "")
    pool = BlockPool(32)
    spec = sw_spec(2, 5)
    blocks = pool.get_new_blocks(len(cached))
    keys = [bytes([i + 1]) * 16 for i in range(len(cached))]
    for b, k, c in zip(blocks, keys, cached):
        if c == "y":
            pool.cache_full_blocks([b], [k], 0)
    (hit,) = SlidingWindowManager.find_longest_cache_hit(keys, 2 * len(cached), [0], pool, spec, 4)
    assert len(hit) * 2 == want
    real = [b for b in hit if not b.is_null]
    assert all(b.block_hash == keys[i] for i, b in enumerate(hit) if not b.is_null)
    assert len(real) == min(2, len(hit))


# ---------------------------------------------------------------- plans and views
def test_step_plan_is_typed_and_empty_when_nothing_happened():
    coord = coordinator(32, fa_spec(4), mamba_spec(4))
    assert coord.take_step_plan() is EMPTY_STEP_PLAN
    req = Request("r", tokens(9))
    admit(coord, req, 8)
    plan = coord.take_step_plan()
    fa_ids, mamba_ids = coord.get_block_ids("r")
    assert plan.group(0).new_block_ids == tuple(fa_ids)
    assert plan.group(1).zeros == (mamba_ids[1],) and plan.group(1).copies == ()
    assert coord.take_step_plan() is EMPTY_STEP_PLAN and coord.take_copy_plan() == {}
    view = coord.describe("r")
    assert view.num_scheduled == 8 and view.tables[1].running_slot == 1 and view.tables[1].positions == ((1, 8),)
    assert [m.kind for m in coord.managers] == [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]


def test_untaken_checkpoint_writes_are_dropped_at_the_next_step():
    # FA 4 + Mamba 4, a 9-token request: its prefill step lists one write (the running block,
    # position 8); an engine that never takes the writes must not accumulate them.
    coord = coordinator(32, fa_spec(4), mamba_spec(4))
    req = Request("r", tokens(9))
    coord.new_step()
    admit(coord, req, 8)
    running = coord.get_block_ids("r")[1][1]
    assert coord.take_checkpoint_writes() == {1: [("r", running, 8)]}
    coord.new_step()
    assert coord.allocate(req, 1, num_draft_tokens=0) is not None  # a step planned, writes not taken
    coord.new_step()
    assert coord.take_checkpoint_writes() == {}


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_schedule_step_equals_its_three_calls(in_flight):
    # The 480k replay loop at block 3584, nspec 5, both ways: identical tables and copy plans
    # at every step (the fused path is the same retire + count + grow).
    fused, calls = (MambaManager(mamba_spec(3584, nspec=5), BlockPool(64)) for _ in range(2))
    chunk = 8192 // 3584 * 3584
    for target in range(chunk, 480_031 + 1, chunk):
        processed = max(0, target - chunk - in_flight * chunk)
        fused.schedule_step("r", target, processed)
        calls.remove_skipped_blocks("r", processed)
        calls.get_num_blocks_to_allocate("r", target)
        calls.allocate_new_blocks("r", target)
        assert fused.describe("r")[1:] == calls.describe("r")[1:]  # block ids come from separate pools
        assert [b.block_id for b in fused.req_to_blocks["r"]] == [b.block_id for b in calls.req_to_blocks["r"]]
        assert fused.take_copy_plan() == calls.take_copy_plan()
        fused.check_invariants()


def test_schedule_step_of_a_follower_raises_before_any_change():
    # A follower's table is a read-only view of its leader's: its fused step once ran on it,
    # took a block for the leader's column and crashed with AttributeError. It is driven
    # through its leader: InvalidRequestError, nothing changed.
    pool = BlockPool(40)
    leader, follower = (MambaManager(mamba_spec(4, nspec=1), pool, kv_cache_group_id=g) for g in (0, 1))
    leader.share_policy([follower])
    leader.schedule_step("r", 4, 0)
    before = pool.get_num_free_blocks(), [[b.block_id for b in c] for c in leader.get_table("r").columns]
    with pytest.raises(InvalidRequestError):
        follower.schedule_step("r", 8, 4)
    assert (pool.get_num_free_blocks(), [[b.block_id for b in c] for c in leader.get_table("r").columns]) == before


def test_a_step_planned_before_a_verify_tags_no_boundary():
    # Mamba block 4, 1 scratch block. A 5-token prompt, output appended (6 tokens). Step k: 1 token
    # + 1 draft, main tokens 5 + 2 = 7 (running slot 1), awaiting its verify. Step k + 1 is planned
    # before that verify (async), from the optimistic 7: 1 token, main tokens 8 = slot 1's boundary.
    # Its state may hold the rejected draft, so slot 1 must not be tagged for publication at 8
    # (eager align tagged it, and a retire past 8 published a state one token short of its key).
    coord = coordinator(32, mamba_spec(4, nspec=1))
    req = Request("r", tokens(5))
    admit(coord, req)
    req.append_output_token_ids(9)
    coord.retire("r", 5)
    assert coord.allocate(req, 2, num_draft_tokens=1) is not None
    req.num_computed_tokens = 7
    assert coord.allocate(req, 1, num_draft_tokens=0) is not None
    assert coord.describe("r").tables[0].positions == ()
    coord.check_invariants()
