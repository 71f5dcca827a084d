"""Attention managers: full attention and sliding window."""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.spec import KVCacheSpec, SlidingWindowSpec
from mambakv.groups.base import SingleTypeKVCacheManager, cdiv
from mambakv.groups.kinds import GroupKind

__all__ = ["FullAttentionManager", "SlidingWindowManager"]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept until the request is freed.

    Hit: the longest chain of leading cached blocks, left to right, stopping at the first
    miss, truncated to a multiple of the alignment::

        cached?   y  y  y  n  y          hit = [b0, b1, b2]
    """

    kind = GroupKind.FULL_ATTENTION
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

    kind = GroupKind.SLIDING_WINDOW

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0) -> None:
        super().__init__(kv_cache_spec, block_pool, enable_caching=enable_caching,
                         kv_cache_group_id=kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window
        self.num_kept_tokens = self.sliding_window - 1  # the next token attends to w - 1 earlier ones

    @classmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """One right-to-left scan, each block looked up once (linear in the prompt).

        A run of cached blocks with top ``T`` can only end a hit at its largest aligned end
        ``e <= T``: a smaller aligned end needs blocks further down, which the run lacks once
        it breaks. So the scan keeps that ``e`` per run and stops as soon as the run reaches
        ``max(0, e - need)``::

            cached?  y n y y y y     need 2, aligned every 2 blocks, T = 6, e = 6
                         ^ run reaches 6 - 2 = 4: hit [null x 4, b4, b5]
        """
        bs = kv_cache_spec.block_size
        need = cdiv(kv_cache_spec.sliding_window - 1, bs)  # type: ignore[attr-defined]
        step = alignment_tokens // bs  # a multiple of the block size (find_longest_cache_hit)
        null = block_pool.null_block
        get = block_pool.get_cached_block
        top = min(max_length // bs, len(block_hashes))
        if need == 0:  # window 1: the next token reads no earlier KV; every aligned end hits
            end = top // step * step
            return tuple([null] * end for _ in kv_cache_group_ids)
        run: list[list[KVCacheBlock]] = []  # cached blocks of the current run: run[k] is block run_top - 1 - k
        run_top = end = 0  # the run's top and its largest aligned end (0: none)
        for i in range(top - 1, -1, -1):
            cached = get(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run, end = [], 0
                continue
            if not run:
                run_top = i + 1
                end = run_top // step * step
            run.append(cached)
            first = max(0, end - need)
            if end and i <= first:
                cover = run[run_top - end : run_top - first]  # blocks end - 1 .. first
                cover.reverse()
                return tuple([null] * first + [c[g] for c in cover] for g in range(len(kv_cache_group_ids)))
        return tuple([] for _ in kv_cache_group_ids)
