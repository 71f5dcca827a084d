"""Defect 4 of the one-path restructure: ``SlidingWindowManager.find_longest_cache_hit`` raised
ZeroDivisionError when `alignment_tokens` was smaller than the block size (blocks of 4,
alignment 2), where full attention answered. Hand count: 4 blocks of 4 tokens cached (16
tokens), window 6 (the next token needs ``cdiv(6 - 1, 4) = 2`` blocks), at most 16 tokens:
full attention hits all 4 blocks; the window hits ``[null, null, b3, b4]`` = 16 tokens too."""

from __future__ import annotations

import pytest

from mambakv import (
    BlockPool,
    FullAttentionManager,
    FullAttentionSpec,
    InvalidTokenCountError,
    SlidingWindowManager,
    SlidingWindowSpec,
)

H = [bytes([i]) * 16 for i in range(4)]


def cached_pool() -> tuple[BlockPool, list]:
    pool = BlockPool(20)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, H, 0)
    return pool, blocks


@pytest.mark.parametrize("alignment", [1, 2, 4, 8])
def test_sliding_window_hit_equals_full_attention_with_a_fine_alignment(alignment: int) -> None:
    pool, blocks = cached_pool()
    fa = FullAttentionManager.find_longest_cache_hit(H, 16, [0], pool, FullAttentionSpec(4, 1, 8, "bfloat16"), alignment)
    sw = SlidingWindowManager.find_longest_cache_hit(H, 16, [0], pool, SlidingWindowSpec(4, 1, 8, "bfloat16", 6),
                                                     alignment)
    assert len(fa[0]) * 4 == len(sw[0]) * 4 == 16  # lcm(alignment, 4) divides 16 for each alignment
    assert fa[0] == blocks
    assert sw[0] == [pool.null_block, pool.null_block, blocks[2], blocks[3]]


@pytest.mark.parametrize("alignment", [0, -4, 2.0, None])
def test_a_bad_alignment_is_refused(alignment: object) -> None:
    pool, _ = cached_pool()
    for cls, spec in ((FullAttentionManager, FullAttentionSpec(4, 1, 8, "bfloat16")),
                      (SlidingWindowManager, SlidingWindowSpec(4, 1, 8, "bfloat16", 6))):
        with pytest.raises(InvalidTokenCountError):
            cls.find_longest_cache_hit(H, 16, [0], pool, spec, alignment)  # type: ignore[arg-type]
