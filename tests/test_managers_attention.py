"""Sliding-window retirement and `find_longest_cache_hit` of every manager type (DESIGN.md 5
and 6), with alignment and the EAGLE back-off. Hits are set up by publishing pool blocks
under a request's block hashes directly."""

from __future__ import annotations

import pytest

from mambakv import (
    BlockPool,
    FullAttentionManager,
    FullAttentionSpec,
    InvalidTokenCountError,
    MambaManager,
    Request,
    SlidingWindowManager,
    SlidingWindowSpec,
)
from tests.helpers import mamba_spec

FA4 = FullAttentionSpec(4, 1, 8, "float16")
SW2 = SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4)
MB4 = mamba_spec(4)


def request(num_tokens: int, block_size: int, rid: str = "q") -> Request:
    return Request(rid, list(range(1000, 1000 + num_tokens)), hash_block_size=block_size)


def publish(pool: BlockPool, req: Request, slots, group_id: int = 0) -> dict[int, object]:
    """Publish one fresh pool block per slot under the request's key of that slot, then free
    it (a cached, free block, as after its request finished)."""
    out = {}
    for slot in slots:
        (block,) = pool.get_new_blocks(1)
        pool.cache_full_blocks([block], [req.block_hashes[slot]], group_id)
        out[slot] = block
    pool.free_blocks(list(out.values()))
    return out


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------- sliding-window retirement
@pytest.mark.parametrize("processed,nulls", [(5, 1), (7, 2), (11, 4)])
def test_sliding_window_retirement(processed, nulls):
    # window 4, block 2: skipped = max(0, n - 4 + 1): 5 -> 2 tokens = 1 block, 7 -> 4 = 2,
    # 11 -> 8 = 4. A 12-token table has 6 blocks.
    pool = BlockPool(16)
    m = SlidingWindowManager(SW2, pool)
    m.allocate_new_blocks("r", 12)
    table = list(m.req_to_blocks["r"])
    m.remove_skipped_blocks("r", processed)
    now = m.req_to_blocks["r"]
    assert [b.is_null for b in now] == [True] * nulls + [False] * (6 - nulls)
    assert now[nulls:] == table[nulls:]
    assert pool.get_num_free_blocks() == 15 - 6 + nulls
    m.check_invariants()


def test_sliding_window_retirement_is_cumulative_and_idempotent():
    pool = BlockPool(16)
    m = SlidingWindowManager(SW2, pool)
    m.allocate_new_blocks("r", 12)
    for processed, nulls in ((5, 1), (7, 2), (7, 2), (11, 4), (3, 4)):  # 3 < 11: nothing undone
        m.remove_skipped_blocks("r", processed)
        assert sum(b.is_null for b in m.req_to_blocks["r"][:nulls]) == nulls
        assert pool.get_num_free_blocks() == 9 + nulls
        m.check_invariants()
    with pytest.raises(InvalidTokenCountError):
        m.remove_skipped_blocks("r", -1)
    assert pool.get_num_free_blocks() == 13


def test_full_attention_never_retires():
    pool = BlockPool(8)
    m = FullAttentionManager(FA4, pool)
    m.allocate_new_blocks("r", 10)
    m.remove_skipped_blocks("r", 10)
    assert not any(b.is_null for b in m.req_to_blocks["r"]) and len(m.req_to_blocks["r"]) == 3


# ---------------------------------------------------------------- full attention hits
def test_full_attention_hit_stops_at_first_miss():
    pool = BlockPool(16)
    req = request(20, 4)
    cached = publish(pool, req, [0, 1, 2, 4])  # block 3 missing
    (hit,) = FullAttentionManager.find_longest_cache_hit(req.block_hashes, 19, [0], pool, FA4, 4)
    assert ids(hit) == ids([cached[0], cached[1], cached[2]])  # 12 tokens; block 4 unreachable
    # alignment 8: 12 -> 8 tokens
    (hit,) = FullAttentionManager.find_longest_cache_hit(req.block_hashes, 19, [0], pool, FA4, 8)
    assert ids(hit) == ids([cached[0], cached[1]])
    # max_length 7 -> at most one full block
    (hit,) = FullAttentionManager.find_longest_cache_hit(req.block_hashes, 7, [0], pool, FA4, 4)
    assert ids(hit) == [cached[0].block_id]
    # EAGLE: 12 -> next aligned length below, 8
    (hit,) = FullAttentionManager.find_longest_cache_hit(req.block_hashes, 19, [0], pool, FA4, 4, use_eagle=True)
    assert len(hit) == 2
    assert all(b.ref_cnt == 0 for b in cached.values())  # lookups never pin


def test_full_attention_hit_must_hold_in_every_group():
    pool = BlockPool(16)
    req = request(20, 4)
    g0 = publish(pool, req, [0, 1, 2, 3], group_id=0)
    g1 = publish(pool, req, [0, 1], group_id=1)
    h0, h1 = FullAttentionManager.find_longest_cache_hit(req.block_hashes, 19, [0, 1], pool, FA4, 4)
    assert ids(h0) == ids([g0[0], g0[1]]) and ids(h1) == ids([g1[0], g1[1]])


# ---------------------------------------------------------------- sliding-window hits
def test_sliding_window_hit_design_example():
    # DESIGN.md 6: block 2, window 4, 8 tokens cached, 9-token request (cap 8): the window
    # needs cdiv(4 - 1, 2) = 2 blocks before the end: [null, null, b2, b3] = 8 tokens;
    # with EAGLE back off to 6: [null, b1, b2].
    pool = BlockPool(16)
    req = request(9, 2)
    b = publish(pool, req, [0, 1, 2, 3])
    null = pool.null_block
    (hit,) = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 8, [0], pool, SW2, 2)
    assert hit == [null, null, b[2], b[3]]
    (hit,) = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 8, [0], pool, SW2, 2, use_eagle=True)
    assert hit == [null, b[1], b[2]]


def test_sliding_window_hit_alignment_and_gaps():
    pool = BlockPool(16)
    req = request(9, 2)
    null = pool.null_block
    b = publish(pool, req, [0, 1, 2])  # 6 tokens
    (hit,) = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 8, [0], pool, SW2, 2)
    assert hit == [null, b[1], b[2]]  # end 6
    (hit,) = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 8, [0], pool, SW2, 4)
    assert hit == [b[0], b[1]]  # 6 is not a multiple of 4: end 4, the run reaches block 0
    # blocks 0, 1, 3 cached, 2 missing: ends 8 and 6 need block 2 -> end 4
    pool2 = BlockPool(16)
    c = publish(pool2, req, [0, 1, 3])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 8, [0], pool2, SW2, 2)
    assert hit == [c[0], c[1]]


# ---------------------------------------------------------------- Mamba hits
def test_mamba_hit_rightmost_aligned_state():
    # states cached at slots 1, 3, 4 = after tokens 8, 16, 20; a 24-token request, cap 23:
    # alignment 4 -> slot 4 (20); alignment 8 -> 20 is not aligned, slot 3 (16).
    pool = BlockPool(16)
    req = request(24, 4)
    s = publish(pool, req, [1, 3, 4])
    null = pool.null_block
    find = MambaManager.find_longest_cache_hit
    assert find(req.block_hashes, 23, [0], pool, MB4, 4) == ([null] * 4 + [s[4]],)
    assert find(req.block_hashes, 23, [0], pool, MB4, 8) == ([null] * 3 + [s[3]],)
    assert find(req.block_hashes, 15, [0], pool, MB4, 4) == ([null, s[1]],)  # cap below 16 -> 8
    # EAGLE: 20 -> back to 16 (alignment 4); 16 -> back to 8 (alignment 8)
    assert find(req.block_hashes, 23, [0], pool, MB4, 4, use_eagle=True) == ([null] * 3 + [s[3]],)
    assert find(req.block_hashes, 23, [0], pool, MB4, 8, use_eagle=True) == ([null, s[1]],)
    # nothing at or below 7 tokens
    assert find(req.block_hashes, 7, [0], pool, MB4, 4) == ([],)


def test_mamba_none_mode_never_hits():
    pool = BlockPool(16)
    req = request(24, 4)
    publish(pool, req, [0, 1, 2, 3, 4])
    spec = mamba_spec(4, mode="none")
    assert MambaManager.find_longest_cache_hit(req.block_hashes, 23, [0], pool, spec, 4) == ([],)
