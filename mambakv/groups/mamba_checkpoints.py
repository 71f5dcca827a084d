"""The checkpoint blocks C of ``decode_checkpoints="latest"`` (see ``mamba_decode.py``): take one
per column at a verify (free without eviction, or the request's own superseded checkpoint),
publish it once its boundary is processed, and make the superseded one evict-first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.events import stored_event_fields
from mambakv.core.request import Request
from mambakv.groups.base import group_block_hashes
from mambakv.groups.drafts import DraftsMixin, MambaTable

if TYPE_CHECKING:
    from mambakv.groups.mamba import MambaManager

__all__ = ["CheckpointBlocksMixin"]


class CheckpointBlocksMixin(DraftsMixin):
    """Taking, publishing and demoting ``latest``'s decode checkpoint blocks."""

    _column_managers: tuple[MambaManager, ...]
    #: take checkpoint blocks even by evicting a cached block (benchmark knob; default never)
    spare_may_evict: bool

    def _take_checkpoint_blocks(self, t: MambaTable, *, fresh: bool) -> list[KVCacheBlock] | None:
        """One block per column, all or none: if `fresh`, a block free without eviction (any
        free block with ``spare_may_evict``); else, or when none is free, the request's own
        previous decode checkpoint if it is free and still cached under its key (the state
        about to be published supersedes it on the same chain; ``_publish_spare`` would make
        it evict-first). Nobody else's cached state is evicted.

        A recycled block is safe whatever was freed meanwhile: a cached block is written by
        no step (a hit only reads it, and holds it while it may: ref count > 0), and an
        unchanged hash proves it was not evicted and reused since."""
        pool = self.block_pool
        got = list[KVCacheBlock]()
        if fresh:
            for _ in t.columns:
                if self.spare_may_evict:
                    block = pool.get_new_blocks(1)[0] if pool.get_num_free_blocks() else None
                else:
                    block = pool.get_new_unhashed_block()
                if block is None:
                    break
                got.append(block)
            if len(got) == len(t.columns):
                return got
            if got:
                pool.free_blocks(got)
        old = [blk for blk, key in t.ckpts if blk.block_hash == key and blk.ref_cnt == 0]
        if not old or len(old) != len(t.columns):
            return None
        pool.evict_blocks([b.block_id for b in old])  # unhashed now (free, at the queue's head)
        pool.touch(old)  # taken: ref count 1
        t.ckpts = []
        return old

    def _publish_spare(self, request: Request, t: MambaTable, num_processed_tokens: int) -> None:
        """A waiting checkpoint whose boundary is processed: hash it under the boundary's key
        and free it (it lands at the LRU tail, cached)."""
        b = t.spare_pos
        if not b or b > num_processed_tokens:
            return
        bs = self.block_size
        slot = b // bs - 1
        keys = group_block_hashes(request, bs)
        if slot >= len(keys):
            return
        pool = self.block_pool
        fields = stored_event_fields(request, keys, slot, slot + 1, bs) if pool.enable_kv_cache_events else {}
        spares: list[KVCacheBlock] = []
        for col, m in zip(t.columns, self._column_managers):
            spare = col.pop()
            pool.cache_full_blocks([spare], [keys[slot]], m.kv_cache_group_id, **fields)
            spares.append(spare)
        pool.free_blocks(spares)
        self._note_checkpoint(t, spares, keys[slot])
        t.has_spare, t.spare_pos = False, 0

    def _note_checkpoint(self, t: MambaTable, blocks: list[KVCacheBlock], key: bytes) -> None:
        """`blocks` (one per column) were published under `key` in decode: the request's
        previous decode checkpoint, if free, becomes evict-first (a deeper state on its chain
        exists)."""
        old = [blk for blk, k in t.ckpts if blk.block_hash == k and blk.ref_cnt == 0]
        if old:
            self._evict_first(old)
        t.ckpts = [(blk, key) for blk in blocks]

    def _evict_first(self, blocks: list[KVCacheBlock]) -> None:
        """Move free cached `blocks` to the head of the cached part of the free queue (right
        after the unhashed free blocks, which the pool keeps first): the next eviction takes
        them, a hit may still revive them. O(unhashed free blocks): once per published decode
        checkpoint.

            queue  u1 u2 | h1 h2 OLD h3    ->    u1 u2 | OLD h1 h2 h3
        """
        q = self.block_pool.free_block_queue
        head, tail = q.sentinels
        for b in blocks:
            q.remove(b)
        node = head.next_free_block
        while node is not tail and node is not None and node.block_hash is None:
            node = node.next_free_block
        assert node is not None and node.prev_free_block is not None
        q._link_run(node.prev_free_block, blocks, node)  # the queue's own O(1) splice
