"""BlockPool: the null block, the free queue and ref counts; it owns the prefix-cache map.

One pool serves every KV-cache group. Rules (DESIGN.md section 3):

* block 0 is the null block: never allocated, freed, hashed, queued or counted in usage;
* a non-null block is in the free queue iff its ``ref_cnt`` is 0;
* freed blocks keep their hash and stay hittable until reallocated (lazy eviction);
* when freed, unhashed blocks go to the head (nothing of value, reuse first) and hashed
  blocks to the tail (LRU), each kind in the order given::

      free_blocks([h1, u1, h2, u2])      queue: u1 u2 | ...old... | h1 h2
                                                ^ head                 ^ tail

The prefix-cache map (one dict per group: ``block_hash -> block``, or ``{block_id: block}``
when several blocks of a group carry one hash) and the KV events it records live in
:mod:`mambakv.core.prefix_map`; the pool decides when a block is published or loses its hash.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from mambakv.core import pool_checks
from mambakv.core.block import FreeBlockQueue, KVCacheBlock
from mambakv.core.errors import DoubleFreeError, InvalidBlockError, InvalidTokenCountError, OutOfBlocksError
from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from mambakv.core.pool_checks import check_pool, checked_block_ids, first_duplicate_id, undo_free
from mambakv.core.prefix_map import PrefixMap

__all__ = ["AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "KVCacheEvent"]


_POOL_IDS = itertools.count()
#: the calls whose one-pass forms ``mambakv.core.pool_fused`` takes (``BlockPool.fused_calls``)
_FUSED_CALLS = ("free_blocks", "_requeue", "get_new_blocks", "cache_full_blocks", "cache_state_blocks")


class BlockPool:
    """All blocks of the KV cache, created once.

    Args:
        num_blocks: blocks in the pool including the null block 0 (>= 2).
        enable_caching: keep a prefix-cache map; when False nothing is ever hashed.
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared events
            for ``take_events()``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise InvalidTokenCountError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        #: distinguishes this pool's blocks from any other pool's (``KVCacheBlock.pool_id``)
        self.pool_id = next(_POOL_IDS)
        for b in self.blocks:
            b.pool_id = self.pool_id
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.prefix_map = PrefixMap(record_events=enable_kv_cache_events)
        #: group id -> block hash -> block, or {block_id: block} when several share the hash
        #: (the PrefixMap's own dict: read it, change it only through the pool)
        self.cached_block_hash_to_block = self.prefix_map.maps
        #: blocks out of circulation, in no table (a decoupled pool's withdrawn blocks; 0 otherwise)
        self.num_reserved_blocks = 0
        #: the class keeps BlockPool's own free / requeue / get / cache calls, so the one-pass
        #: forms of ``mambakv.core.pool_fused`` may stand in for them (read-only)
        #: (compared with the calls as this module defined them: a rule planted on BlockPool
        #: itself, as the teeth tests do, opts out too)
        self.fused_calls = pool_checks.keeps_calls(type(self), BlockPool, _FUSED_CALLS)

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose hash was dropped (to reuse them, or by ``evict_blocks``)."""
        return self.prefix_map.num_evictions

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out now (cached free blocks included)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks in use: ``used / (num_blocks - 1)``."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group in `group_ids` for `block_hash`, or None unless every
        group has one (a hit must be valid for all the groups asked).

        The PrefixMap's lookup, inlined: it runs once per block of every hit, and the extra
        call cost about 15% of it (measured, 1000 lookups)."""
        out = []
        maps = self.cached_block_hash_to_block
        for gid in group_ids:
            m = maps.get(gid)
            entry = m.get(block_hash) if m is not None else None
            if entry is None:
                return None
            out.append(next(iter(entry.values())) if isinstance(entry, dict) else entry)
        return out

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head, each with ref count 1.

        A popped block that still carries a hash is first evicted from the prefix-cache map.

        Raises:
            InvalidTokenCountError: `num_blocks` is negative.
            OutOfBlocksError: fewer than `num_blocks` are free; nothing changes.
        """
        if num_blocks < 0:
            raise InvalidTokenCountError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free"
            )
        if num_blocks == 1:  # the common case (one block per growing table): no list walk
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self.prefix_map.remove(block)
            block.ref_cnt = 1
            return [block]
        q = self.free_block_queue
        head = q.head
        blocks = []
        hashed = None
        walk: Any = head.next_free_block  # a real block for each of the num_blocks (counted above)
        for _ in range(num_blocks):  # popleft_n and the ref counts in one walk
            nxt = walk.next_free_block
            walk.prev_free_block = walk.next_free_block = None
            walk.ref_cnt = 1
            if walk.block_hash is not None:  # evicted below in one call (a fresh pool: none)
                hashed = hashed or []
                hashed.append(walk)
            blocks.append(walk)
            walk = nxt
        head.next_free_block = walk
        walk.prev_free_block = head
        q.num_free_blocks -= num_blocks
        if hashed:
            self.prefix_map.remove_many(hashed)
        return blocks

    def get_new_unhashed_block(self) -> KVCacheBlock | None:
        """Pop the head block with ref count 1 if it carries no hash, i.e. a block that is free
        *without evicting* a cached one; otherwise return None and change nothing.

        Unhashed free blocks always sit before hashed ones (see the module docstring), so None
        means that every free block is cached (or none is free). Used for lazy Mamba spares."""
        q = self.free_block_queue
        block = q.first()
        if block is None or block.block_hash is not None:
            return None
        q.popleft()
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Ref count +1 for each block (a prefix hit); a block at 0 leaves the free queue
        first. The null block is skipped (it may repeat: ``[null, null, b2, b3]``).

        Raises:
            InvalidBlockError: a real block is listed twice (the table would hold it twice and
                could never be freed), or a block of another pool; nothing changes.
        """
        if not isinstance(blocks, (list, tuple)):
            blocks = list(blocks)
        pid = self.pool_id
        for block in blocks:
            if block.pool_id != pid:
                raise InvalidBlockError(f"block {block.block_id} belongs to another pool")
        if len(blocks) > 1:
            # Blocks hash by identity: two C-level passes, no Python loop.
            nulls = blocks.count(self.null_block)
            if len(set(blocks)) != len(blocks) - (nulls - 1 if nulls else 0):
                raise InvalidBlockError(f"block {first_duplicate_id(blocks)} listed more than once in one touch call")
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:  # the null block's ref count stays 0: this branch skips it
                if block.is_null:
                    continue
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Ref count -1 for each block, in the given order; blocks reaching 0 return to the
        queue: unhashed ones to the head, hashed ones to the tail (see the module docstring).
        The null block is skipped.

        Raises (nothing changes):
            DoubleFreeError: a block is at ref count 0, or appears in `blocks` more than once
                (no block table holds a block twice).
            InvalidBlockError: a block of another pool (one compare per block, in the same
                pass as the ref counts).
        """
        if type(blocks) is not list:
            blocks = list(blocks)
        if self.null_block in blocks:  # a C-level identity scan; filter only when needed
            blocks = [b for b in blocks if not b.is_null]
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):  # identity hashing: one C pass
            raise DoubleFreeError(f"block {first_duplicate_id(blocks)} listed more than once in one "
                                  f"free_blocks call")
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        to_head, to_tail = unhashed.append, hashed.append
        pid = self.pool_id
        for block in blocks:
            ref_cnt = block.ref_cnt - 1
            if ref_cnt < 0 or block.pool_id != pid:
                undo_free(blocks, block, pid)
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                if block.block_hash is None:
                    to_head(block)
                else:
                    to_tail(block)
        self._requeue(unhashed, hashed)

    def _requeue(self, unhashed: list[KVCacheBlock], hashed: list[KVCacheBlock]) -> None:
        """Queue the blocks ``free_blocks`` brought to ref count 0 (a subclass may note them).
        None is queued (ref counts were >= 1, blocks distinct): skip the queue's per-block check,
        about 10% of a bulk free."""
        if unhashed:
            self.free_block_queue.prepend_n(unhashed, checked=False)
        if hashed:
            self.free_block_queue.append_unchecked(hashed)

    # ------------------------------------------------------------------ prefix cache
    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], kv_cache_group_id: int, *,
                          parent_block_hash: bytes | None = None, token_ids: Sequence[int] | None = None,
                          block_size: int = 0, lora_id: int | None = None, lora_name: str | None = None) -> None:
        """Publish ``blocks[i]`` under ``block_hashes[i]`` in group `kv_cache_group_id`.

        Null blocks and blocks already published under the same hash and group (hits) are
        skipped. Several blocks may share a hash. `parent_block_hash` (of the block before
        ``blocks[0]``), `token_ids` (of all the blocks, flat: ``len(blocks) * block_size`` ids),
        `block_size` and the LoRA id and name only feed the BlockStored events: one per run of
        consecutive blocks whose hash is new to the group (a second copy of a hash is not
        announced again)::

            blocks [null, b1, b2(copy), b3], hashes [h0, h1, h2, h3]
                -> BlockStored([h1], parent h0, ids[4:8]), BlockStored([h3], parent h2, ids[12:16])

        Raises (nothing changed):
            InvalidBlockError: a block already carries a different hash or group (it holds
                another prefix; publishing it again would key the map wrongly).
            InvalidTokenCountError: `token_ids` given with another length than
                ``len(blocks) * block_size``.
        """
        if not self.enable_caching:
            return
        self.prefix_map.insert(blocks, block_hashes, kv_cache_group_id, parent_block_hash=parent_block_hash,
                               token_ids=token_ids, block_size=block_size, lora_id=lora_id, lora_name=lora_name)

    def cache_state_blocks(self, blocks: Sequence[KVCacheBlock], block_hash: bytes, group_ids: Sequence[int], *,
                           parent_block_hash: bytes | None = None, token_ids: Sequence[int] | None = None,
                           block_size: int = 0, lora_id: int | None = None, lora_name: str | None = None) -> None:
        """Publish ``blocks[i]`` under one `block_hash` in group ``group_ids[i]``: the states of
        the Mamba groups that share one policy, at one boundary. The same as one
        ``cache_full_blocks([blocks[i]], [block_hash], group_ids[i], ...)`` per group (the
        events too, in that order), in one call and all or nothing.

        Raises (nothing changed): InvalidBlockError, InvalidTokenCountError, as ``cache_full_blocks``.
        """
        if not self.enable_caching:
            return
        self.prefix_map.insert_state(blocks, block_hash, group_ids, parent_block_hash=parent_block_hash,
                                     token_ids=token_ids, block_size=block_size, lora_id=lora_id, lora_name=lora_name)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks' hashes (e.g. their data was lost). A held block stays in its
        tables; a free one moves to the head of the queue, as any unhashed free block (it holds
        nothing of value any more, so it is reused before cached blocks). Unhashed and null
        blocks, and repeated ids, are ignored.

        Raises:
            InvalidBlockError: an id outside ``0 .. num_blocks - 1`` (a negative id would
                otherwise index from the end); nothing changes.
        """
        ids = checked_block_ids(block_ids, self.num_blocks)
        queue = self.free_block_queue
        for block_id in ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and not block.is_null:
                self.prefix_map.remove(block)
                if block.ref_cnt == 0:
                    queue.remove(block)
                    queue.prepend_n([block])

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, if no block other than the null block is in use.

        Returns False and changes nothing while any request holds a block (free or preempt
        them first, see docs/engine-integration.md). Out-of-circulation blocks (``num_reserved_blocks``) do
        not count as in use here."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1 - self.num_reserved_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.cache_group_id = -1
        self.prefix_map.clear()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded KV events (empty unless events are enabled)."""
        return self.prefix_map.take_events()

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Assert: queue links consistent; null block unqueued, unhashed, ref 0; a non-null
        block is queued iff its ref count is 0; the queue holds every unhashed free block
        before every cached one; the map holds exactly the hashed blocks, each under its own
        hash and group."""
        check_pool(self)  # mambakv.core.pool_checks


pool_checks.record_own_calls(BlockPool, _FUSED_CALLS)  # (fused_calls: a rule planted on BlockPool opts out)
