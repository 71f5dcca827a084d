"""Attention managers: full attention and sliding window."""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.spec import KVCacheSpec, SlidingWindowSpec
from mambakv.groups.base import SingleTypeKVCacheManager, cdiv


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept until the request is freed.

    Hit: the longest chain of leading cached blocks, left to right, stopping at the first
    miss, truncated to a multiple of the alignment::

        cached?   y  y  y  n  y          hit = [b0, b1, b2]
    """

    retires = False

    @classmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        bs = kv_cache_spec.block_size
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        get = block_pool.get_cached_block
        for i in range(min(max_length // bs, len(block_hashes))):
            cached = get(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for hit, block in zip(hits, cached):
                hit.append(block)
        # The hit must end on an aligned length (the LCM of all groups' block sizes).
        keep = len(hits[0]) * bs // alignment_tokens * alignment_tokens // bs
        if keep != len(hits[0]):
            for hit in hits:
                del hit[keep:]
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention over the last ``w`` tokens.

    Retirement: once ``n`` tokens are processed, the next token attends to ``[n - w + 1, n]``,
    so ``max(0, n - w + 1)`` leading tokens are skipped (window 4, block 2, n = 7: 4 tokens,
    2 null blocks).

    Hit: the rightmost aligned end with enough contiguous cached blocks before it to cover
    the window (``cdiv(w - 1, bs)`` blocks), or a run reaching block 0; earlier entries null::

        window 4, block 2, 4 blocks cached, max 8 tokens:   [null, null, b2, b3] = 8 tokens
    """

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        self.num_kept_tokens = self.sliding_window - 1  # the next token attends to w - 1 earlier ones


    @classmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        bs = kv_cache_spec.block_size
        need = cdiv(kv_cache_spec.sliding_window - 1, bs)  # type: ignore[attr-defined]
        num_groups = len(kv_cache_group_ids)
        lookups: dict[int, list[KVCacheBlock] | None] = {}

        def cached(i: int) -> list[KVCacheBlock] | None:
            if i not in lookups:
                lookups[i] = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            return lookups[i]

        null = block_pool.null_block
        for end in range(min(max_length // bs, len(block_hashes)), 0, -1):
            if (end * bs) % alignment_tokens:
                continue
            first = max(0, end - need)
            run = [cached(i) for i in range(end - 1, first - 1, -1)]
            if all(r is not None for r in run):
                run.reverse()
                return tuple([null] * first + [r[g] for r in run] for g in range(num_groups))  # type: ignore[index]
        return tuple([] for _ in kv_cache_group_ids)
