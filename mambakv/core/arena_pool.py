"""ArenaPool: a BlockPool whose blocks live in superblocks that a SuperblockArena lends out.

The decoupled layout (:mod:`mambakv.core.arena`) has two pools over one byte budget: attention
pages (``k`` per superblock) and Mamba state slots (one per superblock). Block ``i`` of a pool
lives in superblock ``i // per_superblock``. A pool may use a block only while the arena has
lent its superblock to that pool; every other block is *withdrawn*: ref count 1, held by the
arena, counted in ``num_reserved_blocks``, never in a table.

On top of the BlockPool's rules the pool stamps each block with the clock tick at which it
last reached ref count 0 (``freed_at``), so that the arena can compare the age of a cached page
with the age of a cached state. It keeps no per-superblock counts: the hot paths (pop, touch)
are the BlockPool's own, and the arena finds an all-free page superblock by walking the free
queue from its LRU head (:meth:`find_free_superblocks`)::

    superblock 7 of the page pool (k = 4):  pages 28 29 30 31
        ref counts 0 2 0 0  -> not free (page 29 is in a table)
        free_blocks([p29])  -> all four free: a candidate once the walk reaches one of them
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

from mambakv.core.block import FreeBlockQueue, KVCacheBlock
from mambakv.core.block_pool import BlockPool, PrefixMap
from mambakv.core.errors import BlockNotFreeError

__all__ = ["ArenaClock", "ArenaPool", "RecordingPrefixMap"]


class RecordingPrefixMap(PrefixMap):
    """A PrefixMap that records the hash of every block it drops (``lost``), so that the unit
    index can follow up an eviction it did not choose (:meth:`UnitIndex.settle`). Its own
    evictions go through :meth:`ArenaPool.drop_cached`, which records nothing."""

    __slots__ = ("lost",)

    def __init__(self, record_events: bool = False) -> None:
        super().__init__(record_events)
        self.lost: list[bytes] = []

    def remove(self, block: KVCacheBlock) -> bool:
        self.lost.append(block.block_hash)  # type: ignore[arg-type]
        return super().remove(block)

    def remove_many(self, blocks: Sequence[KVCacheBlock]) -> None:
        lost = self.lost
        for b in blocks:
            if b.block_hash is not None:
                lost.append(b.block_hash)
        super().remove_many(blocks)


class ArenaClock:
    """A tick shared by the two pools of one arena: +1 per ``free_blocks`` call, so the
    stamps of pages and of states compare (older = smaller)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0


class ArenaPool(BlockPool):
    """A BlockPool over ``num_superblocks x per_superblock`` blocks (block 0 is the null block).

    Args:
        num_superblocks: superblocks of the arena (>= 2).
        per_superblock: blocks per superblock (attention pages ``k``; 1 for state slots).
        clock: the arena's shared clock.
        enable_caching / enable_kv_cache_events: as BlockPool.

    Attributes:
        freed_at: per block, the clock tick of its last return to the free queue (or of its
            superblock's lending).
        lent: per superblock, True while this pool may use its blocks.
    """

    def __init__(self, num_superblocks: int, per_superblock: int, clock: ArenaClock, *, lend_first: bool = False,
                 enable_caching: bool = True, enable_kv_cache_events: bool = False) -> None:
        super().__init__(num_superblocks * per_superblock, enable_caching, enable_kv_cache_events)
        k = self.per_superblock = per_superblock
        self._made.extend([None] * (self.num_blocks - 1))  # one slot per id: superblocks are made in any order
        self.clock = clock
        self.freed_at = [0] * self.num_blocks
        #: per superblock, True while this pool may use its blocks; every superblock starts
        #: withdrawn (its blocks made on first use), superblock 0 lent with `lend_first`
        self.lent = [False] * num_superblocks
        self.lent[0] = lend_first
        # superblock 0's blocks after the null block, made now: an arena pool's queue has no
        # fresh run (its walks, find_free_superblocks and the arena's, read real blocks only)
        first = [KVCacheBlock(i, self.pool_id) for i in range(1, k)] if lend_first else []
        self._made[1:k] = first
        self.free_block_queue = FreeBlockQueue(first)
        self.num_reserved_blocks = self.num_blocks - 1 - len(first)
        #: called after ``evict_blocks`` (the unit index's ``settle``), or None
        self.after_evict: Callable[[], None] | None = None

    def _make_block(self, block_id: int) -> KVCacheBlock:
        """Make block `block_id`, never used so far: its whole superblock, withdrawn (ref count
        1, unqueued), as a superblock the arena never lent holds it."""
        sb = block_id // self.per_superblock
        return self._make_superblock(sb, withdrawn=True)[block_id - sb * self.per_superblock]

    def _check_made(self) -> None:
        """No fresh run; superblock 0 exists (``check_arena`` checks the others)."""
        assert self.free_block_queue.num_fresh == 0, "an arena pool's queue has a fresh run"
        assert len(self._made) == self.num_blocks and self._made[0] is self.null_block, "block slots"

    def _make_superblock(self, sb: int, *, withdrawn: bool) -> list[KVCacheBlock]:
        """Make the blocks of superblock `sb` (none of which exists), at ref count 1 when
        `withdrawn`, else 0 (about to be lent)."""
        k, pid = self.per_superblock, self.pool_id
        blocks = [KVCacheBlock(i, pid) for i in range(sb * k, (sb + 1) * k)]
        if withdrawn:
            for b in blocks:
                b.ref_cnt = 1
        self._made[sb * k:(sb + 1) * k] = blocks
        return blocks

    def record_losses(self) -> None:
        """Record every dropped hash from now on (the unit index's mode); call before any
        block is cached."""
        assert not any(self.cached_block_hash_to_block.values()), "record_losses on a pool with cached blocks"
        self.prefix_map = RecordingPrefixMap(record_events=self.enable_kv_cache_events)
        self.cached_block_hash_to_block = self.prefix_map.maps

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """As BlockPool's; with a unit index, it then follows up what the loss made unreachable
        (``UnitIndex.settle``: more cached blocks may lose their hash and move to the head)."""
        super().evict_blocks(block_ids)
        if self.after_evict is not None:
            self.after_evict()

    def drop_cached(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop the hashes of these free cached blocks and move them to the head of the free queue
        (free without eviction), as ``evict_blocks`` does; nothing is recorded in ``lost``."""
        PrefixMap.remove_many(self.prefix_map, blocks)
        q = self.free_block_queue
        for b in blocks:  # the queue's remove, inlined (hot); prepend_n relinks b
            assert b.ref_cnt == 0 and not b.is_null, f"block {b.block_id} is in a table"
            prev, nxt = b.prev_free_block, b.next_free_block
            if prev is None or nxt is None:
                raise BlockNotFreeError(f"block {b.block_id} is not in the free queue")
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            b.prev_free_block = None  # a block listed twice raises, as remove does
        q.num_free_blocks -= len(blocks)
        q.prepend_n(blocks, checked=False)

    def superblock_blocks(self, sb: int) -> list[KVCacheBlock]:
        """The blocks of superblock `sb` (the null block included for superblock 0)."""
        k = self.per_superblock
        return self.blocks[sb * k:(sb + 1) * k]  # type: ignore[return-value]  # PoolBlocks slices are lists

    def superblock_is_free(self, sb: int) -> bool:
        """Superblock `sb` is lent here and every block of it is in the free queue (never
        superblock 0: it holds the null block)."""
        if not sb or not self.lent[sb]:
            return False
        k = self.per_superblock
        for b in self._made[sb * k:(sb + 1) * k]:  # a lent superblock's blocks exist
            if b.ref_cnt:  # type: ignore[union-attr]
                return False
        return True

    def find_free_superblocks(self, n: int, exclude: Container[int] = (), max_tried: int | None = None,
                              *, unhashed: bool = False) -> list[tuple[int, int]]:
        """Up to `n` superblocks whose blocks are all free, found by walking the free queue from
        its head (unhashed blocks, then the least recently freed): ``(superblock, newest
        freed_at of its blocks)`` in walk order. Superblocks in `exclude` are skipped; with
        `max_tried`, the walk stops after trying that many superblocks (a probe, not a search).

        Cost: O(k) per superblock tried. Pages of one superblock are lent together, taken by
        one table and freed together, so the walk usually stops at the first one; it is long
        only when live pages are spread over most superblocks. `unhashed`: only superblocks whose
        blocks carry no hash, found in the queue's unhashed head (the walk stops at a cached block)."""
        out: list[tuple[int, int]] = []
        if n <= 0:
            return out
        k, stamps, tried = self.per_superblock, self.freed_at, set()
        tail = self.free_block_queue.sentinels[1]
        block = self.free_block_queue.first()
        blocks: list[KVCacheBlock] = self._made  # type: ignore[assignment]  # lent superblocks' blocks exist
        while block is not None and block is not tail:
            if unhashed and block.block_hash is not None:
                break
            sb = block.block_id // k
            if sb not in tried:
                tried.add(sb)
                if sb not in exclude and self.superblock_is_free(sb) and not (
                        unhashed and any(b.block_hash is not None for b in blocks[sb * k:(sb + 1) * k])):
                    out.append((sb, max(stamps[sb * k:(sb + 1) * k])))
                    if len(out) == n:
                        break
                if max_tried is not None and len(tried) >= max_tried:
                    break
            block = block.next_free_block
        return out

    # ------------------------------------------------------------------ BlockPool override
    def _requeue(self, unhashed: list[KVCacheBlock], hashed: list[KVCacheBlock]) -> None:
        """Stamp the blocks a ``free_blocks`` call brought to ref count 0 with a new tick, then
        queue them as the BlockPool does."""
        self.clock.now += 1
        stamp, now = self.freed_at, self.clock.now
        for b in hashed:
            stamp[b.block_id] = now
        for b in unhashed:
            stamp[b.block_id] = now
        super()._requeue(unhashed, hashed)

    # ------------------------------------------------------------------ the arena's moves
    @property
    def usage(self) -> float:
        """Fraction of the lent non-null blocks in use (withdrawn blocks are not this pool's)."""
        lent = self.num_blocks - 1 - self.num_reserved_blocks
        return 1.0 - self.free_block_queue.num_free_blocks / lent if lent else 0.0

    def withdraw(self, sb: int) -> None:
        """Take every block of superblock `sb` out of circulation: cached ones lose their hash
        (BlockRemoved when events are on).

        Raises:
            BlockNotFreeError: a block of it is in a table or `sb` is not lent here; nothing changed.
        """
        if not self.superblock_is_free(sb):
            raise BlockNotFreeError(f"superblock {sb} is not lent to this pool with every block free")
        q = self.free_block_queue
        blocks: list[KVCacheBlock] = self._made[sb * self.per_superblock:(sb + 1) * self.per_superblock]  # type: ignore[assignment]
        self.prefix_map.remove_many(blocks)
        for b in blocks:
            q.remove(b)
            b.ref_cnt = 1
        self.num_reserved_blocks += len(blocks)
        self.lent[sb] = False

    def lend(self, sb: int) -> None:
        """Put every block of the withdrawn superblock `sb` at the head of the free queue
        (unhashed: they are reused first)."""
        k = self.per_superblock
        assert sb and not self.lent[sb], f"superblock {sb} is lent already"
        now = self.clock.now
        if self._made[sb * k] is None:  # never used: made now, free
            blocks = self._make_superblock(sb, withdrawn=False)
            self.freed_at[sb * k:(sb + 1) * k] = [now] * k
        else:
            blocks = self._made[sb * k:(sb + 1) * k]  # type: ignore[assignment]
            for b in blocks:
                assert b.ref_cnt == 1 and b.block_hash is None, f"block {b.block_id} is not withdrawn"
                b.ref_cnt = 0
                self.freed_at[b.block_id] = now
        self.free_block_queue.prepend_n(blocks, checked=False)
        self.num_reserved_blocks -= len(blocks)
        self.lent[sb] = True

    def check_arena(self) -> None:
        """Assert the withdrawn superblocks hold only withdrawn blocks and the reserved count
        matches them (on top of check_invariants)."""
        k = self.per_superblock
        withdrawn = 0
        made = self._made
        for sb in range(len(self.lent)):
            if self.lent[sb]:
                assert all(b is not None for b in made[sb * k:(sb + 1) * k]), f"superblock {sb} lent, not made"
                continue
            row = made[sb * k:(sb + 1) * k]
            if sb and all(b is None for b in row):  # never used: withdrawn since the start
                withdrawn += k
                continue
            blocks = [b for b in row if b is not None and not b.is_null]
            assert len(blocks) == k - (sb == 0), f"superblock {sb}: made in part"
            assert all(b.ref_cnt == 1 and b.block_hash is None and b.prev_free_block is None for b in blocks), \
                f"superblock {sb} withdrawn but a block is free, cached or in more than the arena's hands"
            withdrawn += len(blocks)
        assert self.num_reserved_blocks == withdrawn, f"reserved {self.num_reserved_blocks} != withdrawn {withdrawn}"
        assert len(self.lent) * k == self.num_blocks
