"""ArenaPool: a BlockPool whose blocks live in superblocks that a SuperblockArena lends out.

The decoupled layout (:mod:`mambakv.core.arena`) has two pools over one byte budget: attention
pages (``k`` per superblock) and Mamba state slots (one per superblock). Block ``i`` of a pool
lives in superblock ``i // per_superblock``. A pool may use a block only while the arena has
lent its superblock to that pool; every other block is *withdrawn*: ref count 1, held by the
arena, counted in ``num_reserved_blocks``, never in a table.

On top of the BlockPool's rules the pool tracks, per superblock, how many of its blocks are out
of the free queue (``held``: in a table, or withdrawn), and the clock tick at which each block
last reached ref count 0. The arena reads both to choose what to convert::

    superblock 7 of the page pool (k = 4):  pages 28 29 30 31
        ref counts 0 2 0 0  -> held 1 (not convertible: page 29 is in a table)
        free_blocks([p29])  -> held 0 -> superblock 7 joins ``convertible`` (stamped now)

The overrides add one short loop per call over the blocks whose ref count crosses 0; the
unified layout uses the plain BlockPool and pays nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool

__all__ = ["ArenaClock", "ArenaPool"]


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
        track_convertible: keep ``convertible`` (the page pool; the slot pool does not need it).
        enable_caching / enable_kv_cache_events: as BlockPool.

    Attributes:
        held: per superblock, blocks out of the free queue (in a table or withdrawn; the null
            block counts as held, so superblock 0 never converts).
        freed_at: per block, the clock tick of its last return to the free queue.
        convertible: superblocks whose blocks are all free, oldest first (the value is the
            tick at which the last one was freed); maintained only with `track_convertible`
            and only for superblocks the arena marks as lent (``lent``).
        lent: per superblock, True while this pool may use its blocks.
    """

    def __init__(self, num_superblocks: int, per_superblock: int, clock: ArenaClock, *,
                 track_convertible: bool, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        super().__init__(num_superblocks * per_superblock, enable_caching, enable_kv_cache_events)
        self.per_superblock = per_superblock
        self.clock = clock
        self.track_convertible = track_convertible
        self.held = [0] * num_superblocks
        self.freed_at = [0] * self.num_blocks
        self.lent = [False] * num_superblocks
        self.convertible: OrderedDict[int, int] = OrderedDict()
        self.held[0] = 1  # the null block: superblock 0 is never converted

    def superblock_blocks(self, sb: int) -> list[KVCacheBlock]:
        """The blocks of superblock `sb` (the null block included for superblock 0)."""
        k = self.per_superblock
        return self.blocks[sb * k:(sb + 1) * k]

    # ------------------------------------------------------------------ held counts
    def _took(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`blocks` just left the free queue."""
        k, held, conv = self.per_superblock, self.held, self.convertible
        for b in blocks:
            sb = b.block_id // k
            if not held[sb] and sb in conv:
                del conv[sb]
            held[sb] += 1

    def _returned(self, blocks: list[KVCacheBlock]) -> None:
        """`blocks` (some may still be held by a table) were just freed once."""
        k, held, stamp, now = self.per_superblock, self.held, self.freed_at, self.clock.now
        track, lent, conv = self.track_convertible, self.lent, self.convertible
        for b in blocks:
            if b.ref_cnt:
                continue
            i = b.block_id
            stamp[i] = now
            sb = i // k
            h = held[sb] - 1
            held[sb] = h
            if not h and track and lent[sb]:
                conv[sb] = now

    # ------------------------------------------------------------------ BlockPool overrides
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = super().get_new_blocks(num_blocks)
        self._took(blocks)
        return blocks

    def get_new_unhashed_block(self) -> KVCacheBlock | None:
        block = super().get_new_unhashed_block()
        if block is not None:
            self._took((block,))
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        if not isinstance(blocks, (list, tuple)):
            blocks = list(blocks)
        queued = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
        super().touch(blocks)
        self._took(queued)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        if type(blocks) is not list:
            blocks = list(blocks)
        self.clock.now += 1
        super().free_blocks(blocks)
        self._returned(blocks)

    # ------------------------------------------------------------------ the arena's moves
    def withdraw(self, sb: int) -> None:
        """Take every block of superblock `sb` out of circulation (all must be free): cached
        ones lose their hash (BlockRemoved when events are on)."""
        q, evict = self.free_block_queue, self.prefix_map.remove
        blocks = self.superblock_blocks(sb)
        for b in blocks:
            q.remove(b)  # BlockNotFreeError if a table holds it: the arena checks first
            if b.block_hash is not None:
                evict(b)
            b.ref_cnt = 1
        self.num_reserved_blocks += len(blocks)
        self.held[sb] += len(blocks)
        self.lent[sb] = False
        self.convertible.pop(sb, None)

    def lend(self, sb: int) -> None:
        """Put every block of the withdrawn superblock `sb` at the head of the free queue
        (unhashed: they are reused first)."""
        blocks = self.superblock_blocks(sb)
        for b in blocks:
            assert b.ref_cnt == 1 and b.block_hash is None, f"block {b.block_id} is not withdrawn"
            b.ref_cnt = 0
            self.freed_at[b.block_id] = self.clock.now
        self.free_block_queue.prepend_n(blocks, checked=False)
        self.num_reserved_blocks -= len(blocks)
        self.held[sb] -= len(blocks)
        self.lent[sb] = True
        if self.track_convertible and not self.held[sb]:
            self.convertible[sb] = self.clock.now

    def superblock_is_free(self, sb: int) -> bool:
        """Every block of the lent superblock `sb` is in the free queue."""
        return self.lent[sb] and not self.held[sb]

    def check_arena(self) -> None:
        """Assert ``held`` and ``convertible`` match the blocks (on top of check_invariants)."""
        k = self.per_superblock
        for sb in range(len(self.held)):
            blocks = self.superblock_blocks(sb)
            out = sum(1 for b in blocks if b.ref_cnt > 0 or b.is_null)
            assert self.held[sb] == out, f"superblock {sb}: held {self.held[sb]} != {out}"
            if not self.lent[sb] and sb:
                assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks), \
                    f"superblock {sb} withdrawn but a block is in use or cached"
            if self.track_convertible:
                assert (sb in self.convertible) == (self.lent[sb] and out == 0), \
                    f"superblock {sb}: convertible set wrong"
        assert self.num_reserved_blocks == sum(k for sb in range(1, len(self.held)) if not self.lent[sb]) + (
            0 if self.lent[0] else k - 1), "reserved count != withdrawn blocks"
        stamps = list(self.convertible.values())
        assert stamps == sorted(stamps), "convertible superblocks out of age order"
