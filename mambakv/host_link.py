"""HostLink: the host tier's side of :class:`~mambakv.coordinator.KVCacheCoordinator` (:mod:`mambakv.core.host_tier`),
an object the coordinator holds when it has a host tier.

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

from mambakv.core.arena import SuperblockArena
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.engine_request import EngineRequest
from mambakv.core.errors import InvalidFenceError, InvalidSpecError, LoadPendingError
from mambakv.core.eviction import make_eviction_policy
from mambakv.core.host_tier import HostTier, HostTierSpec, HostWrite, first_copy
from mambakv.core.modes import MambaCacheMode
from mambakv.core.spec import KVCacheConfig
from mambakv.core.transfers import EMPTY_TRANSFER_PLAN, BlockKind, LoadPlan, Tier, Transfer, TransferPlan
from mambakv.core.unit_types import Unit
from mambakv.core.units import UnitIndex
from mambakv.groups import GroupKind, SingleTypeKVCacheManager, group_block_hashes
from mambakv.hits import PrefixCacheStats
from mambakv.plans import KVCacheBlocks, TieredHit

__all__ = ["HostLink", "build_host_tier"]


def build_host_tier(spec: HostTierSpec | None, config: KVCacheConfig, managers: tuple[SingleTypeKVCacheManager, ...],
                    gpu_pages: BlockPool, gpu_slots: BlockPool, units: UnitIndex | None,
                    enable_caching: bool, use_eagle: bool) -> HostTier | None:
    """The host tier of `spec` over these groups, or None without a spec.

    Raises:
        InvalidSpecError: not a HostTierSpec; no prefix caching or EAGLE back-off; a group other
            than full attention and align-mode Mamba, or groups of different block sizes; write
            ``evict`` without the decoupled layout's units.
    """
    if spec is None:
        return None
    if not isinstance(spec, HostTierSpec):
        raise InvalidSpecError(f"host_tier must be a HostTierSpec, got {type(spec).__name__}")
    if not enable_caching or use_eagle:
        raise InvalidSpecError("a host tier needs prefix caching and no EAGLE back-off")
    pages = [m.kv_cache_group_id for m in managers if m.kind is GroupKind.FULL_ATTENTION]
    states = [m.kv_cache_group_id for m in managers
              if m.kind is GroupKind.MAMBA and getattr(m, "mode", None) is MambaCacheMode.ALIGN]
    sizes = {m.block_size for m in managers}
    if len(pages) + len(states) != len(managers) or not pages or not states or len(sizes) != 1:
        raise InvalidSpecError("a host tier holds units of full-attention pages and align-mode Mamba states: it "
                               "needs at least one group of each, no group of another kind, one block size")
    if spec.write is HostWrite.EVICT and units is None:
        raise InvalidSpecError("host write 'evict' needs the decoupled layout (its eviction units)")
    policy = make_eviction_policy(spec.eviction or "lru")
    return HostTier(spec.geometry(config.superblocks), gpu_pages=gpu_pages, gpu_slots=gpu_slots, page_gids=pages,
                    state_gids=states, page_tokens=managers[0].block_size, policy=policy,
                    write=spec.write)  # type: ignore[arg-type]


@dataclass
class _Load:
    """One request's load: what it holds on the GPU, what it pins on the host."""

    request: EngineRequest
    hashes: list[bytes]
    num_gpu_tokens: int
    held_pages: list[KVCacheBlock]                # GPU pages of the hit it touched
    held_states: list[KVCacheBlock]               # GPU states of the hit it touched (the hit's own)
    new_pages: list[tuple[int, int, KVCacheBlock]]  # (page index, group id, GPU destination)
    new_states: list[tuple[int, KVCacheBlock]]      # (group id, GPU destination)
    host_blocks: tuple[list[KVCacheBlock], list[KVCacheBlock]]  # pinned host pages, slots
    plan: LoadPlan
    done: bool = False
    #: the fence of the transfer plan that handed it to the engine (0: not drained yet)
    fence: int = 0
    #: its copies ran (``complete_load``, or ``transfers_done`` passed its fence)
    copied: bool = False


class HostLink:
    """The loads in flight or held, and the stores of one coordinator's host tier.

    Args:
        host: the :class:`~mambakv.core.host_tier.HostTier`.
        block_pool / state_block_pool: the GPU tier's page and state pools (one pool unified).
        arena / units: the GPU tier's arena and eviction units (decoupled), else None.
        stats: the coordinator's prefix-cache stats (``host_hits``).

    Attributes:
        loads: request id -> its load (in flight, or complete and held until its first
            ``allocate`` or ``free``).
        fence: the fence of the last non-empty transfer plan drained (0: none yet).
        done_fence: the largest fence ``transfers_done`` reported.

    The fence (:mod:`mambakv.core.transfers`): GPU blocks a drained copy may still read or
    write are held, one ref count each, until ``transfers_done`` passes its plan's fence: the
    sources of write-through stores (held from the store's planning), and the destinations of
    a load aborted (``abort_load``, ``free``, ``preempt_all``) after its plan was drained and
    before ``complete_load``::

        free("q")      store_chain reads q's pages 17, 18 -> held   (pending: no fence yet)
        take plan      fence 4 <- {17, 18}
        abort("r7")    r7's load was in fence 4, not complete: destination 40 -> fence 4
        transfers_done(4)   17, 18 freed (cached, LRU tail); 40 freed (unhashed, head)
    """

    def __init__(self, host: HostTier, *, block_pool: BlockPool, state_block_pool: BlockPool,
                 arena: SuperblockArena | None, units: UnitIndex | None, stats: PrefixCacheStats) -> None:
        self.host = host
        self.block_pool, self.state_block_pool = block_pool, state_block_pool
        self.arena, self.units = arena, units
        self.stats = stats
        self.loads: dict[str, _Load] = {}
        self.fence = self.done_fence = 0
        #: GPU (pages, states) held for the stores planned since the last drain
        self._pending: tuple[list[KVCacheBlock], list[KVCacheBlock]] = ([], [])
        #: fence -> GPU (pages, states) held until ``transfers_done`` passes it
        self._fenced: dict[int, tuple[list[KVCacheBlock], list[KVCacheBlock]]] = {}

    # ------------------------------------------------------------------ lookups and loads
    def tiered_hit(self, request: EngineRequest, blocks: KVCacheBlocks, num_gpu_tokens: int, now: float) -> TieredHit:
        """``KVCacheCoordinator.get_computed_blocks_tiered`` once its checks passed and the GPU
        part (`blocks`, `num_gpu_tokens`) is known: when the host tier holds a deeper hit, start
        its load (GPU room permitting); else change nothing."""
        rid = request.request_id
        if rid in self.loads:  # its load completed and is held: the GPU part is the whole hit
            return TieredHit(blocks, num_gpu_tokens, 0, None)
        host = self.host
        page = host.page_tokens
        hashes = group_block_hashes(request, page)
        num_pages = host.find(hashes, (request.num_tokens - 1) // page)
        if num_pages * page <= num_gpu_tokens:
            return TieredHit(blocks, num_gpu_tokens, 0, None)
        started = self._start_load(request, list(hashes[:num_pages]), num_gpu_tokens, now)
        if started is None:
            return TieredHit(blocks, num_gpu_tokens, 0, None)
        return TieredHit(blocks, num_gpu_tokens, started.num_tokens, started)

    def _start_load(self, request: EngineRequest, hashes: list[bytes], num_gpu_tokens: int, now: float) -> LoadPlan | None:
        """Count, check room, then hold / pin / allocate (see ``get_computed_blocks_tiered``)."""
        host = self.host
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
        host.units.admit(hashes, request.num_prompt_tokens // host.page_tokens, len(hashes), now)
        self.loads[request.request_id] = _Load(
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

    def complete(self, request_id: str) -> None:
        """The engine finished the load's copies: publish its destination blocks under their
        hashes (the next ``get_computed_blocks`` returns the whole hit) and unpin the host
        blocks. The GPU blocks stay held for the request until its first ``allocate`` or ``free``.

        Raises:
            LoadPendingError: no load of `request_id` is in flight; nothing changed.
        """
        load = self.loads.get(request_id)
        if load is None or load.done:
            raise LoadPendingError(f"request {request_id!r} has no host-tier load in flight")
        host = self.host
        for i, gid, b in load.new_pages:
            self.block_pool.cache_full_blocks([b], [load.hashes[i]], gid)
        for gid, b in load.new_states:
            self.state_block_pool.cache_full_blocks([b], [load.hashes[-1]], gid)
        host.unpin(*load.host_blocks)
        load.done = load.copied = True
        # its copies ran: never hand them out again (an engine may complete a load before the
        # plan that carries it is drained)
        host.loads = [p for p in host.loads if p.request_id != request_id]

    def pending(self, request_id: str) -> bool:
        """Whether `request_id`'s host-tier load is in flight (not ready to allocate)."""
        load = self.loads.get(request_id)
        return load is not None and not load.done

    def take_transfer_plan(self) -> TransferPlan:
        """Drain the host tier's transfers since the last drain: stores first, then the loads
        started (order contract in :mod:`mambakv.core.transfers`), under a new fence; the
        GPU blocks held for its stores move to that fence."""
        host = self.host
        if not (host.stores or host.loads):
            if self._pending[0] or self._pending[1]:  # their stores were dropped as stale: nothing reads them
                self._free(self._pending)
                self._pending = ([], [])
            return EMPTY_TRANSFER_PLAN  # the common step: one shared empty plan
        self.fence += 1
        plan = TransferPlan(tuple(host.take_stores()), tuple(host.loads), self.fence)
        host.loads = []
        for p in plan.loads:
            self.loads[p.request_id].fence = self.fence
        if self._pending[0] or self._pending[1]:
            self._fenced[self.fence] = self._pending
            self._pending = ([], [])
        return plan

    def transfers_done(self, fence: int) -> None:
        """The copies of every plan up to `fence` ran: release what their fences hold (store
        sources back to the free queue as cached blocks, aborted loads' destinations unhashed)
        and remember the loads among them as copied. A fence already passed is a no-op.

        Raises:
            InvalidFenceError: `fence` is not an int in ``0 .. fence`` (the last plan's); nothing
                changed.
        """
        if type(fence) is not int or not 0 <= fence <= self.fence:
            raise InvalidFenceError(f"transfers_done({fence!r}): the fences issued are 1 .. {self.fence}")
        if fence <= self.done_fence:
            return
        self.done_fence = fence
        for f in sorted(f for f in self._fenced if f <= fence):
            self._free(self._fenced.pop(f))
        for load in self.loads.values():
            if load.fence and load.fence <= fence:
                load.copied = True
        if self.units is not None:
            self.units.settle()

    def _free(self, held: tuple[list[KVCacheBlock], list[KVCacheBlock]]) -> None:
        """Release the holds of `held` (one ref count per entry: a block two stores read is
        listed twice), then, with eviction units, what the unit index dropped while they were
        held: a released state whose unit went, a released page whose node went (both still
        carry their hash: pruning drops only free copies), and the pages above a released one
        that nothing below needs any more (``prune``), as ``free`` and ``HostTier.unpin`` do."""
        pages, states = held
        for pool, blocks in ((self.state_block_pool, states), (self.block_pool, pages)):
            while blocks:  # free_blocks refuses a block listed twice: one batch per repeat
                batch = list(dict.fromkeys(blocks))
                pool.free_blocks(batch)
                if len(batch) == len(blocks):
                    break
                rest = list(blocks)
                for b in batch:
                    rest.remove(b)
                blocks = rest
        units = self.units
        if units is None:
            return
        lost_states = [b for b in dict.fromkeys(held[1]) if b.block_hash is not None and not b.ref_cnt
                       and units.unit_at(b.block_hash) is None]
        if lost_states:
            self.state_block_pool.drop_cached(lost_states)  # type: ignore[attr-defined]  # an ArenaPool
        lost_pages = [b for b in dict.fromkeys(held[0]) if b.block_hash is not None and not b.ref_cnt
                      and not units.has_page(b.block_hash)]
        if lost_pages:
            self.block_pool.drop_cached(lost_pages)  # type: ignore[attr-defined]
        for b in held[0]:
            if b.block_hash is not None:
                units.prune_page(b.block_hash)

    # ------------------------------------------------------------------ hooks of the coordinator's calls
    def release(self, request_id: str, now: float, *, admitted_tokens: int | None = None) -> None:
        """End a load's hold (at the first allocate: `admitted_tokens` are the hit tokens it
        was admitted with), or abort one in flight."""
        load = self.loads.pop(request_id)
        host = self.host
        if not load.done:
            host.unpin(*load.host_blocks)
            host.stats.aborted_loads += 1
            host.loads = [p for p in host.loads if p.request_id != request_id]
        elif admitted_tokens is not None and load.request.num_admissions == 1:  # counted as a first admission
            self.stats.host_hits += max(0, min(admitted_tokens, load.num_gpu_tokens + load.plan.num_tokens)
                                                     - load.num_gpu_tokens)
        dst_pages, dst_states = [b for _, _, b in load.new_pages], [b for _, b in load.new_states]
        if load.fence and not load.copied:  # drained, not done: its copies may still write them (the fence)
            pages, states = self._fenced.setdefault(load.fence, ([], []))
            pages += dst_pages
            states += dst_states
            dst_pages, dst_states = [], []
        self.state_block_pool.free_blocks(load.held_states + dst_states)
        self.block_pool.free_blocks(load.held_pages + dst_pages)
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
            self.units.register(load.hashes, tables, retain=request.retain, arrival=now,
                                prompt_tokens=request.num_prompt_tokens, parent=None, now=now)
        if self.units is not None:
            self.units.settle()

    def check_ready(self, request_id: str) -> None:
        """Raise LoadPendingError (nothing changed) while `request_id`'s load is in flight."""
        load = self.loads.get(request_id)
        if load is not None and not load.done:
            raise LoadPendingError(f"request {request_id!r}: its host-tier load is in flight; allocate after "
                                   f"complete_load")

    def store_freed(self, request: EngineRequest, now: float) -> None:
        """Write-through: store the checkpoints on a freed request's GPU chain the host lacks."""
        host = self.host
        hashes = group_block_hashes(request, host.page_tokens)
        units = self.units
        if units is None:  # unified: walk the GPU maps
            _, positions = host.gpu_checkpoints(hashes)
        else:
            positions = units.checkpoints(hashes)
        if positions:
            read = host.store_chain(hashes, positions, now=now, retain=request.retain,
                                    prompt_tokens=request.num_prompt_tokens)
            if read is not None and (read[0] or read[1]):  # the stores read them: held until their fence
                self.block_pool.touch(read[0])
                self.state_block_pool.touch(read[1])
                self._pending[0].extend(read[0])
                self._pending[1].extend(read[1])

    def store_evicted(self, unit: Unit, now: float) -> None:
        """Write-on-evict: the GPU tier is about to evict `unit`; store it with its pages."""
        host, units = self.host, self.units
        assert units is not None
        if not units.state_present(unit.key):
            return  # its state is lost already: nothing whole to store
        keys = units.chain_keys(unit.key)
        host.store_chain(keys, [len(keys) - 1], now=now, retain=unit.retain)

    def holders(self) -> list[KVCacheBlock]:
        """Every GPU block the loads and the fences hold, once per hold (for the coordinator's
        ref-count check)."""
        out = [b for load in self.loads.values()
               for b in load.held_pages + load.held_states + [b for _, _, b in load.new_pages]
               + [b for _, b in load.new_states]]
        for pages, states in [self._pending, *self._fenced.values()]:
            out += pages + states
        return out

    @property
    def num_fenced_blocks(self) -> int:
        """GPU blocks held for copies not reported done (``transfers_done``)."""
        return sum(len(p) + len(s) for p, s in [self._pending, *self._fenced.values()])
