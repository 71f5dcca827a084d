"""The read side of :class:`~mambakv.coordinator.KVCacheCoordinator`: prefix lookups, plan
drains, read-only views and invariants. Nothing here allocates or frees a block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mambakv.coordinator_pools import CoordinatorPools
from mambakv.core.arena import SuperblockArena
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidRequestError, InvalidTokenCountError, as_count
from mambakv.core.host_tier import HostTier
from mambakv.core.request import Request
from mambakv.core.units import UnitIndex
from mambakv.groups import MambaManager, SingleTypeKVCacheManager, StatePlan
from mambakv.groups.tables import group_block_hashes
from mambakv.hits import PrefixCacheStats, PrefixHitFinder
from mambakv.placement import CheckpointPlacement
from mambakv.plans import EMPTY_STEP_PLAN, GroupPlan, KVCacheBlocks, RequestView, StepPlan
from mambakv.request_state import RequestState, describe


class CoordinatorQueries(CoordinatorPools):
    """Mixed into KVCacheCoordinator, which sets every attribute declared here."""

    managers: tuple[SingleTypeKVCacheManager, ...]
    policies: tuple[SingleTypeKVCacheManager, ...]
    mamba_managers: tuple[MambaManager, ...]
    block_pool: BlockPool
    state_block_pool: BlockPool
    arena: SuperblockArena | None
    units: UnitIndex | None
    hash_block_size: int
    enable_caching: bool
    use_eagle: bool
    prefix_cache_stats: PrefixCacheStats
    num_steps: int
    _hits: PrefixHitFinder
    _live: dict[str, RequestState]
    _empty_blocks: KVCacheBlocks
    _new_results: list[tuple[list[KVCacheBlock], ...]]
    _copies_pending: bool
    _own_copy_drains: bool
    _zeros_pending: bool
    max_model_len: int
    _columns: tuple[tuple[int, ...], ...]
    _no_hits: tuple[tuple[()], ...]
    checkpoint_placement: CheckpointPlacement
    chunk_alignment: int
    host: HostTier | None
    _loads: dict[str, Any]

    if TYPE_CHECKING:  # CoordinatorHost's
        def _load_holders(self) -> list[KVCacheBlock]: ...

    # ------------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of `request` cached in every group, capped at
        ``num_tokens - 1`` (the last token is recomputed for its logits).

        Each group may only shorten the candidate length; groups are re-queried until none
        shortens it (fixed point), lengths aligned to the LCM of the block sizes. With
        ``use_eagle``, the fixed point is then recomputed once from the next aligned length
        below it. The blocks are not pinned until ``allocate``.

        Returns ``(blocks per group, hit tokens)``; a miss returns the shared empty result
        (``KVCacheBlocks.shared_empty``: its lists raise ReadOnlyResultError on an addition).

        Raises:
            InvalidRequestError: `request` is not a Request.
            HashBlockSizeMismatchError: the request hashes with another block size.
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"get_computed_blocks needs a Request, got {type(request).__name__}")
        request.set_hash_block_size(self.hash_block_size)
        if not self.enable_caching:
            return self._empty_blocks, 0
        hits, length = self._hits.find(request, use_eagle=self.use_eagle)
        return (KVCacheBlocks(tuple(hits)) if length else self._empty_blocks), length

    def next_chunk_end(self, request: Request, budget: int, *, num_computed_tokens: int | None = None) -> int:
        """Where the request's next prefill chunk should end (tokens, absolute): the smallest
        position the checkpoint placement proposes in ``(computed, min(computed + budget, N)]``,
        else that limit (:mod:`mambakv.placement`). The engine schedules ``end - computed``
        tokens. Call it for every prefill chunk, the first one at admission with
        `num_computed_tokens` = the hit length (default ``request.num_computed_tokens``).
        Read-only on the pool (the junction rule looks up the shared prefix at admission).

        Raises:
            InvalidTokenCountError: a negative or non-int count, or more computed tokens than the request has.
            InvalidRequestError: `request` is not a Request.
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"next_chunk_end needs a Request, got {type(request).__name__}")
        budget = as_count(budget, "budget")
        computed = request.num_computed_tokens if num_computed_tokens is None else as_count(
            num_computed_tokens, "num_computed_tokens")
        if computed > request.num_tokens:
            raise InvalidTokenCountError(f"request {request.request_id!r}: {computed} computed tokens > its "
                                         f"{request.num_tokens} tokens")
        return self.checkpoint_placement.chunk_end(self, request, computed, budget, self.chunk_alignment)

    def holds_blocks(self, request_id: str) -> bool:
        """Whether the request holds blocks (allocated and not freed). O(1)."""
        return request_id in self._live

    def get_shared_prefix_length(self, request: Request) -> int:
        """Tokens: the longest prefix of `request` (aligned like a hit, at most
        ``num_tokens - 1``) that the attention-type groups cache, Mamba groups ignored.

        Beyond the hit of ``get_computed_blocks`` it marks a prefix shared with an earlier
        request whose Mamba state was never published there (states exist only at chunk
        ends). A scheduler that ends a prefill chunk exactly here publishes that state, so
        the next request sharing the prefix hits it (a Marconi-style junction; vLLM 0.33
        stops chunks at the same place). 0 without caching or attention groups. Read-only:
        pins nothing and counts no statistics.
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"get_shared_prefix_length needs a Request, got {type(request).__name__}")
        request.set_hash_block_size(self.hash_block_size)
        return self._hits.shared_prefix_length(request) if self.enable_caching else 0

    def num_blocks_needed(self, request: Request, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                          new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0) -> int:
        """Free blocks ``allocate`` would consume for this step, hit blocks still in the free
        queue included (nano-vllm's ``can_allocate``), summed over every group: in the unified
        layout compare with ``block_pool.get_num_free_blocks()``; in the decoupled one it adds
        pages and state slots of two pools, so ask ``can_allocate`` instead. Read-only.

        Raises:
            InvalidTokenCountError: a negative or non-int count.
        """
        num_new_tokens = as_count(num_new_tokens, "num_new_tokens")
        num_computed = request.num_computed_tokens + as_count(num_new_computed_tokens, "num_new_computed_tokens")
        lookahead = as_count(num_lookahead_tokens, "num_lookahead_tokens")
        num_tokens = num_computed + num_new_tokens
        lookahead = max(0, min(lookahead, self.max_model_len - num_tokens))
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hits
        rid = request.request_id
        return sum(m.count_columns(rid, num_tokens, [hits[g] for g in cols], num_computed, lookahead)
                   for m, cols in zip(self.policies, self._columns))

    # ------------------------------------------------------------------ plans
    def take_step_plan(self) -> StepPlan:
        """Every group's device work since the last drain, as one immutable :class:`StepPlan`
        (new block ids, pre-forward copies, zero rows, checkpoint writes). Returns the shared
        ``EMPTY_STEP_PLAN`` at once when nothing happened."""
        writes = self.take_checkpoint_writes()
        results = self._new_results
        if not (results or self._copies_pending or self._zeros_pending or writes):
            return EMPTY_STEP_PLAN
        copies = self.take_copy_plan()
        zeros = self.take_zero_plan()
        self._new_results = []
        out = []
        for gid in range(len(self.managers)):
            plan = GroupPlan(gid, tuple(b.block_id for r in results for b in r[gid]), tuple(copies.get(gid, ())),
                             tuple(zeros.get(gid, ())), tuple(writes.get(gid, ())))
            if not plan.empty:
                out.append(plan)
        return StepPlan(tuple(out)) if out else EMPTY_STEP_PLAN

    def take_copy_plan(self) -> dict[int, list[tuple[int, int]]]:
        """Per Mamba group with copies: ``(src, dst)`` block ids to run before the forward."""
        if not self._copies_pending:
            return {}
        self._copies_pending = False
        out = {}
        if self._own_copy_drains:  # each manager's take_copy_plan, inline (a call per group saved)
            for m in self.mamba_managers:
                plan = m._copy_plan
                if plan:
                    m._copy_plan = []
                    out[m.kv_cache_group_id] = plan
            return out
        for m in self.mamba_managers:
            plan = m.take_copy_plan()
            if plan:
                out[m.kv_cache_group_id] = plan
        return out

    def take_zero_plan(self) -> dict[int, list[int]]:
        """Per Mamba group: running blocks that start with no initial state (zero them)."""
        if not self._zeros_pending:
            return {}
        self._zeros_pending = False
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.take_zero_plan())}

    def take_checkpoint_writes(self) -> dict[int, list[tuple[str, int, int]]]:
        """Per Mamba group: ``(request id, block id, position)`` for each block a step planned
        since the last call writes (running state, scratch, ``latest``'s spare) and the
        position it holds after the step; a spare gets the state at `position` only if the
        step computes that position (drafts included). See MambaManager.take_checkpoint_writes."""
        # A group with nothing listed is skipped without a call: most steps list nothing.
        return {m.kv_cache_group_id: m.take_checkpoint_writes() for m in self.mamba_managers if m._writes}

    def get_state_plan(self, request_id: str) -> dict[int, StatePlan]:
        """Per Mamba group holding the request: its running / spare / scratch block ids and
        the latest step's write target (MambaManager.get_state_plan)."""
        out = {}
        for m in self.mamba_managers:
            plan = m.get_state_plan(request_id)
            if plan is not None:
                out[m.kv_cache_group_id] = plan
        return out

    def get_state_slot_ids(self, request_id: str) -> dict[int, tuple[int, ...]]:
        """Per Mamba group, the state rows the request's next forward uses, for a kernel's state
        indices: ``(running, scratch_1, ..., scratch_nspec)``. The forward reads the running row
        (after the step's pre-forward copies) and writes it and the scratch rows. ``-1`` where
        there is none: every entry of a group that holds no state for the request yet. Rows are
        state slot ids in the decoupled layout (``DecoupledLayout.mamba_states``), block ids in
        the unified one."""
        out = {}
        for m in self.mamba_managers:
            plan = m.get_state_plan(request_id)
            if plan is None:
                out[m.kv_cache_group_id] = (-1,) * (1 + m.num_speculative_blocks)
            else:
                out[m.kv_cache_group_id] = (plan.working_block_id, *plan.scratch_block_ids)
        return out

    # ------------------------------------------------------------------ queries
    def new_step(self) -> None:
        """Mark a scheduling step (statistics; hits never depend on it). The new block ids and
        checkpoint writes of ``take_step_plan`` / ``take_checkpoint_writes`` cover the steps
        planned since the last ``new_step`` or drain: what an engine did not take is dropped
        here, so nothing accumulates for an engine that never asks."""
        self.num_steps += 1
        if self._new_results:
            self._new_results = []
        for m in self.mamba_managers:  # m.drop_checkpoint_writes(), inlined
            if m._writes:
                m._writes = []

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids of the request's table in every group (null entries are 0)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def describe(self, request_id: str) -> RequestView | None:
        """A read-only snapshot of a live request: its token counts and, per group, its table
        (block ids, cursors, the Mamba running slot, unsettled states, pending verifies). None
        for a request that holds no blocks."""
        live = self._live.get(request_id)
        return None if live is None else describe(live, self.managers)

    @property
    def num_running_requests(self) -> int:
        """Requests that hold blocks (allocated and not freed)."""
        return len(self._live)

    @property
    def request_ids(self) -> list[str]:
        """Ids of the requests that hold blocks, in allocation order."""
        return list(self._live)

    def check_invariants(self) -> None:
        """Pool and per-manager invariants, plus: every held block's ref count equals the
        number of tables holding it, and those tables are of one group; free + held ==
        num_blocks - 1; each live request's tables are its managers' and its thresholds are
        current."""
        if self.arena is not None:
            self.arena.check_invariants()
            if self.units is not None:
                page = self.units.page_tokens
                live_keys = {h for live in self._live.values() for h in group_block_hashes(live.request, page)}
                live_keys.update(h for load in self._loads.values() for h in load.hashes)
                self.units.check_invariants(live_keys)
        else:
            self.block_pool.check_invariants()
        holders: dict[tuple[int, int], int] = {}
        owner: dict[tuple[int, int], int] = {}
        for gid, m in enumerate(self.managers):
            m.check_invariants()
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        key = (b.pool_id, b.block_id)
                        assert b.pool_id == m.block_pool.pool_id, f"block {b.block_id} of another pool in group {gid}"
                        holders[key] = holders.get(key, 0) + 1
                        assert owner.setdefault(key, gid) == gid, f"block {b.block_id} in two groups"
        for b in self._load_holders():  # a host-tier load's hold counts as one holder
            holders[(b.pool_id, b.block_id)] = holders.get((b.pool_id, b.block_id), 0) + 1
        if self.host is not None:
            self.host.check_invariants()
        for pool in self.pools:
            if self.arena is None:
                assert pool.num_reserved_blocks == 0, "no group reserves blocks"
            held = 0
            for (pid, bid), n in holders.items():
                if pid == pool.pool_id:
                    held += 1
                    assert pool.blocks[bid].ref_cnt == n, f"block {bid}: ref {pool.blocks[bid].ref_cnt} != {n} tables"
            assert pool.get_num_free_blocks() + held + pool.num_reserved_blocks == pool.num_blocks - 1, "blocks leaked"
        for rid in self._loads:
            assert rid not in self._live, f"{rid}: a load's hold on a live request"
        for rid, live in self._live.items():
            assert live.request.request_id == rid and live.num_scheduled > 0, f"{rid}: bad live entry"
            for m, t in zip(self.policies, live.tables):
                assert m.get_table(rid) is t, f"{rid}: group {m.kv_cache_group_id} table is not the request state's"
            assert live.num_covered <= min(m.num_covered_tokens(rid) for m in self.managers), \
                f"{rid}: covered-token cache {live.num_covered} above a group's (0 = recount)"
            assert live.quiet_tokens <= min(m.quiet_tokens(t) for m, t in zip(self.policies, live.tables)), \
                f"{rid}: quiet threshold {live.quiet_tokens} above a group's"
            if live.retire_quiet:
                assert live.retire_quiet <= min(m.next_event(t) for m, t in zip(self.policies, live.tables)), \
                    f"{rid}: retire threshold {live.retire_quiet} above a group's next event"
            for m, t, e, (c, q) in zip(self.policies, live.tables, live.events, live.thresholds):
                # a retire skips a policy below its own next event, an allocate one within its own thresholds
                assert e <= m.next_event(t), f"{rid}: group {m.kv_cache_group_id}'s next event {e} is stale"
                covered, quiet = m.thresholds(t)
                assert c <= covered and q <= quiet, f"{rid}: group {m.kv_cache_group_id}'s thresholds {(c, q)} are stale"
        for m in self.managers:
            for rid in m.req_to_blocks:
                assert rid in self._live, f"{rid}: table kept by group {m.kv_cache_group_id} without a request state"
