"""BlockPool: the null block, the free queue, ref counts, the prefix-cache map and KV events.

One pool serves every KV-cache group. Rules (DESIGN.md section 3):

* block 0 is the null block: never allocated, freed, hashed, queued or counted in usage;
* a non-null block is in the free queue iff its ``ref_cnt`` is 0;
* freed blocks keep their hash and stay hittable until reallocated (lazy eviction);
* when freed, unhashed blocks go to the head (nothing of value, reuse first) and hashed
  blocks to the tail (LRU), each kind in the order given::

      free_blocks([h1, u1, h2, u2])      queue: u1 u2 | ...old... | h1 h2
                                                ^ head                 ^ tail

The prefix-cache map is one dict per group: ``block_hash -> block`` (or ``{block_id: block}``
when several blocks of a group carry one hash, which happens because block tables are
append-only and never de-duplicated).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

from mambakv.core.block import FreeBlockQueue, KVCacheBlock
from mambakv.core.errors import DoubleFreeError, InvalidBlockError, InvalidTokenCountError, OutOfBlocksError
from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "KVCacheEvent"]


_MapEntry = KVCacheBlock | dict[int, KVCacheBlock]
_POOL_IDS = itertools.count()


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
        # group id -> block hash -> block, or {block_id: block} when several share the hash
        self.cached_block_hash_to_block: dict[int, dict[bytes, _MapEntry]] = {}
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse them
        #: blocks taken out of circulation for good by ``reserve_blocks`` (in use, never freed)
        self.num_reserved_blocks = 0
        self._events: list[KVCacheEvent] = []

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
        group has one (a hit must be valid for all the groups asked)."""
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
                self._evict(block)
            block.ref_cnt = 1
            return [block]
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
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

    def reserve_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks out of circulation for good (ref count 1, never freed by the
        pool's users), e.g. the scratch region of a lazy Mamba group. They count as used in
        ``usage``; ``reset_prefix_cache`` ignores them.

        Raises:
            InvalidTokenCountError / OutOfBlocksError: as ``get_new_blocks`` (nothing changes).
        """
        blocks = self.get_new_blocks(num_blocks)
        self.num_reserved_blocks += num_blocks
        return blocks

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
                ids = [b.block_id for b in blocks if not b.is_null]
                dup = next(i for i in ids if ids.count(i) > 1)
                raise InvalidBlockError(f"block {dup} listed more than once in one touch call")
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
            self._raise_duplicate(blocks)
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        to_head, to_tail = unhashed.append, hashed.append
        pid = self.pool_id
        for block in blocks:
            ref_cnt = block.ref_cnt - 1
            if ref_cnt < 0 or block.pool_id != pid:
                self._undo_free(blocks, block)
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                if block.block_hash is None:
                    to_head(block)
                else:
                    to_tail(block)
        # Ref counts were >= 1 and the blocks distinct, so none is queued: skip the queue's
        # own per-block check (it costs about 10% of a bulk free).
        if unhashed:
            self.free_block_queue.prepend_n(unhashed, checked=False)
        if hashed:
            self.free_block_queue.append_n(hashed, checked=False)

    @staticmethod
    def _raise_duplicate(blocks: list[KVCacheBlock]) -> None:
        ids = [b.block_id for b in blocks]
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DoubleFreeError(f"block {dup} listed more than once in one free_blocks call")

    def _undo_free(self, blocks: list[KVCacheBlock], bad: KVCacheBlock) -> None:
        """`bad` is at ref count 0 or another pool's: restore the blocks already decremented,
        then raise."""
        for block in blocks[: blocks.index(bad)]:
            block.ref_cnt += 1
        if bad.pool_id != self.pool_id:
            raise InvalidBlockError(f"block {bad.block_id} belongs to another pool")
        raise DoubleFreeError(f"block {bad.block_id} freed at ref count {bad.ref_cnt}")

    # ------------------------------------------------------------------ prefix cache
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        kv_cache_group_id: int,
        *,
        parent_block_hash: bytes | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
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
        for block in blocks:  # the common case: only fresh blocks, one cheap pass
            if block.block_hash is not None:
                self._check_republish(blocks, block_hashes, kv_cache_group_id)
                break
        if token_ids is not None and len(token_ids) != len(blocks) * block_size:
            raise InvalidTokenCountError(
                f"{len(token_ids)} token ids for {len(blocks)} blocks of {block_size} tokens")
        m = self.cached_block_hash_to_block.setdefault(kv_cache_group_id, {})
        if not self.enable_kv_cache_events:  # the hot path: no event bookkeeping
            get = m.get
            for block, block_hash in zip(blocks, block_hashes):
                if block.block_hash is not None or block.is_null:
                    continue
                block.block_hash = block_hash
                block.cache_group_id = kv_cache_group_id
                entry = get(block_hash)
                if entry is None:
                    m[block_hash] = block
                elif isinstance(entry, dict):
                    entry[block.block_id] = block
                else:
                    m[block_hash] = {entry.block_id: entry, block.block_id: block}
            return
        new: list[int] = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.is_null or block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.cache_group_id = kv_cache_group_id
            entry = m.get(block_hash)
            if entry is None:
                m[block_hash] = block
                new.append(i)
            elif isinstance(entry, dict):
                entry[block.block_id] = block
            else:
                m[block_hash] = {entry.block_id: entry, block.block_id: block}
        if new:
            self._record_stored(new, block_hashes, kv_cache_group_id, parent_block_hash, token_ids, block_size,
                                lora_id, lora_name)

    @staticmethod
    def _check_republish(blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], group_id: int) -> None:
        """Raise InvalidBlockError if a block already carries another hash or group."""
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None and (block.block_hash != block_hash or block.cache_group_id != group_id):
                raise InvalidBlockError(f"block {block.block_id} is published under another hash or group; "
                                        f"it cannot be published again")

    def _record_stored(self, new: list[int], block_hashes: Sequence[bytes], group_id: int,
                       parent_block_hash: bytes | None, token_ids: Sequence[int] | None, block_size: int,
                       lora_id: int | None, lora_name: str | None) -> None:
        """One BlockStored per run of consecutive indices in `new` (see cache_full_blocks)."""
        start = 0
        for k in range(1, len(new) + 1):
            if k < len(new) and new[k] == new[k - 1] + 1:
                continue
            lo, hi = new[start], new[k - 1] + 1
            parent = block_hashes[lo - 1] if lo else parent_block_hash
            ids = list(token_ids[lo * block_size : hi * block_size]) if token_ids is not None else []
            self._events.append(BlockStored(list(block_hashes[lo:hi]), parent, ids, block_size, lora_id,
                                            group_id=group_id, lora_name=lora_name))
            start = k

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop `block`'s hash from the map (it is about to hold something else). BlockRemoved
        is recorded only when it was the group's last block with that hash."""
        block_hash = block.block_hash
        m = self.cached_block_hash_to_block[block.cache_group_id]
        entry = m[block_hash]  # type: ignore[index]
        if isinstance(entry, dict):
            del entry[block.block_id]
            if len(entry) == 1:
                m[block_hash] = next(iter(entry.values()))  # type: ignore[index]
            last = False  # another block of the group still serves this hash: no event
        else:
            del m[block_hash]  # type: ignore[arg-type]
            last = True
        gid = block.cache_group_id
        block.block_hash = None
        block.cache_group_id = -1
        self.num_evictions += 1
        if last and self.enable_kv_cache_events:
            self._events.append(BlockRemoved([block_hash], group_id=gid))  # type: ignore[list-item]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks' hashes (e.g. their data was lost). A held block stays in its
        tables; a free one moves to the head of the queue, as any unhashed free block (it holds
        nothing of value any more, so it is reused before cached blocks). Unhashed and null
        blocks, and repeated ids, are ignored.

        Raises:
            InvalidBlockError: an id outside ``0 .. num_blocks - 1`` (a negative id would
                otherwise index from the end); nothing changes.
        """
        n = self.num_blocks
        ids = []
        for block_id in block_ids:
            try:
                i = operator.index(block_id)  # ints and numpy integers; not floats
            except TypeError:
                raise InvalidBlockError(f"block id {block_id!r} is not an integer") from None
            if not 0 <= i < n:
                raise InvalidBlockError(f"block id {block_id!r} outside 0..{n - 1}")
            ids.append(i)
        queue = self.free_block_queue
        for block_id in ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and not block.is_null:
                self._evict(block)
                if block.ref_cnt == 0:
                    queue.remove(block)
                    queue.prepend_n([block])

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, if no block other than the null block is in use.

        Returns False and changes nothing while any request holds a block (free or preempt
        them first, see docs/engine-integration.md). Reserved blocks (``reserve_blocks``) do
        not count as in use here."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1 - self.num_reserved_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.cache_group_id = -1
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded KV events (empty unless events are enabled)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Assert: queue links consistent; null block unqueued, unhashed, ref 0; a non-null
        block is queued iff its ref count is 0; the queue holds every unhashed free block
        before every cached one; the map holds exactly the hashed blocks, each under its own
        hash and group."""
        q = self.free_block_queue
        q.check_invariants()
        null = self.null_block
        assert null.block_id == 0 and null.is_null and null.block_hash is None
        assert null.prev_free_block is None and null.next_free_block is None, "null block queued"
        assert null.ref_cnt == 0, f"null block ref count {null.ref_cnt}"
        queued = {b.block_id for b in q.get_all_free_blocks()}
        assert 0 not in queued
        mapped = 0
        for gid, m in self.cached_block_hash_to_block.items():
            for h, entry in m.items():
                group = list(entry.values()) if isinstance(entry, dict) else [entry]
                assert group, "empty map entry"
                for b in group:
                    assert b.block_hash == h and b.cache_group_id == gid, f"block {b.block_id} mapped wrongly"
                    mapped += 1
        seen_hashed: KVCacheBlock | None = None  # unhashed free blocks first (get_new_unhashed_block relies on it)
        for b in q.get_all_free_blocks():
            if b.block_hash is not None:
                seen_hashed = seen_hashed or b
            else:
                assert seen_hashed is None, (f"free queue: unhashed block {b.block_id} behind cached block "
                                             f"{seen_hashed.block_id}")
        hashed = 0
        for b in self.blocks[1:]:
            assert not b.is_null
            assert b.ref_cnt >= 0
            assert (b.block_id in queued) == (b.ref_cnt == 0), f"block {b.block_id} ref {b.ref_cnt} vs queue"
            if b.block_hash is not None:
                hashed += 1
        assert hashed == mapped, f"{hashed} hashed blocks but {mapped} in the map"
