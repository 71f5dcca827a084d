"""The running prefill chunk through :class:`~mambakv.coordinator.KVCacheCoordinator`, fused.

A long prompt is mostly chunks of one shape: a running request, no hits, no drafts, every
attention table growing by whole blocks and every Mamba policy moving its running slot on
(case GROW). For such a step ``allocate`` and ``retire`` ask each policy two questions instead
of walking the general path (count, commit per column, checkpoint writes, publication,
thresholds, one call each)::

    allocate   chunk_need (every policy; any -1: general path)  ->  pool check  ->  grow_chunk
    retire     chunk_retire_ok (every policy; any False: general)  ->  retire_chunk

The general path and this one leave identical tables, blocks, queue order, plans and
thresholds (``tests/groups/test_chunks.py``). The decoupled layout (eviction units, room in two
pools) always takes the general path.
"""

from __future__ import annotations

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.request import Request
from mambakv.groups import MambaManager, SingleTypeKVCacheManager
from mambakv.groups.tables import NEVER
from mambakv.plans import KVCacheBlocks
from mambakv.request_state import RequestState

__all__ = ["NOT_A_CHUNK", "CoordinatorChunks"]

#: ``_allocate_chunk``'s answer when the step is not a chunk (nothing changed: take the general path)
NOT_A_CHUNK = KVCacheBlocks(())


class CoordinatorChunks:
    """Mixed into KVCacheCoordinator, which sets every attribute declared here."""

    policies: tuple[SingleTypeKVCacheManager, ...]
    managers: tuple[SingleTypeKVCacheManager, ...]
    mamba_managers: tuple[MambaManager, ...]
    block_pool: BlockPool
    hash_block_size: int
    enable_caching: bool
    _attention: tuple[SingleTypeKVCacheManager, ...]
    _columns: tuple[tuple[int, ...], ...]
    _new_results: list[tuple[list[KVCacheBlock], ...]]
    _copies_pending: bool
    _columns_in_order: bool
    _column_of_group: tuple[int, ...]
    _empty_blocks: KVCacheBlocks

    def _allocate_chunk(self, request: Request, live: RequestState, num_tokens: int,
                        num_lookahead_tokens: int) -> KVCacheBlocks | None:
        """``allocate`` of a running request's prefill chunk without hits or drafts (its checks
        passed): the new blocks, None when the pool is short (nothing changed), or
        ``NOT_A_CHUNK`` when a policy needs the general path (nothing changed)."""
        policies, tables = self.policies, live.tables
        need = 0
        for p, t in zip(policies, tables):
            n = p.chunk_need(t, num_tokens, num_lookahead_tokens)
            if n < 0:
                return NOT_A_CHUNK
            need += n
        if need > self.block_pool.free_block_queue.num_free_blocks:
            return None
        if request.hash_block_size != self.hash_block_size:
            request.set_hash_block_size(self.hash_block_size)
        if live.num_scheduled < num_tokens:
            live.num_scheduled = num_tokens
        num_real = min(num_tokens, request.num_tokens)  # no drafts; never a placeholder
        per_column: list[list[KVCacheBlock]] = []
        for p, t in zip(policies, tables):
            per_column += p.grow_chunk(request, t, num_tokens, num_lookahead_tokens, num_real)
        if self.block_pool.enable_kv_cache_events and self.enable_caching:
            for a in self._attention:  # with events, publication waits for every policy's blocks
                a.cache_blocks(request, num_real)
        live.refresh(policies)
        live.set_events(policies)
        if not any(per_column):
            return self._empty_blocks
        if self.mamba_managers:  # a chunk plans no zeros: every Mamba column copies its last state
            self._copies_pending = True
        new = tuple(per_column) if self._columns_in_order else tuple(per_column[i] for i in self._column_of_group)
        self._new_results.append(new)  # ids are read only if a plan is taken
        return KVCacheBlocks(new)

    def _retire_chunk(self, live: RequestState, num_processed_tokens: int) -> bool:
        """``retire`` of a request whose every policy is in a chunk's state (its checks
        passed): publish, retire, recount; False (nothing changed) for the general path."""
        policies, tables, events = self.policies, live.tables, live.events
        for p, t, e in zip(policies, tables, events):  # a policy below its own next event has nothing to do
            if e <= num_processed_tokens and not p.chunk_retire_ok(t, num_processed_tokens):
                return False
        request = live.request
        quiet = NEVER
        moved = False
        i = 0
        for p, t in zip(policies, tables):
            e = events[i]
            if e <= num_processed_tokens:
                e, m = p.retire_chunk(request, t, num_processed_tokens)
                events[i] = e
                moved = moved or m
            if e < quiet:
                quiet = e
            i += 1
        live.retire_quiet = quiet
        if moved:  # a publication or a retirement moved some policy's thresholds: recount
            live.refresh(policies)
        return True
