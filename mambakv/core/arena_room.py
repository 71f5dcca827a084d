"""The decoupled arena's room-making when it evicts in units (:mod:`mambakv.core.units`).

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

from typing import TYPE_CHECKING

from mambakv.core.arena_pool import ArenaPool
from mambakv.core.errors import OutOfBlocksError
from mambakv.core.unit_types import Unit

if TYPE_CHECKING:
    from mambakv.core.units import UnitIndex

__all__ = ["UnitRoom", "count_unhashed"]

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


class UnitRoom:
    """Mixin of SuperblockArena (it provides the pools, ``k``, ``_free`` and the conversions)."""

    pages: ArenaPool
    slots: ArenaPool
    k: int
    _free: list[int]
    units: UnitIndex | None

    def _lend_slot(self, sb: int) -> None: ...
    def _lend_pages(self, sb: int) -> None: ...
    def _pages_to_slot(self, sb: int) -> None: ...
    def _slot_to_pages(self, sb: int) -> None: ...

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
