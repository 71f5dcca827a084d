"""The two allocation paths behind :meth:`KVCacheCoordinator.allocate
<mambakv.coordinator.KVCacheCoordinator.allocate>` once its checks passed: the general step
(``_allocate_slow``: hits, drafts, decode, new requests, the decoupled layout) and the running
prefill chunk, fused (``_allocate_chunk``), with the chunk's retire (``_retire_chunk``).

The fused chunk
---------------

A long prompt is mostly chunks of one shape: a running request, no hits, no drafts, every
attention table growing by whole blocks and every Mamba policy moving its running slot on
(case GROW). For such a step ``allocate`` and ``retire`` ask each policy two questions instead
of walking the general path (count, commit per column, checkpoint writes, publication,
thresholds, one call each)::

    allocate   chunk_need (every policy; any -1: general path)  ->  pool check  ->  grow_chunk
               (each returns its table's counts; blocks left to publish: cache_blocks, recount)
    retire     chunk_retire_ok (each policy whose next event came; any False: general)
               ->  retire_chunk (those policies; the others have nothing to do)

The general path and this one leave identical tables, blocks, queue order, plans and
thresholds (``tests/test_chunk_path.py``). The decoupled layout (eviction units, room in two
pools) always takes the general path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mambakv.core.arena import SuperblockArena
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.request import Request
from mambakv.core.units import UnitIndex
from mambakv.groups import MambaManager, SingleTypeKVCacheManager
from mambakv.hits import PrefixHitFinder
from mambakv.plans import KVCacheBlocks
from mambakv.request_state import RequestState

__all__ = ["NOT_A_CHUNK", "CoordinatorSteps"]

#: ``_allocate_chunk``'s answer when the step is not a chunk (nothing changed: take the general path)
NOT_A_CHUNK = KVCacheBlocks(())


class CoordinatorSteps:
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
    state_block_pool: BlockPool
    arena: SuperblockArena | None
    units: UnitIndex | None
    now: float
    _live: dict[str, RequestState]
    _loads: dict[str, Any]
    _hits: PrefixHitFinder
    _no_hits: tuple[tuple[()], ...]
    _policy_no_hits: tuple[tuple[tuple[()], ...], ...]
    _max_drafts: int
    _mamba_policies: tuple[MambaManager, ...]

    if TYPE_CHECKING:  # the other mixins'
        def _room_needed(self, rid: str, num_tokens: int, policies: Sequence[SingleTypeKVCacheManager],
                         policy_hits: Sequence[Sequence[Sequence[KVCacheBlock]]],
                         hits: Sequence[Sequence[KVCacheBlock]], num_computed: int,
                         num_lookahead_tokens: int) -> tuple[int, int] | None: ...
        def _admit_to_units(self, live: RequestState, num_computed: int) -> None: ...
        def _release_load(self, request_id: str, *, admitted_tokens: int | None = None) -> None: ...
        def _count_admission(self, request: Request, num_hit_tokens: int) -> None: ...

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
        # (a live request's hash block size was set by its first allocate)
        if live.num_scheduled < num_tokens:
            live.num_scheduled = num_tokens
        num_real = request.num_tokens  # no drafts; never a placeholder
        if num_tokens < num_real:
            num_real = num_tokens
        per_column: list[list[KVCacheBlock]] = []
        counts = []
        late = False
        for p, t in zip(policies, tables):
            c = p.grow_chunk(request, t, num_tokens, num_lookahead_tokens, num_real, per_column)
            if c is None:
                late = True
            counts.append(c)
        if late:  # blocks left to publish, once every policy's blocks are taken
            if self.enable_caching:
                for a in self._attention:
                    a.cache_blocks(request, num_real)
            live.recount(policies)
        else:
            live.set_counts(counts)  # type: ignore[arg-type]
        if not any(per_column):
            return self._empty_blocks
        if self.mamba_managers:  # a chunk plans no zeros: every Mamba column copies its last state
            self._copies_pending = True
        new = tuple(per_column) if self._columns_in_order else tuple(per_column[i] for i in self._column_of_group)
        self._new_results.append(new)  # ids are read only if a plan is taken
        return KVCacheBlocks(new)

    def _retire_chunk(self, live: RequestState, num_processed_tokens: int) -> bool:
        """``retire`` of a request whose every policy is in a chunk's state (its checks
        passed): publish, retire, and recount when a policy's thresholds moved; False (nothing
        changed) for the general path."""
        policies, tables, events = self.policies, live.tables, live.events
        for p, t, e in zip(policies, tables, events):  # a policy below its own next event has nothing to do
            if e <= num_processed_tokens and not p.chunk_retire_ok(t, num_processed_tokens):
                return False
        request = live.request
        moved = False
        for i, e in enumerate(events):
            if e <= num_processed_tokens:
                events[i], m = policies[i].retire_chunk(request, tables[i], num_processed_tokens)
                if m:
                    moved = True
        if moved:  # a publication or a retirement moved some policy's thresholds: recount
            live.recount(policies)
        else:
            live.retire_quiet = min(events)
        return True

    def _allocate_slow(self, request: Request, live: RequestState | None, num_new_computed_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None, num_computed: int, num_tokens: int,
                       num_lookahead_tokens: int, num_drafts: int, now: float | None) -> KVCacheBlocks | None:
        """Checks, count, commit, publish, plan (see ``allocate``; its own checks passed)."""
        rid = request.request_id
        if request.hash_block_size != self.hash_block_size:
            request.set_hash_block_size(self.hash_block_size)
        if new_computed_blocks is None:
            hits: Sequence[Sequence[KVCacheBlock]] = self._no_hits
        else:
            hits = self._hits.checked_hits(request, new_computed_blocks, num_new_computed_tokens)
            if num_drafts > self._max_drafts:
                for m in self.mamba_managers:  # the group whose rule it breaks raises
                    m.check_step(num_tokens, num_drafts)
        if live is not None:  # a group refuses to rewrite a published running state before any group commits
            decode = num_computed >= request.num_prompt_tokens
            for mp in self._mamba_policies:
                mp.check_writable_step(rid, num_tokens, decode)
        if now is not None:  # every check passed: the clock moves (even when the pool is short)
            self.now = now
        if self.units is not None:
            self.units.now = self.now
        policies, columns = self.policies, self._columns
        if hits is self._no_hits:
            policy_hits: Sequence[Sequence[Sequence[KVCacheBlock]]] = self._policy_no_hits
        else:
            policy_hits = [[hits[g] for g in cols] for cols in columns]
        room: tuple[int, int] | None = None  # decoupled: (pages, slots) the step pops
        # A running step without hits or drafts skips the policies it leaves quiet (a decode
        # step that crosses an attention page is no event for a Mamba group in decode).
        active = live.active_policies(num_tokens, num_lookahead_tokens) if (
            live is not None and hits is self._no_hits and not num_drafts) else None
        if active is not None:
            policies = tuple(p for p, a in zip(policies, active) if a)
            columns = tuple(c for c, a in zip(columns, active) if a)
            # each active policy's own empty hit lists (one per column: a shared Mamba policy has several)
            policy_hits = tuple(h for h, a in zip(self._policy_no_hits, active) if a)
        # count
        if live is None or num_tokens + num_lookahead_tokens > live.num_covered:
            if self.arena is None:
                need = 0
                for p, ph in zip(policies, policy_hits):
                    need += p.count_columns(rid, num_tokens, ph, num_computed, num_lookahead_tokens)
                if need > self.block_pool.free_block_queue.num_free_blocks:
                    return None
            else:
                room = self._room_needed(rid, num_tokens, policies, policy_hits, hits, num_computed,
                                         num_lookahead_tokens)
                if room is None:
                    return None
        # commit
        if live is None:
            live = self._live[rid] = RequestState(request, tuple(p.table(rid) for p in policies), num_tokens)
            self._count_admission(request, num_new_computed_tokens)
            if self.units is not None:
                self._admit_to_units(live, num_computed)
        elif live.num_scheduled < num_tokens:
            live.num_scheduled = num_tokens
        if hits is not self._no_hits:
            # Pin every group's hits before any group takes a new block: new blocks come off the
            # queue head, which may be another group's hit still in the queue (it would be
            # evicted and end up in two tables).
            free_before = self.block_pool.get_num_free_blocks(), self.state_block_pool.get_num_free_blocks()
            for p, ph in zip(policies, policy_hits):
                p.add_hits(rid, ph)
            if room is not None:  # touched hits came off the free queues: they are not popped
                room = (room[0] - free_before[0] + self.block_pool.get_num_free_blocks(),
                        room[1] - free_before[1] + self.state_block_pool.get_num_free_blocks())
        if self._loads and rid in self._loads:  # its hit is touched: a host-tier load's hold ends
            self._release_load(rid, admitted_tokens=num_computed)
        if room is not None:
            self.arena.make_room(*room)  # type: ignore[union-attr]
        new_blocks: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        any_new = False
        for p, cols in zip(policies, columns):
            per_column = p.allocate_columns(rid, num_tokens, num_lookahead_tokens, num_drafts, num_computed_tokens=num_computed,
                                            decode=num_computed >= request.num_prompt_tokens)
            if per_column[0]:
                any_new = True
                for gid, blocks in zip(cols, per_column):
                    new_blocks[gid] = blocks
        for mp in self._mamba_policies:  # optional spares last: they may only use blocks nobody counted on
            if active is None or mp in policies:
                mp.plan_checkpoint_write(rid)
        # publish: attention KV is written before it is read; never blocks with drafts or placeholders
        if self.enable_caching:
            num_real = min(num_tokens - num_drafts, request.num_tokens)
            for a in self._attention:
                if active is None or a in policies:
                    a.cache_blocks(request, num_real)
        live.recount(self.policies, active)  # this step may have tagged a state: the next retire event moves
        if any_new and self.mamba_managers:
            self._copies_pending = self._zeros_pending = True
        if self.units is not None:
            self.units.settle()
        if not any_new:  # most decode steps need no block: one shared empty result (its lists refuse additions)
            return self._empty_blocks
        out = tuple(new_blocks)
        self._new_results.append(out)  # ids are read only if a plan is taken
        return KVCacheBlocks(out)
