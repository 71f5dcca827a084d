"""Mamba retirement across null gaps (DESIGN.md 5.1, "The null-gap leak and the watermark").

`PreFixMambaManager` is a test-only model of vLLM's MambaManager before its fix, so that the
tests below are shown to have teeth: it leaks exactly where DESIGN.md says vLLM leaked."""

from __future__ import annotations

import pytest

from mambakv import BlockPool, MambaManager
from mambakv.groups import running_slot
from tests.helpers import held, mamba_manager, mamba_spec, pattern, replay_480k, retire_until_first_null


class PreFixMambaManager(MambaManager):
    """vLLM before its fix, as DESIGN.md 5.1 describes it (test-only):

    * ``retire_slots`` walks down from the highest skipped slot and stops at the first null
      (it assumes everything below a null was freed already); no watermark;
    * a separate "last-state retirement" at allocation time: when the table grows, the state
      from two allocations ago (the copy source of the previous growth) is freed if the last
      processed count reported to ``remove_skipped_blocks`` has passed its position
      (``processed > (slot + 1) * bs``: at equality the step that copies from it may still be
      in flight), otherwise forgotten, i.e. left to the walk.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_processed: dict[str, int] = {}
        self.prev_source: dict[str, int] = {}

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        self.last_processed[request_id] = num_processed_tokens
        super().remove_skipped_blocks(request_id, num_processed_tokens)

    retire_slots = retire_until_first_null

    def allocate_new_blocks(self, request_id, num_tokens, num_lookahead_tokens=0, **kw):
        st = self.get_table(request_id)
        if st is not None and st.running_slot >= 0 and running_slot(num_tokens, self.block_size) > st.running_slot:
            old = self.prev_source.get(request_id)
            self.prev_source[request_id] = st.running_slot
            if old is not None and st.blocks[old] is not self.null_block \
                    and self.last_processed.get(request_id, 0) > (old + 1) * self.block_size:
                block, st.blocks[old] = st.blocks[old], self.null_block
                st.positions.pop(old, None)
                self.block_pool.free_blocks([block])
        return super().allocate_new_blocks(request_id, num_tokens, num_lookahead_tokens, **kw)

    def free(self, request_id: str) -> None:
        self.last_processed.pop(request_id, None)
        self.prev_source.pop(request_id, None)
        super().free(request_id)


def prefix_manager(block_size: int, nspec: int = 0, num_blocks: int = 64) -> PreFixMambaManager:
    return PreFixMambaManager(mamba_spec(block_size, nspec), BlockPool(num_blocks))


# ---------------------------------------------------------------- teeth: the 480k replay
# Block 3584: chunk 8192 // 3584 * 3584 = 7168 = 2 blocks, so the running slot moves 1, 3, 5..
# and every even slot is null (slot 0 padding, then each relocated scratch slot). Before
# allocation k + 1 with f chunks in flight, processed = 2 (k - f) blocks, so the walk starts at
# slot (2 (k - f) bs - 1) // bs - 1 = 2 (k - f) - 2: even, null -> it frees nothing, ever. All
# freeing is the last-state retirement of slot 2k - 3 (position (2k - 2) bs):
#   f = 0: processed 2k bs > (2k - 2) bs -> freed: 2 states + 5 scratch = 7;
#   f >= 1: processed <= (2k - 2) bs -> forgotten for good (the walk never reaches it).
# 480,031 tokens = 67 chunks (66 full + 6943); after allocation n: running 2n - 1, source 2n - 3,
# forgotten 1, 3, .., 2n - 5 (n - 2 states), 5 scratch -> n + 5 = 72 at n = 67.
# vLLM's own replay (../shared/peer/vllm_replay.py) stops at the last full chunk: n = 66 -> 71,
# the figure DESIGN.md quotes.
# Block 4608: chunk = 1 block, no relocation, no interior gap: the walk always finds the
# forgotten state just above the last null it made, so 7 / 8 / 9 as with the fix.
@pytest.mark.parametrize("in_flight", [1, 2])
def test_prefix_walk_leaks_at_block_3584(in_flight):
    m = prefix_manager(3584, nspec=5, num_blocks=128)
    assert replay_480k(m, in_flight=in_flight) == 72
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == 127  # held until the request ends


@pytest.mark.parametrize("in_flight", [1, 2])
def test_prefix_walk_leak_matches_vllm_measurement(in_flight):
    m = prefix_manager(3584, nspec=5, num_blocks=128)
    assert replay_480k(m, in_flight=in_flight, total=66 * 7168) == 71


@pytest.mark.parametrize("block_size,in_flight,peak",
                         [(3584, 0, 7), (4608, 0, 7), (4608, 1, 8), (4608, 2, 9)])
def test_prefix_walk_no_leak_cases(block_size, in_flight, peak):
    m = prefix_manager(block_size, nspec=5, num_blocks=128)
    assert replay_480k(m, in_flight=in_flight) == peak
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == 127


# ---------------------------------------------------------------- null gaps
def build_gap_table(m: MambaManager, rid: str = "r") -> list:
    """Block 4, nspec 0: chunks ending at 4, 12 and 16, none retired yet::

        alloc 4  -> running slot 0                 [old]
        alloc 12 -> running slot 2, pad slot 1     [old, null, committed]        copy 0 -> 2
        alloc 16 -> running slot 3                 [old, null, committed, in_flight]  copy 2 -> 3
    """
    for n in (4, 12, 16):
        m.allocate_new_blocks(rid, n)
    m.take_copy_plan(), m.take_zero_plan()
    return list(m.req_to_blocks[rid])


def test_null_gap_retire_frees_old_only():
    # 12 processed -> 11 skipped -> slots [0, 11 // 4 = 2) retire: old (slot 0) and the null.
    # committed (slot 2, state at 12) stays: the in-flight step copies from it.
    m = mamba_manager(4)
    old, _, committed, in_flight = build_gap_table(m)
    assert pattern(m.req_to_blocks["r"]) == "1 0 1 1"
    free = m.block_pool.get_num_free_blocks()
    m.remove_skipped_blocks("r", 12)
    assert m.req_to_blocks["r"] == [m.null_block, m.null_block, committed, in_flight]
    assert old.ref_cnt == 0 and m.block_pool.get_num_free_blocks() == free + 1
    m.check_invariants()
    m.remove_skipped_blocks("r", 12)  # twice in a row: nothing more
    assert m.req_to_blocks["r"] == [m.null_block, m.null_block, committed, in_flight]
    assert m.block_pool.get_num_free_blocks() == free + 1
    m.check_invariants()


def test_null_gap_has_teeth():
    # The pre-fix walk starts at slot 1 (null) and stops: `old` is never freed.
    m = prefix_manager(4)
    old, *_ = build_gap_table(m)
    m.remove_skipped_blocks("r", 12)
    assert m.req_to_blocks["r"][0] is old and old.ref_cnt == 1


def test_reused_request_id_retires_from_slot_zero():
    # After free the watermark (3 after retiring at 16) is dropped: the same id starts clean.
    m = mamba_manager(4)
    build_gap_table(m)
    m.remove_skipped_blocks("r", 16)  # 15 // 4 = 3 slots: watermark 3
    m.free("r")
    assert m.block_pool.get_num_free_blocks() == 63
    m.allocate_new_blocks("r", 4)   # [a]
    m.allocate_new_blocks("r", 8)   # [a, b], copy a -> b
    a = m.req_to_blocks["r"][0]
    m.remove_skipped_blocks("r", 8)  # 7 // 4 = 1 slot: slot 0 retires (a stale watermark 3 would skip it)
    assert m.req_to_blocks["r"][0] is m.null_block and a.ref_cnt == 0
    assert held(m.req_to_blocks["r"]) == 1
    m.check_invariants()


def test_interleaved_gaps_leave_one_live_state():
    # Block 4, nspec 0, chunks [0,8), [8,16), [16,24) all scheduled (2 in flight), then retire:
    #   alloc 8  -> running slot 1:  [0, s1]
    #   alloc 16 -> running slot 3:  [0, s1, 0, s3]          copy s1 -> s3
    #   alloc 24 -> running slot 5:  [0, s1, 0, s3, 0, s5]   copy s3 -> s5
    # retire 16: 15 // 4 = 3 slots -> frees s1 (s3, the state at 16, feeds the step to 24)
    # retire 24: 23 // 4 = 5 slots -> frees s3. Live: s5, the running block, which holds the
    # state at 24 (with nspec 0 there is no scratch): the only state the request still needs.
    for cls, live_after in ((MambaManager, (2, 1)), (PreFixMambaManager, (3, 3))):
        m = cls(mamba_spec(4), BlockPool(16))
        for n in (8, 16, 24):
            m.allocate_new_blocks("r", n)
        s5 = m.req_to_blocks["r"][5]
        m.remove_skipped_blocks("r", 16)
        assert held(m.req_to_blocks["r"]) == live_after[0]
        m.remove_skipped_blocks("r", 24)
        assert held(m.req_to_blocks["r"]) == live_after[1]  # pre-fix: both walks start on a null
        m.check_invariants()
        if cls is MambaManager:
            assert pattern(m.req_to_blocks["r"]) == "0 0 0 0 0 1" and m.req_to_blocks["r"][5] is s5
            assert m.block_pool.get_num_free_blocks() == 15 - 1
