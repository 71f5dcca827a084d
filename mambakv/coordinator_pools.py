"""The pool side of :class:`~mambakv.coordinator.KVCacheCoordinator`: which pool a group takes
blocks from, counting a step per pool, room checks, usage, events and resets, in either layout::

    layout      block_pool            state_block_pool      arena
    unified     the one BlockPool     block_pool itself     None
    decoupled   arena.pages (pages)   arena.slots (states)  SuperblockArena (one byte budget)
"""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.arena import SuperblockArena
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidRequestError, InvalidSpecError, InvalidTokenCountError, as_count
from mambakv.core.events import KVCacheEvent
from mambakv.core.eviction import EvictionPolicy, make_eviction_policy
from mambakv.core.host_tier import HostTier, HostTierSpec, HostWrite
from mambakv.core.modes import MambaCacheMode
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheConfig, KVCacheSpec, MambaSpec
from mambakv.core.units import UnitIndex
from mambakv.groups import GroupKind, SingleTypeKVCacheManager
from mambakv.groups.tables import group_block_hashes
from mambakv.plans import KVCacheBlocks
from mambakv.request_state import RequestState

__all__ = ["CoordinatorPools", "build_host_tier", "build_pools", "build_units", "unit_table_managers"]


def build_pools(config: KVCacheConfig, enable_caching: bool,
                enable_kv_cache_events: bool) -> tuple[SuperblockArena | None, BlockPool, BlockPool]:
    """``(arena, block_pool, state_block_pool)`` of `config` (see the module docstring's table)."""
    if config.superblocks is None:
        pool = BlockPool(config.num_blocks, enable_caching, enable_kv_cache_events)
        return None, pool, pool
    arena = SuperblockArena(config.superblocks, enable_caching=enable_caching,
                            enable_kv_cache_events=enable_kv_cache_events)
    return arena, arena.pages, arena.slots


def build_units(arena: SuperblockArena | None, managers: Sequence[SingleTypeKVCacheManager],
                eviction: str | EvictionPolicy | None, enable_caching: bool) -> UnitIndex | None:
    """The decoupled arena's unit index under `eviction` (None: ``reuse``), or None: the unified
    layout, no prefix caching, or no full-attention and align-mode Mamba group to make units of
    (then the arena evicts blocks in LRU order).

    Raises:
        InvalidSpecError: an unknown policy, or ``reuse`` / a policy object with the unified layout.
    """
    if arena is None:
        if eviction is not None and eviction != "lru":
            raise InvalidSpecError(f"eviction {eviction!r} needs the decoupled layout (the unified one is vLLM's LRU)")
        return None
    policy = make_eviction_policy("reuse" if eviction is None else eviction)
    pages = [m.kv_cache_group_id for m in managers if m.kind is GroupKind.FULL_ATTENTION]
    states = [m.kv_cache_group_id for m in managers
              if m.kind is GroupKind.MAMBA and getattr(m, "mode", None) is MambaCacheMode.ALIGN]
    if not enable_caching or not pages or not states:
        return None
    return arena.enable_units(pages, states, policy, page_tokens=managers[0].block_size)


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
    states = [m.kv_cache_group_id for m in managers if m.kind is GroupKind.MAMBA
              and getattr(m, "mode", None) is not None and m.mode.value == "align"]  # type: ignore[attr-defined]
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


def unit_table_managers(units: UnitIndex | None,
                        managers: Sequence[SingleTypeKVCacheManager]) -> tuple[SingleTypeKVCacheManager, ...]:
    """The managers whose tables make a unit's chain (the full-attention groups); () without units."""
    return tuple(m for m in managers if units is not None and m.kv_cache_group_id in units.page_gids)


class CoordinatorPools:
    """Mixed into KVCacheCoordinator, which sets every attribute declared here."""

    block_pool: BlockPool
    state_block_pool: BlockPool
    arena: SuperblockArena | None
    units: UnitIndex | None
    host: HostTier | None
    now: float
    policies: tuple[SingleTypeKVCacheManager, ...]
    max_model_len: int
    _columns: tuple[tuple[int, ...], ...]
    _no_hits: tuple[tuple[()], ...]

    def num_blocks_needed(self, request: Request, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                          new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0) -> int:
        raise NotImplementedError  # CoordinatorQueries.num_blocks_needed

    def pool_of(self, spec: KVCacheSpec) -> BlockPool:
        """The pool a group of `spec` takes blocks from: ``state_block_pool`` for Mamba specs."""
        return self.state_block_pool if isinstance(spec, MambaSpec) else self.block_pool

    def _count_pools(self, rid: str, num_tokens: int, policies: Sequence[SingleTypeKVCacheManager],
                     policy_hits: Sequence[Sequence[Sequence[KVCacheBlock]]], num_computed: int,
                     num_lookahead_tokens: int) -> tuple[int, int]:
        """(pages, slots) the step takes from `policies`, free hit blocks included (the decoupled count)."""
        pages = slots = 0
        state_pool = self.state_block_pool
        for p, ph in zip(policies, policy_hits):
            n = p.count_columns(rid, num_tokens, ph, num_computed, num_lookahead_tokens)
            if p.block_pool is state_pool:
                slots += n
            else:
                pages += n
        return pages, slots

    def _room_needed(self, rid: str, num_tokens: int, policies: Sequence[SingleTypeKVCacheManager],
                     policy_hits: Sequence[Sequence[Sequence[KVCacheBlock]]],
                     hits: Sequence[Sequence[KVCacheBlock]], num_computed: int,
                     num_lookahead_tokens: int) -> tuple[int, int] | None:
        """Decoupled: ``(pages, slots)`` the step takes, or None when the arena cannot supply
        them (free hit blocks, which the step touches, counted)."""
        pages, slots = self._count_pools(rid, num_tokens, policies, policy_hits, num_computed, num_lookahead_tokens)
        assert self.arena is not None
        if not self.arena.can_supply(pages, slots, None if hits is self._no_hits else [b for h in hits for b in h]):
            return None
        return pages, slots

    def _admit_to_units(self, live: RequestState, num_computed: int) -> None:
        """A request's first allocation (decoupled, with units): its arrival, the leaf units its
        hit reuses, the ghosts on its chain, and its conversation parent (``UnitIndex.admit``)."""
        units, request = self.units, live.request
        assert units is not None
        page = units.page_tokens
        live.arrival = self.now
        live.parent = units.admit(group_block_hashes(request, page), request.num_prompt_tokens // page,
                                  num_computed // page, self.now)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changed) while any block is in use. To reset
        with requests running, call ``preempt_all()`` first."""
        pools = self.pools
        host = self.host
        if host is not None:  # the host tier's hashes go too (pinned host blocks: a load in flight)
            pools = pools + (host.arena.pages, host.arena.slots)
        if any(p.get_num_free_blocks() != p.num_blocks - 1 - p.num_reserved_blocks for p in pools):
            return False  # all or nothing: check every pool before dropping any hash
        ok = all([bool(p.reset_prefix_cache()) for p in pools])
        if self.arena is not None and self.arena.units is not None:
            self.arena.units.clear()
        if host is not None:
            host.units.clear()
            host.stores.clear()
            host.loads.clear()
        return ok

    @property
    def pools(self) -> tuple[BlockPool, ...]:
        """Every pool: ``(block_pool,)`` unified; ``(block_pool, state_block_pool)`` (pages,
        state slots) decoupled."""
        if self.state_block_pool is self.block_pool:
            return (self.block_pool,)
        return (self.block_pool, self.state_block_pool)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV events of every pool: ``block_pool.take_events()``, then (decoupled)
        ``state_block_pool.take_events()`` (each pool's events in order; empty unless events
        are enabled)."""
        if self.state_block_pool is self.block_pool:
            return self.block_pool.take_events()
        return self.block_pool.take_events() + self.state_block_pool.take_events()

    @property
    def usage(self) -> float:
        """Fraction of the cache memory in tables: ``block_pool.usage`` unified; decoupled, the
        arena's bytes in held pages and slots over its budget (``arena.usage``)."""
        return self.block_pool.usage if self.arena is None else self.arena.usage

    def can_allocate(self, request: Request, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                     new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0) -> bool:
        """Whether ``allocate`` with these arguments would find room now (its own count; free hit
        blocks included), in either layout. Read-only; pins and checks nothing.

        Raises:
            InvalidTokenCountError: a negative or non-int count, or more than ``max_model_len``
                tokens (``allocate`` raises it too).
            InvalidRequestError: `request` is not a Request.
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"can_allocate needs a Request, got {type(request).__name__}")
        total = request.num_computed_tokens + as_count(num_new_computed_tokens, "num_new_computed_tokens") \
            + as_count(num_new_tokens, "num_new_tokens")
        if total > self.max_model_len:
            raise InvalidTokenCountError(f"request {request.request_id!r} would reach {total} tokens > max_model_len "
                                         f"{self.max_model_len}")
        if self.arena is None:
            need = self.num_blocks_needed(request, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
                                          new_computed_blocks=new_computed_blocks,
                                          num_lookahead_tokens=num_lookahead_tokens)
            return need <= self.block_pool.get_num_free_blocks()
        num_new_tokens = as_count(num_new_tokens, "num_new_tokens")
        num_computed = request.num_computed_tokens + as_count(num_new_computed_tokens, "num_new_computed_tokens")
        num_tokens = num_computed + num_new_tokens
        lookahead = max(0, min(as_count(num_lookahead_tokens, "num_lookahead_tokens"), self.max_model_len - num_tokens))
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hits
        policy_hits = [[hits[g] for g in cols] for cols in self._columns]
        pages, slots = self._count_pools(request.request_id, num_tokens, self.policies, policy_hits, num_computed,
                                         lookahead)
        return self.arena.can_supply(pages, slots, (b for h in hits for b in h))
