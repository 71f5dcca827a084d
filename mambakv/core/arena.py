"""SuperblockArena: attention pages and Mamba state slots carved from one byte budget.

The ``decoupled`` layout (issue 14; facts in ``shared/CACHE.md``). Memory is
``num_superblocks`` superblocks of ``k`` attention pages each; a superblock is at any time

=========  =========================================================================
FREE       lent to no pool (all its page ids and its slot id are withdrawn)
PAGES      lent to the page pool: ``k`` page ids (superblock 0 always: it holds the null page)
SLOT       lent to the slot pool: one state slot id, ``k x page_bytes - state_bytes`` bytes idle
=========  =========================================================================

Page id ``p`` lies at byte ``p x page_bytes`` and slot id ``s`` at ``s x superblock_bytes`` of the
raw tensors, so both are plain strided views (``mambakv.device.decoupled``). There is no static
split: a superblock moves between the pools when the allocation in hand needs it.

Which memory an allocation takes without a unit index (``make_room``; plain block LRU across both
kinds, by the tick at which a block last became free, ``ArenaPool.freed_at``; with one, the
policy evicts whole units first: below)::

    slot needed:  an unhashed free slot  > a FREE superblock  > the older of
                  (the LRU cached slot, the first all-free page superblock on the page
                   queue's walk from its head, aged by its newest page: its k pages go)
    page needed:  an unhashed free page  > a FREE superblock  > the older of
                  (the LRU cached page, the head free slot beyond this step's slot needs,
                   unhashed or not, by the tick it was freed)

A page superblock converts to a slot only when none of its pages is in a table, so no live
page is ever lost; a slot converts to pages only when it is free.

``SuperblockArena.make_room`` with a unit index first lets the policy evict whole units until
the step's pops and conversions can come from memory that holds nothing (no cached block is
dropped by a pop), then converts superblocks from that memory::

    slot needed:  an unhashed free slot  > a FREE superblock  > an all-free page superblock
                  of unhashed pages  > (fallback) the LRU cached slot  > any all-free page superblock
    page needed:  an unhashed free page  > a FREE superblock  > an unhashed spare slot
                  > (fallback) the LRU cached pages (the pops)  > a cached spare slot

A fallback drops a cached block the policy did not choose (when every leaf unit is pinned or
the free memory is split over superblocks); ``UnitIndex.settle`` then drops what it made
unreachable, so the unit invariants hold either way.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from mambakv.core.arena_geometry import ArenaBytes, SuperblockGeometry
from mambakv.core.arena_pool import ArenaClock, ArenaPool
from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import OutOfBlocksError
from mambakv.core.eviction import EvictionPolicy
from mambakv.core.unit_types import Unit
from mambakv.core.units import UnitIndex

__all__ = ["ArenaBytes", "SuperblockArena", "SuperblockGeometry"]

FREE, PAGES, SLOT = 0, 1, 2

#: page superblocks a slot allocation tries, from the LRU end, before a fallback
LRU_PROBE = 32


def count_unhashed(pool: ArenaPool, limit: int) -> int:
    """Free blocks without a hash at the head of `pool`'s queue, counted up to `limit`."""
    q = pool.free_block_queue
    tail = q.sentinels[1]
    block = q.first()
    n = 0
    while n < limit and block is not None and block is not tail and block.block_hash is None:
        n += 1
        block = block.next_free_block
    return n


class SuperblockArena:
    """The two pools of the decoupled layout and the superblocks they borrow.

    Args:
        geometry: the byte geometry.
        enable_caching / enable_kv_cache_events: as BlockPool (both pools).

    Attributes:
        pages: the attention page pool (``geometry.num_pages`` ids).
        slots: the Mamba state slot pool (``geometry.num_superblocks`` ids; slot 0 is null).
        num_conversions: superblocks moved between the pools so far.
    """

    def __init__(self, geometry: SuperblockGeometry, *, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        self.geometry = g = geometry
        self.k = g.pages_per_superblock
        clock = ArenaClock()
        # every superblock but 0 starts FREE: withdrawn from both pools (their blocks are made on
        # first use, so building the arena costs a few list slots per superblock)
        self.pages = ArenaPool(g.num_superblocks, self.k, clock, lend_first=True, enable_caching=enable_caching,
                               enable_kv_cache_events=enable_kv_cache_events)
        self.slots = ArenaPool(g.num_superblocks, 1, clock, enable_caching=enable_caching,
                               enable_kv_cache_events=enable_kv_cache_events)
        #: per superblock FREE / PAGES / SLOT
        self.kind = [FREE] * g.num_superblocks
        self.kind[0] = PAGES
        #: FREE superblocks, lowest id first (a stack: pop() takes the highest; ids carry no meaning)
        self._free = array("l", range(g.num_superblocks - 1, 0, -1))
        self.num_conversions = 0
        #: the eviction units and their policy (``enable_units``), else None: block LRU
        self.units: UnitIndex | None = None

    def enable_units(self, page_gids: Sequence[int], state_gids: Sequence[int], policy: EvictionPolicy, *,
                     page_tokens: int) -> UnitIndex:
        """Evict in units (:mod:`mambakv.core.units`; the module docstring's second picture) chosen by
        `policy`; call before any block is cached. `page_gids`: the full-attention groups,
        `state_gids`: the Mamba groups, `page_tokens`: tokens per page."""
        for pool in (self.pages, self.slots):
            pool.record_losses()
        g = self.geometry
        self.units = UnitIndex(self.pages, self.slots, page_gids, state_gids, page_tokens=page_tokens,
                               page_bytes=g.page_bytes, slot_bytes=g.superblock_bytes, policy=policy)
        self.pages.after_evict = self.slots.after_evict = self.units.settle
        return self.units

    # ------------------------------------------------------------------ queries
    @property
    def num_free_superblocks(self) -> int:
        return len(self._free)

    @property
    def bytes(self) -> ArenaBytes:
        """Budget by use; O(1)."""
        g = self.geometry
        n_slot = g.num_superblocks - 1 - self.slots.num_reserved_blocks  # lent slot superblocks
        n_free = len(self._free)
        n_pages = g.num_superblocks - n_slot - n_free
        return ArenaBytes(n_pages * g.superblock_bytes, n_slot * g.state_bytes, n_slot * g.slot_idle_bytes,
                          n_free * g.superblock_bytes, g.total_bytes)

    @property
    def usage(self) -> float:
        """Fraction of the budget in tables (held pages and slots, idle tails of held slots
        included), null page excluded."""
        g = self.geometry
        held_pages = g.num_pages - 1 - self.pages.num_reserved_blocks - self.pages.get_num_free_blocks()
        held_slots = g.num_superblocks - 1 - self.slots.num_reserved_blocks - self.slots.get_num_free_blocks()
        return (held_pages * g.page_bytes + held_slots * g.superblock_bytes) / (g.total_bytes - g.page_bytes)

    def can_supply(self, num_pages: int, num_slots: int, hits: Iterable[KVCacheBlock] | None = None) -> bool:
        """Whether ``num_pages`` pages and ``num_slots`` slots can be taken now (the counts
        include the free hit blocks in `hits`, which the step will touch, not pop). Exact: it
        follows make_room's sources in the order that leaves most pages. Changes nothing."""
        k, pages, slots = self.k, self.pages, self.slots
        if hits is None:  # a running request's step: no hit to set apart
            free_slots = slots.free_block_queue.num_free_blocks
            if num_slots <= free_slots:
                return num_pages <= (pages.free_block_queue.num_free_blocks
                                     + k * (len(self._free) + free_slots - num_slots))
            hits = ()
        hit_pages = hit_slots = 0
        hit_sbs: set[int] = set()
        for b in hits:
            if b.ref_cnt or b.is_null:
                continue
            if b.pool_id == pages.pool_id:
                hit_pages += 1
                hit_sbs.add(b.block_id // k)
            else:
                hit_slots += 1
        free_slots = slots.get_num_free_blocks() - hit_slots
        need_slots = num_slots - hit_slots
        from_free = min(need_slots, free_slots)
        rest = need_slots - from_free
        from_unlent = min(rest, len(self._free))
        from_pages = rest - from_unlent
        if from_pages and len(pages.find_free_superblocks(from_pages, hit_sbs)) < from_pages:
            return False
        page_room = (pages.get_num_free_blocks() - hit_pages - from_pages * k
                     + k * (len(self._free) - from_unlent) + k * (free_slots - from_free))
        return num_pages - hit_pages <= page_room

    # ------------------------------------------------------------------ conversions
    def make_room(self, num_pages: int, num_slots: int) -> None:
        """Convert superblocks so that popping ``num_pages`` pages and ``num_slots`` slots from
        the pools' heads takes, per the module's rules, the least recently used memory. Call
        after the step's hits are touched, with the pops still to come.

        Raises:
            OutOfBlocksError: not enough state slots can be found (``can_supply`` said no);
                pages are not checked here: the page pops themselves raise when short.
        """
        if self.units is not None:
            if not num_slots and count_unhashed(self.pages, num_pages) == num_pages:
                return  # the common decode page crossing: the pops take unhashed free pages
            self._evict_units_for(num_pages, num_slots)
            self._room_for_slots_units(num_slots, num_pages)
            self._room_for_pages_units(num_pages, num_slots)
            return
        self._room_for_slots(num_slots, num_pages)
        self._room_for_pages(num_pages, num_slots)

    def _room_for_slots(self, need: int, need_pages: int) -> None:
        slots, pages, k = self.slots, self.pages, self.k
        got, walk = 0, slots.free_block_queue.first()
        tail = slots.free_block_queue.sentinels[1]
        while got < need:
            if walk is not None and walk.block_hash is None:
                got, walk = got + 1, _next(walk, tail)
                continue
            if self._free:
                self._lend_slot(self._free.pop())
                got += 1
                continue
            # With a cached slot to evict instead, only probe the LRU end of the page queue: a
            # full walk finds nothing when live pages are spread over every superblock.
            found = pages.find_free_superblocks(1, max_tried=None if walk is None else LRU_PROBE)
            spare_pages = pages.get_num_free_blocks() - k >= need_pages
            if found and (walk is None or (spare_pages and found[0][1] < slots.freed_at[walk.block_id])):
                self._pages_to_slot(found[0][0])
                got += 1
                continue
            if walk is None:
                raise OutOfBlocksError(f"no room for {need} state slots")
            got, walk = got + 1, _next(walk, tail)

    def _room_for_pages(self, need: int, need_slots: int) -> None:
        slots, pages, k = self.slots, self.pages, self.k
        tail = pages.free_block_queue.sentinels[1]
        got, walk = 0, pages.free_block_queue.first() or tail
        while got < need and walk is not tail and walk.block_hash is None:  # free without eviction
            got, walk = got + 1, walk.next_free_block  # type: ignore[assignment]
        stamps = pages.freed_at
        while got < need:
            if self._free:
                self._lend_pages(self._free.pop())
                got += k
                continue
            spare = slots.free_block_queue.first() if slots.get_num_free_blocks() > need_slots else None
            if spare is None:
                return  # the pops evict the LRU cached pages (can_supply counted them)
            # Cached pages are in free order (stamps ascending): those freed before the spare go
            # first. An unhashed spare is compared by its free time too: turning a just-freed
            # running state into pages, only to take a page superblock (and its cached pages)
            # for the next request's state, churned superblocks and lost hits (0.0804 vs 0.0845
            # on the trace, 60 GiB, conversation replay).
            spare_at = slots.freed_at[spare.block_id]
            while got < need and walk is not tail and stamps[walk.block_id] <= spare_at:
                got, walk = got + 1, walk.next_free_block  # type: ignore[assignment]
            if got < need:
                self._slot_to_pages(spare.block_id)
                got += k

    def _lend_slot(self, sb: int) -> None:
        self.slots.lend(sb)
        self.kind[sb] = SLOT
        self.num_conversions += 1

    def _lend_pages(self, sb: int) -> None:
        self.pages.lend(sb)
        self.kind[sb] = PAGES
        self.num_conversions += 1

    def _pages_to_slot(self, sb: int) -> None:
        assert self.kind[sb] == PAGES and self.pages.superblock_is_free(sb), f"superblock {sb} has a live page"
        self.pages.withdraw(sb)
        self._lend_slot(sb)

    def _slot_to_pages(self, sb: int) -> None:
        assert self.kind[sb] == SLOT and self.slots.superblock_is_free(sb), f"slot {sb} is in a table"
        self.slots.withdraw(sb)
        self._lend_pages(sb)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Both pools' invariants and bookkeeping; each superblock lent to exactly the pool its
        kind says (superblock 0: pages); the FREE list is exactly the FREE superblocks."""
        for pool in (self.pages, self.slots):
            pool.check_invariants()
            pool.check_arena()
        assert self.kind[0] == PAGES and self.pages.lent[0] and not self.slots.lent[0]
        for sb, kind in enumerate(self.kind):
            assert self.pages.lent[sb] == (kind == PAGES), f"superblock {sb}: page pool disagrees with {kind}"
            assert self.slots.lent[sb] == (kind == SLOT), f"superblock {sb}: slot pool disagrees with {kind}"
        assert sorted(self._free) == [sb for sb, kind in enumerate(self.kind) if kind == FREE], "FREE list"
        b = self.bytes
        assert b.pages + b.states + b.idle + b.free == b.total  # the units: the coordinator checks them

    def settle(self) -> None:
        """Follow up evictions the unit index did not choose (no-op without units)."""
        if self.units is not None:
            self.units.settle()

    # ------------------------------------------------------------------ room, by units
    def _evict_units_for(self, need_pages: int, need_slots: int) -> None:
        """Evict the policy's victims until the step needs no cached block."""
        units = self.units
        assert units is not None
        k, pages, slots = self.k, self.pages, self.slots
        u_slots = count_unhashed(slots, need_slots + need_pages // k + 1)
        u_pages = count_unhashed(pages, need_pages)
        policy, now = units.policy, units.now

        def is_free(unit: Unit) -> bool:
            return units.state_free(unit.key)

        while True:
            free_sb = len(self._free)
            slot_short = need_slots - u_slots
            from_free = min(max(slot_short, 0), free_sb)
            slot_short -= from_free
            page_supply = u_pages + k * (free_sb - from_free + max(0, u_slots - need_slots))
            if slot_short > 0 and page_supply - need_pages >= k * slot_short and len(
                    pages.find_free_superblocks(slot_short, max_tried=LRU_PROBE, unhashed=True)) >= slot_short:
                page_supply -= k * slot_short
                slot_short = 0
            if slot_short <= 0 and page_supply >= need_pages:
                return
            unit = policy.victim(now, is_free)
            if unit is None:
                return  # the fallbacks take the rest
            freed_pages, freed_slots = units.evict_unit(unit)
            u_pages += freed_pages
            u_slots += freed_slots

    def _room_for_slots_units(self, need: int, need_pages: int) -> None:
        slots, pages, k = self.slots, self.pages, self.k
        tail = slots.free_block_queue.sentinels[1]
        got, walk = 0, slots.free_block_queue.first()
        if walk is tail:
            walk = None
        while got < need:
            if walk is not None and walk.block_hash is None:
                got += 1
                walk = walk.next_free_block if walk.next_free_block is not tail else None
                continue
            if self._free:
                self._lend_slot(self._free.pop())
                got += 1
                continue
            found = pages.find_free_superblocks(1, max_tried=LRU_PROBE, unhashed=True)
            if found and pages.get_num_free_blocks() - k >= need_pages:
                self._pages_to_slot(found[0][0])
                got += 1
                continue
            if walk is not None:  # fallback: the pop evicts the LRU cached slot
                got += 1
                walk = walk.next_free_block if walk.next_free_block is not tail else None
                continue
            found = pages.find_free_superblocks(1)
            if not found:
                raise OutOfBlocksError(f"no room for {need} state slots")
            self._pages_to_slot(found[0][0])
            got += 1

    def _spare_slot(self, need_slots: int, *, unhashed: bool) -> int | None:
        """The free slot after the `need_slots` the step pops (unhashed only, if asked), or None."""
        q = self.slots.free_block_queue
        tail = q.sentinels[1]
        block = q.first()
        for _ in range(need_slots):
            if block is None or block is tail:
                return None
            block = block.next_free_block
        if block is None or block is tail or (unhashed and block.block_hash is not None):
            return None
        return block.block_id

    def _room_for_pages_units(self, need: int, need_slots: int) -> None:
        k, pages = self.k, self.pages
        got = count_unhashed(pages, need)
        while got < need and self._free:
            self._lend_pages(self._free.pop())
            got += k
        while got < need:
            sb = self._spare_slot(need_slots, unhashed=True)
            if sb is None:
                break
            self._slot_to_pages(sb)
            got += k
        while pages.get_num_free_blocks() < need:  # fallback: only cached slots are left
            sb = self._spare_slot(need_slots, unhashed=False)
            if sb is None:
                return  # the pops raise (can_supply said yes: not reached)
            self._slot_to_pages(sb)


def _next(block: KVCacheBlock, tail: KVCacheBlock) -> KVCacheBlock | None:
    nxt = block.next_free_block
    return None if nxt is tail else nxt
