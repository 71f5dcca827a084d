"""The read side of :class:`~mambakv.coordinator.KVCacheCoordinator`: prefix lookups,
read-only views and invariants (the plan drains are :mod:`mambakv.coordinator_plans`). Nothing
here allocates or frees a block."""

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
from mambakv.groups import MambaManager, SingleTypeKVCacheManager
from mambakv.groups.tables import group_block_hashes
from mambakv.hits import PrefixCacheStats, PrefixHitFinder
from mambakv.placement import CheckpointPlacement
from mambakv.plans import KVCacheBlocks, RequestView
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

    # ------------------------------------------------------------------ queries
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
