"""EAGLE / MTP back-off applied exactly once (vLLM #32802), DESIGN.md section 6.

vLLM #32802: with a drafter the hit must end one aligned block earlier (the drafter recomputes
the last hit position), and the back-off was applied inside each group's lookup as well as on
the result, so hybrid hits shrank twice (or to nothing). The rule: the fixed point L without
back-off, then the fixed point again from the aligned length below L, without back-off.
"""

from __future__ import annotations

from mambakv import Request

from .util import admit, coordinator, fa, mamba, sw, tokens


def test_full_plus_window_backs_off_once():
    # B = 4, full attention + sliding window 8; 20 tokens cached in both groups.
    for use_eagle, want_hit, want_blocks in (
        (False, 20, ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])),  # cap 21 - 1 = 20; window needs cdiv(7, 4) = 2
        (True, 16, ([1, 2, 3, 4], [0, 0, 8, 9])),          # 20 -> 16 once; not 12, 4 or 0
    ):
        coord = coordinator(16, fa(4), sw(4, 8), use_eagle=use_eagle)
        a = Request("a", tokens(20))
        coord.allocate(a, 20)  # full [1..5], window [6..10], all 20 // 4 = 5 blocks hashed
        assert coord.get_block_ids("a") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
        coord.free("a")
        b = Request("b", tokens(21))
        blocks, hit = coord.get_computed_blocks(b)
        assert hit == want_hit and blocks.get_block_ids() == want_blocks
        coord.allocate(b, 21 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        coord.check_invariants()


def test_single_window_group_backs_off_once():
    # Block 2, window 4, 8 tokens cached ([1, 2, 3, 4]), a 9-token request: cap 8.
    # Without EAGLE: end 8, cdiv(3, 2) = 2 blocks -> [null, null, 3, 4] = 8.
    # With EAGLE: 8 -> 6: [null, 2, 3] = 6.
    for use_eagle, want_hit, want_blocks in ((False, 8, ([0, 0, 3, 4],)), (True, 6, ([0, 2, 3],))):
        coord = coordinator(8, sw(2, 4), use_eagle=use_eagle)
        coord.allocate(Request("a", tokens(8)), 8)
        blocks, hit = coord.get_computed_blocks(Request("b", tokens(9)))
        assert (hit, blocks.get_block_ids()) == (want_hit, want_blocks)


def test_full_plus_mamba_backs_off_one_state():
    # B = 4, full attention + align Mamba, prefill of 20 in chunks of 4 with retirement: the
    # states at 4, 8, 12, 16, 20 were each published (older ones freed but still cached).
    coord = coordinator(32, fa(4), mamba(4), use_eagle=True)
    a = Request("a", tokens(20))
    for end in (4, 8, 12, 16, 20):
        coord.allocate(a, 4)
        a.num_computed_tokens = end
        coord.retire("a", end)
    coord.free("a")
    b = Request("b", tokens(21))
    hit, _ = admit(coord, b)
    # No back-off: 20 (state at 20 exists). Once: 16 (state at 16). Twice would be 12.
    assert hit == 16
    # Each chunk takes one full-attention block, then one Mamba block: full 1, 3, 5, 7, 9 and
    # states 2, 4, 6, 8, 10 (state at 16 = block 8). The hit is full [1, 3, 5, 7], Mamba
    # [null, null, null, 8]; b's running state is a new block after them.
    ids = coord.get_block_ids("b")
    assert ids[0][:4] == [1, 3, 5, 7] and ids[1][:4] == [0, 0, 0, 8]
