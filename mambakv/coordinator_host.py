"""The host tier's side of :class:`~mambakv.coordinator.KVCacheCoordinator` (:mod:`mambakv.core.host_tier`).

An engine that knows nothing of tiers never sees it: ``get_computed_blocks`` returns GPU hits
only. One that does, per new request::

    hit = coord.get_computed_blocks_tiered(request)     # may start a load (hit.load)
    each step: plan = coord.take_transfer_plan(); run plan.stores, then plan.loads (a side
                  stream); coord.complete_load(request_id) once a load's copies are done
                  (abort_load on failure). Never run hit.load before the plan's stores: with
                  write 'evict' the load's own room-making stores units that its destinations held
    blocks, n = coord.get_computed_blocks(request)      # after the load: the whole hit
    coord.allocate(request, k, num_new_computed_tokens=n, new_computed_blocks=blocks, num_draft_tokens=0)

A load holds its GPU blocks (the GPU pages of the hit and the destination blocks) and pins the
host blocks it reads until ``complete_load`` / ``abort_load``; the destinations are published
under their hashes only when complete. The hold ends at the request's first ``allocate`` (which
has touched its hits by then) or at ``free``; in the decoupled layout the loaded chain then joins
the GPU tier's units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mambakv.core.arena import SuperblockArena
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidRequestError, LoadPendingError, as_seconds
from mambakv.core.host_tier import HostTier, first_copy
from mambakv.core.request import Request
from mambakv.core.transfers import EMPTY_TRANSFER_PLAN, BlockKind, LoadPlan, Tier, Transfer, TransferPlan
from mambakv.core.unit_types import Unit
from mambakv.core.units import UnitIndex
from mambakv.groups.tables import group_block_hashes
from mambakv.hits import PrefixCacheStats
from mambakv.plans import KVCacheBlocks, TieredHit

__all__ = ["CoordinatorHost"]


@dataclass
class _Load:
    """One request's load: what it holds on the GPU, what it pins on the host."""

    request: Request
    hashes: list[bytes]
    num_gpu_tokens: int
    held_pages: list[KVCacheBlock]                # GPU pages of the hit it touched
    held_states: list[KVCacheBlock]               # GPU states of the hit it touched (the hit's own)
    new_pages: list[tuple[int, int, KVCacheBlock]]  # (page index, group id, GPU destination)
    new_states: list[tuple[int, KVCacheBlock]]      # (group id, GPU destination)
    host_blocks: tuple[list[KVCacheBlock], list[KVCacheBlock]]  # pinned host pages, slots
    plan: LoadPlan
    done: bool = False


class CoordinatorHost:
    """Mixed into KVCacheCoordinator, which sets every attribute declared here."""

    host: HostTier | None
    units: UnitIndex | None
    arena: SuperblockArena | None
    block_pool: BlockPool
    state_block_pool: BlockPool
    now: float
    prefix_cache_stats: PrefixCacheStats
    _loads: dict[str, _Load]

    if TYPE_CHECKING:  # CoordinatorQueries'
        def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]: ...
        def holds_blocks(self, request_id: str) -> bool: ...

    # ------------------------------------------------------------------ lookups and loads
    def get_computed_blocks_tiered(self, request: Request, *, now: float | None = None) -> TieredHit:
        """The longest prefix hit over the GPU and the host tier; starts the load of its host part.

        The GPU part is ``get_computed_blocks(request)``. When the host tier holds a deeper hit
        (whole units: every page up to it in one tier or the other, a state in every Mamba group
        at it), this call allocates GPU blocks for the pages missing on the GPU and the state,
        holds them and the GPU pages of the hit, pins the host copies, and returns the
        :class:`~mambakv.core.transfers.LoadPlan` (also in the next ``take_transfer_plan()``).
        Without a host tier, a deeper host hit, or GPU room for it, it changes nothing and
        returns the GPU part only (``num_host_tokens == 0``).

        Raises (nothing changed):
            InvalidRequestError: `request` is not a Request, or it holds blocks already.
            LoadPendingError: its load is in flight (wait for ``complete_load``).
            InvalidClockError: `now` is not a finite number.
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"get_computed_blocks_tiered needs a Request, got {type(request).__name__}")
        rid = request.request_id
        load = self._loads.get(rid)
        if load is not None and not load.done:
            raise LoadPendingError(f"request {rid!r}: its host-tier load is in flight")
        if self.holds_blocks(rid):
            raise InvalidRequestError(f"request {rid!r} holds blocks: look up hits before its first allocate")
        if now is not None:
            self.now = as_seconds(now)
        blocks, n = self.get_computed_blocks(request)
        host = self.host
        if host is None or load is not None:
            return TieredHit(blocks, n, 0, None)
        page = host.page_tokens
        hashes = group_block_hashes(request, page)
        num_pages = host.find(hashes, (request.num_tokens - 1) // page)
        if num_pages * page <= n:
            return TieredHit(blocks, n, 0, None)
        started = self._start_load(request, list(hashes[:num_pages]), n)
        if started is None:
            return TieredHit(blocks, n, 0, None)
        return TieredHit(blocks, n, started.num_tokens, started)

    def _start_load(self, request: Request, hashes: list[bytes], num_gpu_tokens: int) -> LoadPlan | None:
        """Count, check room, then hold / pin / allocate (see ``get_computed_blocks_tiered``)."""
        host = self.host
        assert host is not None
        gpu_pmaps, gpu_smaps = self.block_pool.cached_block_hash_to_block, self.state_block_pool.cached_block_hash_to_block
        last = len(hashes) - 1
        held: list[KVCacheBlock] = []
        missing: list[tuple[int, int]] = []  # (page index, gid)
        for i, key in enumerate(hashes):
            for gid in host.page_gids:
                b = first_copy(gpu_pmaps.get(gid), key)
                if b is None:
                    missing.append((i, gid))
                else:
                    held.append(b)
        host_pmaps = host.arena.pages.cached_block_hash_to_block
        if any(first_copy(host_pmaps.get(gid), hashes[i]) is None for i, gid in missing):
            return None  # a page in neither tier (``find`` assumed prefix-closed tiers): no load
        state_on_gpu = host.gpu_state(hashes[last])
        if not state_on_gpu and not host.host_state(hashes[last]):
            return None
        held_states: list[KVCacheBlock] = []
        for gid in host.state_gids if state_on_gpu else ():
            b = first_copy(gpu_smaps.get(gid), hashes[last])
            assert b is not None  # gpu_state: a copy in every Mamba group
            held_states.append(b)
        num_slots = 0 if state_on_gpu else len(host.state_gids)
        if not self._gpu_room(len(missing), num_slots, held, held_states):
            return None
        # pin the host copies first: a GPU eviction below may store units to the host (write
        # 'evict'), which must not evict what this load reads
        host_pages, host_slots = host.pin(hashes, sorted({i for i, _ in missing}), None if state_on_gpu else last)
        self.block_pool.touch(held)
        if held_states:
            self.state_block_pool.touch(held_states)
        if self.arena is not None:
            self.arena.make_room(len(missing), num_slots)
        new_pages = self.block_pool.get_new_blocks(len(missing))
        new_slots = self.state_block_pool.get_new_blocks(num_slots)
        if self.units is not None:
            self.units.settle()
        g = host.geometry
        transfers: list[Transfer] = []
        page_dst: list[tuple[int, int, KVCacheBlock]] = []
        by_key = {(i, gid): hb for i, gid, hb in host_pages}
        for (i, gid), dst in zip(missing, new_pages):
            page_dst.append((i, gid, dst))
            transfers.append(Transfer(Tier.HOST, by_key[(i, gid)].block_id, Tier.GPU, dst.block_id, g.page_bytes,
                                      BlockKind.PAGE, gid))
        state_dst = [(gid, dst) for (gid, _), dst in zip(host_slots, new_slots)]
        for (gid, hb), dst in zip(host_slots, new_slots):
            transfers.append(Transfer(Tier.HOST, hb.block_id, Tier.GPU, dst.block_id, g.state_bytes, BlockKind.STATE, gid))
        num_tokens = len(hashes) * host.page_tokens - num_gpu_tokens
        plan = LoadPlan(request.request_id, tuple(transfers), sum(t.num_bytes for t in transfers), num_tokens)
        host.units.admit(hashes, request.num_prompt_tokens // host.page_tokens, len(hashes), self.now)
        self._loads[request.request_id] = _Load(
            request, hashes, num_gpu_tokens, held, held_states, page_dst, state_dst,
            ([hb for _, _, hb in host_pages], [hb for _, hb in host_slots]), plan)
        host.loads.append(plan)
        s = host.stats
        s.loads += 1
        s.bytes_h2d += plan.num_bytes
        s.loaded_tokens += num_tokens
        return plan

    def _gpu_room(self, num_pages: int, num_slots: int, held: list[KVCacheBlock], held_states: list[KVCacheBlock]) -> bool:
        """Whether the GPU can supply the load's blocks with its hit blocks set apart."""
        arena = self.arena
        if arena is None:  # one pool: free blocks not in the hit
            free_hits = sum(1 for b in held + held_states if not b.ref_cnt)
            return num_pages + num_slots <= self.block_pool.get_num_free_blocks() - free_hits
        free_pages = sum(1 for b in held if not b.ref_cnt)
        free_slots = sum(1 for b in held_states if not b.ref_cnt)
        return bool(arena.can_supply(num_pages + free_pages, num_slots + free_slots, held + held_states))

    def complete_load(self, request_id: str) -> None:
        """The engine finished the load's copies: publish its destination blocks under their
        hashes (the next ``get_computed_blocks`` returns the whole hit) and unpin the host
        blocks. The GPU blocks stay held for the request until its first ``allocate`` or ``free``.

        Raises:
            LoadPendingError: no load of `request_id` is in flight; nothing changed.
        """
        load = self._loads.get(request_id)
        if load is None or load.done:
            raise LoadPendingError(f"request {request_id!r} has no host-tier load in flight")
        host = self.host
        assert host is not None
        for i, gid, b in load.new_pages:
            self.block_pool.cache_full_blocks([b], [load.hashes[i]], gid)
        for gid, b in load.new_states:
            self.state_block_pool.cache_full_blocks([b], [load.hashes[-1]], gid)
        host.unpin(*load.host_blocks)
        load.done = True
        # its copies ran: never hand them out again (an engine may complete a load before the
        # plan that carries it is drained)
        host.loads = [p for p in host.loads if p.request_id != request_id]

    def abort_load(self, request_id: str) -> None:
        """The load failed or the request was dropped: its GPU blocks are released (destinations
        unpublished, so they hold nothing), its host blocks unpinned; a completed load's hold is
        released. Both tiers stay as they were, less what other calls changed meanwhile.

        Raises:
            LoadPendingError: `request_id` has no load (in flight or held); nothing changed.
        """
        if request_id not in self._loads:
            raise LoadPendingError(f"request {request_id!r} has no host-tier load")
        self._release_load(request_id)

    def load_pending(self, request_id: str) -> bool:
        """Whether `request_id`'s host-tier load is in flight (not ready to allocate)."""
        load = self._loads.get(request_id)
        return load is not None and not load.done

    def take_transfer_plan(self) -> TransferPlan:
        """Drain the host tier's transfers since the last drain: stores first, then the loads
        started (order contract in :mod:`mambakv.core.transfers`)."""
        host = self.host
        if host is None or not (host.stores or host.loads):
            return EMPTY_TRANSFER_PLAN  # the common step: one shared empty plan
        plan = TransferPlan(tuple(host.take_stores()), tuple(host.loads))
        host.loads = []
        return plan

    # ------------------------------------------------------------------ hooks of the coordinator's calls
    def _release_load(self, request_id: str, *, admitted_tokens: int | None = None) -> None:
        """End a load's hold (at the first allocate: `admitted_tokens` are the hit tokens it
        was admitted with), or abort one in flight."""
        load = self._loads.pop(request_id)
        host = self.host
        assert host is not None
        if not load.done:
            host.unpin(*load.host_blocks)
            host.stats.aborted_loads += 1
            host.loads = [p for p in host.loads if p.request_id != request_id]
        elif admitted_tokens is not None and load.request.num_admissions == 1:  # counted as a first admission
            self.prefix_cache_stats.host_hits += max(0, min(admitted_tokens, load.num_gpu_tokens + load.plan.num_tokens)
                                                     - load.num_gpu_tokens)
        self.state_block_pool.free_blocks(load.held_states + [b for _, b in load.new_states])
        self.block_pool.free_blocks(load.held_pages + [b for _, _, b in load.new_pages])
        loaded = [b for _, _, b in load.new_pages] + [b for _, b in load.new_states]
        if self.units is not None and any(not b.ref_cnt for b in load.held_pages + load.held_states + loaded):
            # a block no table holds now (aborted; or the engine admitted a shorter hit, or none):
            # the chain joins the GPU units, from the load's own blocks (a page may have lost its
            # hash since, a destination was never published; a held page may have lost the state
            # below it to this load's own room-making). Blocks still in the request's tables
            # register at its free.
            new = {(i, gid): b for i, gid, b in load.new_pages}
            held = iter(load.held_pages)
            blocks = {(i, gid): new[(i, gid)] if (i, gid) in new else next(held)
                      for i in range(len(load.hashes)) for gid in host.page_gids}
            tables = [[blocks[(i, gid)] for i in range(len(load.hashes))] for gid in host.page_gids]
            request = load.request
            self.units.register(load.hashes, tables, retain=request.retain, arrival=self.now,
                                prompt_tokens=request.num_prompt_tokens, parent=None, now=self.now)
        if self.units is not None:
            self.units.settle()

    def _check_load_ready(self, request_id: str) -> None:
        load = self._loads.get(request_id)
        if load is not None and not load.done:
            raise LoadPendingError(f"request {request_id!r}: its host-tier load is in flight; allocate after "
                                   f"complete_load")

    def _store_freed(self, request: Request) -> None:
        """Write-through: store the checkpoints on a freed request's GPU chain the host lacks."""
        host = self.host
        assert host is not None
        hashes = group_block_hashes(request, host.page_tokens)
        units = self.units
        if units is None:  # unified: walk the GPU maps
            _, positions = host.gpu_checkpoints(hashes)
        else:
            positions = units.checkpoints(hashes)
        if positions:
            host.store_chain(hashes, positions, now=self.now, retain=request.retain,
                             prompt_tokens=request.num_prompt_tokens)

    def _store_evicted(self, unit: Unit) -> None:
        """Write-on-evict: the GPU tier is about to evict `unit`; store it with its pages."""
        host, units = self.host, self.units
        assert host is not None and units is not None
        if not units.state_present(unit.key):
            return  # its state is lost already: nothing whole to store
        keys: list[bytes] = []
        node = unit.node
        while node is not None:
            keys.append(node.key)
            node = node.parent
        keys.reverse()
        host.store_chain(keys, [len(keys) - 1], now=self.now, retain=unit.retain)

    def _load_holders(self) -> list[KVCacheBlock]:
        """Every GPU block the loads hold (for the coordinator's ref-count check)."""
        return [b for load in self._loads.values()
                for b in load.held_pages + load.held_states + [b for _, _, b in load.new_pages]
                + [b for _, b in load.new_states]]
