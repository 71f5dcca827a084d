"""The host-memory tier: a second byte budget that holds the same units as the GPU tier.

On the real trace a next turn comes a median 108 s after its parent while 60 GiB of GPU memory
holds about 70 s of traffic (CACHE.md): a host tier keeps units (a Mamba checkpoint and its
pages) for minutes. It is a :class:`~mambakv.core.arena.SuperblockArena` of its own (the device
layout's page and slot sizes, its own number of superblocks) with its own
:class:`~mambakv.core.units.UnitIndex` and policy; every host block is cached, at ref count 0,
except while a load reads it (pinned)::

    GPU tier                         host tier (own budget, own units, own eviction)
    unit U(p5) = states + pages  --store (D2H)-->  same hashes, host page / slot ids
    a request's hit past the GPU <--load (H2D)---  only whole units: pages up to p, state at p

When units are written (``HostWrite``):

=========  ===============================================================================
through    when a request is freed, every checkpoint on its chain the host lacks (and the
           pages up to it): the default. The host holds copies of GPU units too.
evict      when the GPU tier evicts a unit (decoupled layout with units only): the tiers hold
           disjoint units, but the store is on the evicting step's critical path.
=========  ===============================================================================

Stores are planned (:mod:`mambakv.core.transfers`) and assumed done in plan order: a host block is
written only by a store of the plan that allocated it, and read only by a load while pinned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import repeat
from operator import attrgetter

from mambakv.core.arena import SuperblockArena, SuperblockGeometry
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool, PrefixMap
from mambakv.core.eviction import EvictionPolicy
from mambakv.core.host_spec import HostStats, HostTierSpec, HostWrite, copies_of, first_copy
from mambakv.core.retention import NORMAL_RETENTION, Retention
from mambakv.core.transfers import BlockKind, LoadPlan, Tier, Transfer

__all__ = ["HostStats", "HostTier", "HostTierSpec", "HostWrite", "first_copy"]


_block_id = attrgetter("block_id")
_new_transfer = partial(tuple.__new__, Transfer)


class HostTier:
    """The host arena, its units, and the stores planned since the last drain.

    Args:
        geometry: the host arena's (``HostTierSpec.geometry``).
        gpu_pages / gpu_slots: the GPU tier's page and state pools (one pool in the unified layout).
        page_gids / state_gids: the full-attention and the align-mode Mamba group ids.
        page_tokens: tokens per page (every group's block size).
        policy: the host tier's eviction policy (its own instance).
        write: when units are stored.
    """

    def __init__(self, geometry: SuperblockGeometry, *, gpu_pages: BlockPool, gpu_slots: BlockPool,
                 page_gids: Sequence[int], state_gids: Sequence[int], page_tokens: int,
                 policy: EvictionPolicy, write: HostWrite) -> None:
        self.geometry = geometry
        self.arena = SuperblockArena(geometry)
        self.units = self.arena.enable_units(page_gids, state_gids, policy, page_tokens=page_tokens)
        # a loss (evict_blocks, a fallback pop) is followed up by the tier's settle: the pins too
        self.arena.pages.after_evict = self.arena.slots.after_evict = self.settle
        self.gpu_pages, self.gpu_slots = gpu_pages, gpu_slots
        self.page_gids, self.state_gids = tuple(page_gids), tuple(state_gids)
        self.page_tokens, self.write = page_tokens, write
        self.stats = HostStats()
        #: GPU -> HOST transfers planned since the last ``take_stores`` (drained by the
        #: coordinator's ``take_transfer_plan``, with the loads started since)
        self.stores: list[Transfer] = []
        self.loads: list[LoadPlan] = []
        #: host blocks the loads in flight read -> how many loads pin each
        self.pins: dict[KVCacheBlock, int] = {}

    # ------------------------------------------------------------------ lookups
    def _present(self, pool: BlockPool, gids: tuple[int, ...], key: bytes) -> bool:
        maps = pool.cached_block_hash_to_block
        for gid in gids:
            m = maps.get(gid)
            if m is None or key not in m:
                return False
        return True

    def gpu_page(self, key: bytes) -> bool:
        return self._present(self.gpu_pages, self.page_gids, key)

    def gpu_state(self, key: bytes) -> bool:
        return self._present(self.gpu_slots, self.state_gids, key)

    def host_page(self, key: bytes) -> bool:
        return self._present(self.arena.pages, self.page_gids, key)

    def host_state(self, key: bytes) -> bool:
        return self._present(self.arena.slots, self.state_gids, key)

    def _bisect(self, present: Callable[[bytes], bool], hashes: Sequence[bytes], upto: int) -> int:
        """The longest prefix of ``hashes[:upto]`` for which `present` holds: a tier's cached pages
        are prefix-closed along a chain (a free cached page is a node of its unit tree, whose
        parent is the page before it; a running request holds all its pages from the first)."""
        lo, hi = 0, upto
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if present(hashes[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def host_prefix(self, hashes: Sequence[bytes], upto: int) -> int:
        """Pages of ``hashes[:upto]`` the host holds, from the root (bisected)."""
        return self._bisect(self.host_page, hashes, upto)

    def find(self, hashes: Sequence[bytes], max_pages: int) -> int:
        """Pages of the deepest hit over both tiers within ``hashes[:max_pages]``: every page up to
        it cached in the GPU or the host tier (each group's copy in one of them), a state in every
        Mamba group at its last page in one tier. 0: none."""
        upto = min(max_pages, len(hashes))
        n = max(self._bisect(self.gpu_page, hashes, upto), self.host_prefix(hashes, upto))
        for i in range(n - 1, -1, -1):  # the deepest state: a chain's checkpoints sit near its end
            key = hashes[i]
            if self.gpu_state(key) or self.host_state(key):
                return i + 1
        return 0

    def gpu_checkpoints(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """``(pages, positions)``: the GPU-cached prefix of `hashes` in pages and the page indices
        on it with a state in every Mamba group (what a write-through store copies)."""
        positions: list[int] = []
        n = 0
        for key in hashes:
            if not self.gpu_page(key):
                break
            if self.gpu_state(key):
                positions.append(n)
            n += 1
        return n, positions

    # ------------------------------------------------------------------ stores
    def store_chain(self, hashes: Sequence[bytes], positions: Sequence[int], *, now: float,
                    retain: Retention = NORMAL_RETENTION,
                    prompt_tokens: int = 0) -> tuple[list[KVCacheBlock], list[KVCacheBlock]] | None:
        """Plan the stores that put the checkpoints at page indices `positions` of the chain
        `hashes` (GPU-cached up to the deepest one) in the host tier, with the pages up to them;
        what the host has already is skipped. Host units may be evicted to make room; the
        deepest page the host already holds is pinned meanwhile, which keeps every page above it
        (pruning climbs from a leaf). Returns ``(GPU pages, GPU states)`` the planned stores read
        (both empty when the host has everything already), or None when nothing could be stored
        (no room: every host block pinned, or a chain larger than the budget)."""
        positions = sorted(i for i in positions if not self.host_state(hashes[i]))
        if not positions:
            return [], []
        upto = positions[-1] + 1
        arena = self.arena
        host_maps, gpu_pmaps = arena.pages.cached_block_hash_to_block, self.gpu_pages.cached_block_hash_to_block
        gpu_smaps = self.gpu_slots.cached_block_hash_to_block
        known = self.host_prefix(hashes, upto)
        pinned = [first_copy(host_maps.get(gid), hashes[known - 1]) for gid in self.page_gids] if known else []
        sources = [copies_of(gpu_pmaps.get(gid), hashes[known:upto]) for gid in self.page_gids]
        states = [[first_copy(gpu_smaps.get(gid), hashes[i]) for i in positions] for gid in self.state_gids]
        assert all(None not in col for col in sources + states), "a stored unit is not on the GPU"
        num_pages, num_slots = (upto - known) * len(self.page_gids), len(positions) * len(self.state_gids)
        arena.pages.touch(pinned)  # type: ignore[arg-type]
        ok = arena.can_supply(num_pages, num_slots)
        if ok:
            arena.make_room(num_pages, num_slots)
            ok = arena.pages.get_num_free_blocks() >= num_pages
        if not ok:
            arena.pages.free_blocks(pinned)  # type: ignore[arg-type]
            self.settle()
            self.stats.skipped_stores += 1
            return None
        g = self.geometry
        page_dsts = [arena.pages.get_new_blocks(len(col)) for col in sources]
        slot_dsts = [arena.slots.get_new_blocks(len(col)) for col in states]
        if self.stores:
            self._drop_stale_stores(page_dsts, slot_dsts)
        stores = self.stores
        tables: list[list[KVCacheBlock]] = []
        for gid, col, dst in zip(self.page_gids, sources, page_dsts):
            arena.pages.cache_full_blocks(dst, hashes[known:upto], gid)
            # one Transfer per stored page, built in C (no NamedTuple __new__, no per-page bytecode)
            fields = zip(repeat(Tier.GPU), map(_block_id, col), repeat(Tier.HOST), map(_block_id, dst),
                         repeat(g.page_bytes), repeat(BlockKind.PAGE), repeat(gid))
            stores.extend(map(_new_transfer, fields))
            tables.append(dst)
        slot_blocks: list[KVCacheBlock] = []
        for gid, col, dst in zip(self.state_gids, states, slot_dsts):
            arena.slots.cache_full_blocks(dst, [hashes[i] for i in positions], gid)
            stores.extend([Transfer(Tier.GPU, src.block_id, Tier.HOST, hb.block_id, g.state_bytes,  # type: ignore[union-attr]
                                    BlockKind.STATE, gid) for src, hb in zip(col, dst)])
            slot_blocks.extend(dst)
        arena.slots.free_blocks(slot_blocks)
        arena.pages.free_blocks([b for t in tables for b in reversed(t)] + pinned)  # type: ignore[operator]
        # a new state above the known prefix (its pages came with a deeper chain) starts the walk there
        self.units.add_chain(hashes, known, positions, retain=retain, now=now, prompt_tokens=prompt_tokens)
        self.settle()
        s = self.stats
        s.stores += 1
        s.stored_pages += num_pages
        s.stored_states += num_slots
        s.bytes_d2h += num_pages * g.page_bytes + num_slots * g.state_bytes
        return [b for col in sources for b in col], [b for col in states for b in col]  # type: ignore[misc]

    def _drop_stale_stores(self, page_dsts: list[list[KVCacheBlock]], slot_dsts: list[list[KVCacheBlock]]) -> None:
        """Pending stores into host memory this store reuses wrote a unit evicted before the plan
        ran: drop them (their bytes too), so that a plan never writes a host byte twice. A page
        and a slot share bytes when the slot's superblock held the page."""
        k = self.geometry.pages_per_superblock
        pages = {b.block_id for d in page_dsts for b in d}
        slots = {b.block_id for d in slot_dsts for b in d}
        page_sbs = {p // k for p in pages}
        kept: list[Transfer] = []
        for t in self.stores:
            if t.kind is BlockKind.PAGE:
                stale = t.dst_block in pages or t.dst_block // k in slots
            else:
                stale = t.dst_block in slots or t.dst_block in page_sbs
            if stale:
                self.stats.bytes_d2h -= t.num_bytes
                self.stats.dropped_stores += 1
            else:
                kept.append(t)
        self.stores = kept

    def take_stores(self) -> list[Transfer]:
        stores, self.stores = self.stores, []
        return stores

    # ------------------------------------------------------------------ loads
    def pin(self, hashes: Sequence[bytes], indices: Sequence[int], state_at: int | None) -> tuple[
            list[tuple[int, int, KVCacheBlock]], list[tuple[int, KVCacheBlock]]]:
        """Pin (ref count +1) the host copies a load reads: each group's page at `indices` (the
        pages missing on the GPU) and every Mamba group's state at `state_at` (None: the state
        is on the GPU). Returns ``([(index, gid, host page)], [(gid, host slot)])``."""
        host_pmaps, host_smaps = self.arena.pages.cached_block_hash_to_block, self.arena.slots.cached_block_hash_to_block
        pages: list[tuple[int, int, KVCacheBlock]] = []
        for i in indices:
            for gid in self.page_gids:
                b = first_copy(host_pmaps.get(gid), hashes[i])
                if b is not None:
                    pages.append((i, gid, b))
        states: list[tuple[int, KVCacheBlock]] = []
        if state_at is not None:
            for gid in self.state_gids:
                b = first_copy(host_smaps.get(gid), hashes[state_at])
                assert b is not None, f"no host state at page {state_at}"
                states.append((gid, b))
        self.arena.pages.touch([b for _, _, b in pages])
        self.arena.slots.touch([b for _, b in states])
        pins = self.pins
        for b in [b for _, _, b in pages] + [b for _, b in states]:
            pins[b] = pins.get(b, 0) + 1
        return pages, states

    def settle(self) -> None:
        """The host arena's ``settle`` (what a fallback pop made unreachable goes), then the pinned
        blocks it left outside the tree (a lost ancestor page takes its subtree's nodes, but a
        load still reads its pinned blocks): their hashes go, so that no cached host block is
        outside the tree and no later store or lookup takes one for a node. The load's data
        stays valid: a pinned block is not reused."""
        self.arena.settle()
        if not self.pins:
            return
        units = self.units
        pages, slots = self.arena.pages, self.arena.slots
        for b in self.pins:
            key = b.block_hash
            if key is None:
                continue
            if b.pool_id == pages.pool_id:
                if not units.has_page(key):
                    PrefixMap.remove(pages.prefix_map, b)
            elif units.unit_at(key) is None:
                PrefixMap.remove(slots.prefix_map, b)

    def unpin(self, pages: Sequence[KVCacheBlock], slots: Sequence[KVCacheBlock]) -> None:
        """Release a load's pins (its blocks stay cached: the host keeps the unit). What the host
        lost meanwhile (the unit evicted, or its chain cut by a page the load did not pin being
        reused) is dropped, as the unit index drops unreachable blocks: pruning from each
        unpinned page also drops its free ancestors an eviction left past the chain's deepest
        checkpoint (exempt from the unit rules only while pinned: ``check_invariants``)."""
        self.arena.slots.free_blocks(list(slots))
        self.arena.pages.free_blocks(list(pages))
        pins = self.pins
        for b in list(pages) + list(slots):
            left = pins.pop(b) - 1
            if left:
                pins[b] = left
        units = self.units
        lost = [b for b in slots if b.block_hash is not None and not b.ref_cnt and units.unit_at(b.block_hash) is None]
        if lost:
            self.arena.slots.drop_cached(lost)
        lost = [b for b in pages if b.block_hash is not None and not b.ref_cnt and not units.has_page(b.block_hash)]
        if lost:
            self.arena.pages.drop_cached(lost)
        for b in pages:  # a page left past its chain's deepest checkpoint goes (and those above it)
            if b.block_hash is not None:
                units.prune_page(b.block_hash)

    def pinned_chains(self) -> set[bytes]:
        """The page-grid hashes of the chains the loads in flight read: each pinned block's page
        and every page above it, up to the root (a pinned block outside the tree has none)."""
        units = self.units
        keys: set[bytes] = set()
        for b in self.pins:
            if b.block_hash is not None and b.block_hash not in keys and units.has_page(b.block_hash):
                keys.update(units.chain_keys(b.block_hash))
        return keys

    def check_invariants(self) -> None:
        """The host arena's and its units' invariants; a pinned block is held at least once per
        load that pins it, and a cached one is in the tree (a page: a node; a state: a unit);
        stores only name blocks of their kind.

        A chain a load reads is in use, as a running request's chain on the GPU: the unit rules
        exempt ``pinned_chains()`` (``UnitIndex.check_invariants(live_keys)``). Evicting a host
        unit whose pages a load pins is right (its state and the pages below the pinned ones
        are free: room for the store that needs it); ``prune`` stops at the pinned page, so its
        free ancestors stay cached, with no checkpoint below them, until the load ends, when
        ``unpin`` prunes from each pinned page and drops them: no such page outlives the load.
        Refusing the eviction instead would keep a state no load reads and skip stores."""
        self.arena.check_invariants()
        self.units.check_invariants(self.pinned_chains() if self.pins else frozenset())
        units = self.units
        for b, n in self.pins.items():
            assert n > 0 and b.ref_cnt >= n, f"host block {b.block_id}: {n} pins, ref {b.ref_cnt}"
            if b.block_hash is not None:
                assert (units.has_page(b.block_hash) if b.pool_id == self.arena.pages.pool_id
                        else units.unit_at(b.block_hash) is not None), \
                    f"pinned host block {b.block_id} cached outside the tree"
        g = self.geometry
        for t in self.stores:
            limit = g.num_pages if t.kind is BlockKind.PAGE else g.num_superblocks
            assert t.src_tier is Tier.GPU and t.dst_tier is Tier.HOST and 0 < t.dst_block < limit
