"""BlockPool: the null block, the free queue and ref counts; it owns the prefix-cache map.

One pool serves every KV-cache group. Rules (DESIGN.md section 3):

* block 0 is the null block: never allocated, freed, hashed, queued or counted in usage;
* a non-null block is in the free queue iff its ``ref_cnt`` is 0;
* freed blocks keep their hash and stay hittable until reallocated (lazy eviction);
* when freed, unhashed blocks go to the head (nothing of value, reuse first) and hashed
  blocks to the tail (LRU), each kind in the order given::

      free_blocks([h1, u1, h2, u2])      queue: u1 u2 | ...old... | h1 h2
                                                ^ head                 ^ tail

The prefix-cache map is a :class:`PrefixMap` the pool owns: one dict per group,
``block_hash -> block``, or ``{block_id: block}`` when several blocks of a group carry one hash
(block tables are append-only and never de-duplicated, so two requests that computed the same
block each keep their copy)::

    maps[0] = {h1: b4, h2: {5: b5, 9: b9}}     group 0: h1 in block 4, h2 in blocks 5 and 9
    remove(b9) -> False                          h2 still served by b5: maps[0][h2] is b5 again
    remove(b5) -> True                           the last copy of h2 went: BlockRemoved([h2])

The pool decides *when* a block is published or loses its hash (allocation, eviction, reset);
the map keeps itself consistent and, when events are enabled, records the raw per
``(group, hash)`` stream of :mod:`mambakv.core.events`: BlockStored when the first block of a
group gets a hash, BlockRemoved when the last one loses it, AllBlocksCleared on ``clear``.

Batch work is one call per step (as vLLM's ``popleft_n`` / ``append_n``): ``get_new_blocks(n)``
pops and evicts in one walk, ``free_blocks`` requeues a whole table, ``cache_state_blocks``
publishes one state per Mamba group; ``evict_first`` moves free cached blocks to the eviction
end of the cached part.

A pool's cost grows with what is used: its blocks are made on first use (the free queue's
fresh run, :mod:`mambakv.core.block`), so building a pool of 10^7 blocks makes 2 objects, not
10^7 (the made blocks are a list that grows as blocks are first used). ``blocks[i]`` makes block `i` (and the
never-used ones queued before it) when it does not exist yet, so every id still reads as in an
eagerly built pool.

The refusals of bad input are cheap tests inline (one identity pass, one compare per block);
the helpers below only name the culprit and raise, or undo a half-done free first::

    free_blocks([b3, b5, b3])   len(set) != len   -> first_duplicate_id -> DoubleFreeError(3)
    free_blocks([b3, b5])       b5 at ref 0        -> undo_free: b3 back to its ref count, raise
    evict_blocks([2, -1])                          -> checked_block_ids: InvalidBlockError(-1)
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn

from mambakv.core.block import FreeBlockQueue, KVCacheBlock
from mambakv.core.errors import (
    BlockNotFreeError,
    DoubleFreeError,
    InvalidBlockError,
    InvalidSpecError,
    InvalidTokenCountError,
    OutOfBlocksError,
)
from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, stored_events

__all__ = ["BOOKKEEPING_BYTES_PER_BLOCK", "MAX_BLOCKS", "AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored",
           "KVCacheEvent", "MapEntry", "PoolBlocks", "PrefixMap", "check_num_blocks", "checked_block_ids",
           "first_duplicate_id", "physical_memory_bytes"]

#: one hash of one group: its only block, or ``{block_id: block}`` for several copies
MapEntry = KVCacheBlock | dict[int, KVCacheBlock]


class PrefixMap:
    """The prefix-cache map of a BlockPool (see the module docstring): the hash -> block maps of every group, with the eviction count and the event list.

    Args:
        record_events: keep BlockStored / BlockRemoved / AllBlocksCleared for ``take_events``.

    Attributes:
        maps: group id -> block hash -> :data:`MapEntry` (what ``BlockPool.cached_block_hash_to_block``
            is; outside code reads it, so it is one dict for the map's whole life).
        num_evictions: blocks that lost their hash through :meth:`remove`.
    """

    __slots__ = ("maps", "num_evictions", "_events")

    def __init__(self, record_events: bool = False) -> None:
        self.maps: dict[int, dict[bytes, MapEntry]] = {}
        self.num_evictions = 0
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    def insert(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], group_id: int, *,
               parent_block_hash: bytes | None, token_ids: Sequence[int] | None, block_size: int,
               lora_id: int | None, lora_name: str | None) -> None:
        """Give ``blocks[i]`` the hash ``block_hashes[i]`` and group `group_id` and map it, skipping
        null blocks and blocks already hashed; record BlockStored for the hashes new to the group
        (``BlockPool.cache_full_blocks`` documents the arguments and the events).

        Raises (nothing changed):
            InvalidBlockError: a block already carries a different hash or group.
            InvalidTokenCountError: `token_ids` of another length than ``len(blocks) * block_size``.
        """
        for block in blocks:  # the common case: only fresh blocks, one cheap pass
            if block.block_hash is not None:
                _check_republish(blocks, block_hashes, group_id)
                break
        if token_ids is not None and len(token_ids) != len(blocks) * block_size:
            raise InvalidTokenCountError(
                f"{len(token_ids)} token ids for {len(blocks)} blocks of {block_size} tokens")
        m = self.maps.setdefault(group_id, {})
        events = self._events
        if events is None:  # the hot path: no event bookkeeping
            map_blocks(m, blocks, block_hashes, group_id)
            return
        new: list[int] = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.is_null or block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.cache_group_id = group_id
            entry = m.get(block_hash)
            if entry is None:
                m[block_hash] = block
                new.append(i)
            elif isinstance(entry, dict):
                entry[block.block_id] = block
            else:
                m[block_hash] = {entry.block_id: entry, block.block_id: block}
        if new:
            events.extend(stored_events(new, block_hashes, group_id, parent_block_hash, token_ids, block_size,
                                        lora_id, lora_name))

    def insert_state(self, blocks: Sequence[KVCacheBlock], block_hash: bytes, group_ids: Sequence[int], *,
                     parent_block_hash: bytes | None, token_ids: Sequence[int] | None, block_size: int,
                     lora_id: int | None, lora_name: str | None) -> None:
        """Give ``blocks[i]`` the hash `block_hash` in group ``group_ids[i]`` (one Mamba state per
        group of a shared policy, all at one boundary): ``insert`` of one block per group, all
        or nothing (``BlockPool.cache_state_blocks`` documents the arguments).

        Raises (nothing changed):
            InvalidBlockError: a block already carries a different hash or group.
            InvalidTokenCountError: `token_ids` of another length than `block_size`.
        """
        for block, group_id in zip(blocks, group_ids):
            if block.block_hash is not None:
                _check_republish([block], [block_hash], group_id)
        if self._events is not None or token_ids is not None:  # events: one insert per group, in order
            if token_ids is not None and len(token_ids) != block_size:
                raise InvalidTokenCountError(f"{len(token_ids)} token ids for 1 block of {block_size} tokens")
            for block, group_id in zip(blocks, group_ids):
                self.insert([block], [block_hash], group_id, parent_block_hash=parent_block_hash, token_ids=token_ids,
                            block_size=block_size, lora_id=lora_id, lora_name=lora_name)
            return
        map_state(self.maps, blocks, block_hash, group_ids)

    def remove(self, block: KVCacheBlock) -> bool:
        """Drop hashed `block` from the map and clear its hash and group (it is about to hold
        something else, or its data was lost); count an eviction. True when it was the group's
        last block with that hash (then BlockRemoved is recorded)."""
        block_hash = block.block_hash
        gid = block.cache_group_id
        m = self.maps[gid]
        entry = m[block_hash]  # type: ignore[index]
        if isinstance(entry, dict):
            del entry[block.block_id]
            if len(entry) == 1:
                m[block_hash] = next(iter(entry.values()))  # type: ignore[index]
            last = False  # another block of the group still serves this hash: no event
        else:
            del m[block_hash]  # type: ignore[arg-type]
            last = True
        block.block_hash = None
        block.cache_group_id = -1
        self.num_evictions += 1
        if last and self._events is not None:
            self._events.append(BlockRemoved([block_hash], group_id=gid))  # type: ignore[list-item]
        return last

    def remove_many(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``remove`` every hashed block of `blocks` (unhashed ones are skipped): one call for a
        bulk pop or a withdrawn superblock, the same map updates and events."""
        maps, events = self.maps, self._events
        n = 0
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            gid = block.cache_group_id
            m = maps[gid]
            entry = m[block_hash]
            n += 1
            block.block_hash = None
            block.cache_group_id = -1
            if isinstance(entry, dict):
                del entry[block.block_id]
                if len(entry) == 1:
                    m[block_hash] = next(iter(entry.values()))
            else:
                del m[block_hash]
                if events is not None:
                    events.append(BlockRemoved([block_hash], group_id=gid))
        self.num_evictions += n

    def clear(self) -> None:
        """Empty every group's map (the same dict object stays) and record AllBlocksCleared.
        The caller clears the blocks' own hashes."""
        self.maps.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded events (always empty when events are off)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def check_invariants(self, num_hashed: int) -> None:
        """Assert: no empty entry; every mapped block carries the hash and group it is mapped
        under; the map holds `num_hashed` blocks (the pool's count of hashed blocks)."""
        mapped = 0
        for gid, m in self.maps.items():
            for h, entry in m.items():
                group = list(entry.values()) if isinstance(entry, dict) else [entry]
                assert group, "empty map entry"
                for b in group:
                    assert b.block_hash == h and b.cache_group_id == gid, f"block {b.block_id} mapped wrongly"
                    mapped += 1
        assert num_hashed == mapped, f"{num_hashed} hashed blocks but {mapped} in the map"


def map_blocks(m: dict[bytes, MapEntry], blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
               group_id: int) -> None:
    """``insert``'s map update without events, its checks done: null and already hashed blocks
    are skipped; a second block of a hash turns the entry into ``{block_id: block}``."""
    get = m.get
    for block, block_hash in zip(blocks, block_hashes):
        if block.block_hash is not None or block.is_null:
            continue
        block.block_hash = block_hash
        block.cache_group_id = group_id
        entry = get(block_hash)
        if entry is None:
            m[block_hash] = block
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        else:
            m[block_hash] = {entry.block_id: entry, block.block_id: block}


def map_state(maps: dict[int, dict[bytes, MapEntry]], blocks: Sequence[KVCacheBlock], block_hash: bytes,
              group_ids: Sequence[int]) -> None:
    """``insert_state``'s map update without events (checks done): ``blocks[i]`` under
    `block_hash` in group ``group_ids[i]``."""
    for block, group_id in zip(blocks, group_ids):
        if block.block_hash is not None or block.is_null:
            continue
        m = maps.get(group_id)
        if m is None:
            m = maps[group_id] = {}
        if block_hash in m:  # another copy: map_blocks' entry rules
            map_blocks(m, (block,), (block_hash,), group_id)
            continue
        block.block_hash = block_hash
        block.cache_group_id = group_id
        m[block_hash] = block


def _check_republish(blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], group_id: int) -> None:
    """Raise InvalidBlockError if a block already carries another hash or group."""
    for block, block_hash in zip(blocks, block_hashes):
        if block.block_hash is not None and (block.block_hash != block_hash or block.cache_group_id != group_id):
            raise InvalidBlockError(f"block {block.block_id} is published under another hash or group; "
                                    f"it cannot be published again")


def first_duplicate_id(blocks: Iterable[KVCacheBlock]) -> int:
    """The id of the first non-null block listed twice in `blocks` (there must be one)."""
    ids = [b.block_id for b in blocks if not b.is_null]
    return next(i for i in ids if ids.count(i) > 1)


def undo_free(blocks: list[KVCacheBlock], bad: KVCacheBlock, pool_id: int) -> NoReturn:
    """`bad` is at ref count 0 or another pool's: restore the blocks of `blocks` before it
    (already decremented by ``free_blocks``), then raise InvalidBlockError (another pool) or
    DoubleFreeError."""
    for block in blocks[: blocks.index(bad)]:
        block.ref_cnt += 1
    if bad.pool_id != pool_id:
        raise InvalidBlockError(f"block {bad.block_id} belongs to another pool")
    raise DoubleFreeError(f"block {bad.block_id} freed at ref count {bad.ref_cnt}")


def checked_block_ids(block_ids: Iterable[int], num_blocks: int) -> list[int]:
    """`block_ids` as ints, each in ``0 .. num_blocks - 1`` (ints and numpy integers; not
    floats, and no negative id that would index from the end).

    Raises:
        InvalidBlockError: a non-integer or out-of-range id (the first one)."""
    ids = []
    for block_id in block_ids:
        try:
            i = operator.index(block_id)
        except TypeError:
            raise InvalidBlockError(f"block id {block_id!r} is not an integer") from None
        if not 0 <= i < num_blocks:
            raise InvalidBlockError(f"block id {block_id!r} outside 0..{num_blocks - 1}")
        ids.append(i)
    return ids


_POOL_IDS = itertools.count()
#: an empty run of blocks (a requeue with nothing on one side)
_NO_BLOCKS: list[KVCacheBlock] = []

#: the most blocks a pool may have: block ids are int32 on the device (block tables, state
#: indices), and -1 marks a null entry there
MAX_BLOCKS = 2**31 - 1
#: bytes of bookkeeping a pool keeps per block before any block is used (one list slot, plus an
#: arena pool's free-time stamp): the bound the machine's memory is checked against
BOOKKEEPING_BYTES_PER_BLOCK = 16


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (``sysconf``), or None where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def check_num_blocks(num_blocks: object) -> int:
    """`num_blocks` of a pool: an int in ``2 .. MAX_BLOCKS`` whose up-front bookkeeping
    (``BOOKKEEPING_BYTES_PER_BLOCK`` per block) fits in the machine's memory.

    Raises:
        InvalidTokenCountError: not an int >= 2.
        InvalidSpecError: more than ``MAX_BLOCKS`` (int32 block ids), or bookkeeping beyond the
            machine's memory; the message names the knobs (a larger page or block, less memory).
    """
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
        raise InvalidTokenCountError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
    if num_blocks > MAX_BLOCKS:
        raise InvalidSpecError(
            f"num_blocks {num_blocks:,} is more than {MAX_BLOCKS:,} (block ids are int32 on the device): "
            f"use larger blocks or pages (page_tokens) or less cache memory")
    memory = physical_memory_bytes()
    need = num_blocks * BOOKKEEPING_BYTES_PER_BLOCK
    if memory is not None and need > memory:
        raise InvalidSpecError(
            f"num_blocks {num_blocks:,} needs {need / 2**30:.1f} GiB of bookkeeping, more than this machine's "
            f"{memory / 2**30:.1f} GiB: use larger blocks or pages (page_tokens) or less cache memory")
    return num_blocks


class PoolBlocks(Sequence[KVCacheBlock]):
    """``BlockPool.blocks``: the block with id `i` at index `i`, for every id ``0 ..
    num_blocks - 1``. A block the pool has not made yet is made on first access (as it would
    have been: free, unhashed, at its place in the free queue); iterating makes every block."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        pool = self._pool
        n = pool.num_blocks
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"block id {i} outside 0..{n - 1}")
        made = pool._made
        b = made[i] if i < len(made) else None
        return b if b is not None else pool._make_block(i)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for i in range(self._pool.num_blocks):
            yield self[i]


class BlockPool:
    """All blocks of the KV cache: the null block, the free queue, ref counts, the prefix cache.

    Args:
        num_blocks: blocks in the pool including the null block 0 (>= 2). Blocks are made on
            first use: the pool costs ``BOOKKEEPING_BYTES_PER_BLOCK`` or less per block until
            then (docs/benchmarks.md, "Building a pool").
        enable_caching: keep a prefix-cache map; when False nothing is ever hashed.
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared events
            for ``take_events()``.

    Raises:
        InvalidTokenCountError: `num_blocks` is not an int >= 2.
        InvalidSpecError: `num_blocks` above ``MAX_BLOCKS``, or bookkeeping beyond the
            machine's memory (``check_num_blocks``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False) -> None:
        self.num_blocks = check_num_blocks(num_blocks)
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        #: distinguishes this pool's blocks from any other pool's (``KVCacheBlock.pool_id``)
        self.pool_id = next(_POOL_IDS)
        #: the blocks made so far, by id: ids ``0 .. len(_made) - 1`` (an arena pool keeps one
        #: slot per id, None while never used)
        self._made: list[KVCacheBlock | None] = [KVCacheBlock(0, self.pool_id)]
        #: index == block_id (made on first access)
        self.blocks: Sequence[KVCacheBlock] = PoolBlocks(self)
        self.null_block: KVCacheBlock = self._made[0]  # type: ignore[assignment]
        self.null_block.is_null = True
        #: the first id of the fresh run (blocks ``_fresh_lo .. num_blocks - 1`` not made yet)
        self._fresh_lo = 1
        self.free_block_queue = FreeBlockQueue((), num_fresh=num_blocks - 1, make_fresh=self._make_fresh)
        self.prefix_map = PrefixMap(record_events=enable_kv_cache_events)
        #: group id -> block hash -> block, or {block_id: block} when several share the hash
        #: (the PrefixMap's own dict: read it, change it only through the pool)
        self.cached_block_hash_to_block = self.prefix_map.maps
        #: blocks out of circulation, in no table (a decoupled pool's withdrawn blocks; 0 otherwise)
        self.num_reserved_blocks = 0

    def _make_fresh(self, n: int) -> list[KVCacheBlock]:
        """The next `n` blocks of the fresh run (the free queue spills them in this order)."""
        lo, pid = self._fresh_lo, self.pool_id
        made = [KVCacheBlock(i, pid) for i in range(lo, lo + n)]
        self._made.extend(made)
        self._fresh_lo = lo + n
        return made

    def _make_block(self, block_id: int) -> KVCacheBlock:
        """Make block `block_id`, never used so far, where it would be: the fresh run is spilled
        up to it (their queue order is their id order)."""
        self.free_block_queue.spill(block_id - self._fresh_lo + 1)
        return self._made[block_id]  # type: ignore[return-value]

    def holds_cached(self, blocks: Sequence[KVCacheBlock], keys: Sequence[bytes], group_id: int) -> bool:
        """Whether every block of `blocks` is this pool's (made here, the object at its id)
        and cached under ``keys[i]`` in group `group_id` (so no null block). One pass, no
        per-block call: the check of a prefix hit's blocks (False says nothing about which)."""
        made = self._made
        n = len(made)
        if len(blocks) > len(keys):
            return False
        for block, key in zip(blocks, keys):
            i = block.block_id
            if not (0 <= i < n and made[i] is block and block.block_hash == key and block.cache_group_id == group_id):
                return False
        return True

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
        if q.num_fresh:  # the walk below reads real blocks only
            q.ensure_front(num_blocks)
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
        if len(blocks) == 1:  # one block (a decode step's, a prefill chunk's old state): no lists
            block = blocks[0]
            ref_cnt = block.ref_cnt - 1
            if block.pool_id != self.pool_id:
                undo_free(blocks, block, self.pool_id)
            if block.is_null:
                return
            if ref_cnt < 0:
                undo_free(blocks, block, self.pool_id)
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                if block.block_hash is None:
                    self._requeue(blocks, _NO_BLOCKS)
                else:
                    self._requeue(_NO_BLOCKS, blocks)
            return
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
        q = self.free_block_queue
        if unhashed:
            q.prepend_unchecked(unhashed)
        if hashed:
            q.append_unchecked(hashed)

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
        made = self._made
        for block_id in ids:
            block = made[block_id] if block_id < len(made) else None  # a block never made holds nothing
            if block is not None and block.block_hash is not None and not block.is_null:
                self.prefix_map.remove(block)
                if block.ref_cnt == 0:
                    queue.remove(block)
                    queue.prepend_n([block])

    def evict_first(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Move free cached `blocks` to the head of the cached part of the free queue (right
        after the unhashed free blocks, which the pool keeps first): the next eviction takes
        them, a hit may still revive them. O(unhashed free blocks)::

            queue  u1 u2 | h1 h2 OLD h3    ->    u1 u2 | OLD h1 h2 h3

        Raises (nothing changed):
            BlockNotFreeError: a block is not in the free queue, or carries no hash.
        """
        q = self.free_block_queue
        for b in blocks:
            if b.prev_free_block is None or b.block_hash is None:
                raise BlockNotFreeError(f"block {b.block_id} is not a free cached block")
        for b in blocks:
            q.remove(b)
        node: Any = q.head.next_free_block
        while node is not q.tail and node.block_hash is None:
            node = node.next_free_block
        q.insert_before(node, blocks)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, if no block other than the null block is in use.

        Returns False and changes nothing while any request holds a block (free or preempt
        them first, see docs/engine-integration.md). Out-of-circulation blocks (``num_reserved_blocks``) do
        not count as in use here."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1 - self.num_reserved_blocks:
            return False
        for block in self._made:
            if block is not None:
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
        q = self.free_block_queue
        q.check_invariants()
        null = self.null_block
        assert null.block_id == 0 and null.is_null and null.block_hash is None
        assert null.prev_free_block is None and null.next_free_block is None, "null block queued"
        assert null.ref_cnt == 0, f"null block ref count {null.ref_cnt}"
        free = list(q.made_blocks())
        queued = {b.block_id for b in free}
        assert 0 not in queued
        seen_hashed: KVCacheBlock | None = None  # unhashed free blocks first (get_new_unhashed_block relies on it)
        for b in free:
            if b.block_hash is not None:
                seen_hashed = seen_hashed or b
            else:
                assert seen_hashed is None, (f"free queue: unhashed block {b.block_id} behind cached block "
                                             f"{seen_hashed.block_id}")
        hashed = 0
        self._check_made()
        for made in self._made[1:]:
            if made is None:
                continue
            b = made
            assert not b.is_null and b.pool_id == self.pool_id
            assert b.ref_cnt >= 0
            assert (b.block_id in queued) == (b.ref_cnt == 0), f"block {b.block_id} ref {b.ref_cnt} vs queue"
            if b.block_hash is not None:
                hashed += 1
        self.prefix_map.check_invariants(hashed)

    def _check_made(self) -> None:
        """The blocks not made yet are exactly the fresh run (an arena pool's withdrawn ones too)."""
        made, lo = self._made, self._fresh_lo
        assert self.num_blocks - lo == self.free_block_queue.num_fresh, "fresh run count"
        assert len(made) == lo and all(b is not None and b.block_id == i for i, b in enumerate(made)), \
            "blocks made out of the fresh run's order"
