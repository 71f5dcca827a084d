"""KVCacheCoordinator: the one object an engine's scheduler drives, step by step.

Per step, for each scheduled request (DESIGN.md section 6, docs/engine-integration.md)::

    new request:   blocks, n = get_computed_blocks(request)
                   allocate(request, num_new_tokens, num_new_computed_tokens=n, new_computed_blocks=blocks)
    running:       allocate(request, num_new_tokens)              # None: no room, nothing changed
    before forward: run take_copy_plan() (and zero take_zero_plan())
    after verify:   accept_drafts(request_id, num_accepted)       # run the returned copies
    outputs back:   retire(request_id, num_processed_tokens)      # settled tokens only
    finished / preempted: free(request_id)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import (
    HashBlockSizeMismatchError,
    InvalidDraftCountError,
    InvalidRequestError,
    InvalidTokenCountError,
    as_count,
)
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheConfig
from mambakv.groups import LazyMambaManager, MambaManager, SingleTypeKVCacheManager, StatePlan, make_manager
from mambakv.hits import KVCacheBlocks, PrefixCacheStats, PrefixHitFinder


class _LiveRequest:
    """A request that holds blocks: the Request (its hashes publish Mamba states at retire),
    the most tokens any ``allocate`` covered (``retire`` may not go past it), and the tokens
    its tables cover without a new block in any group (min of ``num_covered_tokens``; a decode
    step below it skips the per-group counting)."""

    __slots__ = ("request", "num_scheduled", "num_covered")

    def __init__(self, request: Request, num_scheduled: int) -> None:
        self.request = request
        self.num_scheduled = num_scheduled
        self.num_covered = 0


class KVCacheCoordinator:
    """One BlockPool shared by all groups, one manager per group.

    Args:
        kv_cache_config: ``num_blocks`` (block 0 is the null block) and the groups.
        max_model_len: most tokens a request may reach; more raises InvalidTokenCountError.
        enable_caching: prefix caching; when False hits are always empty.
        use_eagle: back the hit off once by one aligned length (EAGLE/MTP drafters recompute
            the last hit position).
        hash_block_size: tokens per request hash block; None = the smallest group block size.
            It must divide every group's block size.
        enable_kv_cache_events: record KV events in the pool (``block_pool.take_events()``).
        max_num_seqs: most running requests; sizes each lazy Mamba group's scratch region
            (``max_num_seqs x nspec`` blocks reserved from the pool; unused otherwise).
        lazy_spare_may_evict: lazy Mamba groups may evict a cached block for a spare (the
            "lazy-evict" benchmark policy; the default never does).

    Raises:
        HashBlockSizeMismatchError: `hash_block_size` does not divide a group's block size.
        InvalidSpecError: a group's spec has no manager.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, *, max_model_len: int, enable_caching: bool = True,
                 use_eagle: bool = False, hash_block_size: int | None = None,
                 enable_kv_cache_events: bool = False, max_num_seqs: int = 256,
                 lazy_spare_may_evict: bool = False) -> None:
        groups = kv_cache_config.kv_cache_groups
        sizes = [g.kv_cache_spec.block_size for g in groups]
        self.hash_block_size = min(sizes) if hash_block_size is None else hash_block_size
        if self.hash_block_size <= 0 or any(s % self.hash_block_size for s in sizes):
            raise HashBlockSizeMismatchError(f"hash_block_size {self.hash_block_size} must divide every block size {sizes}")
        if max_model_len <= 0:
            raise InvalidTokenCountError(f"max_model_len must be > 0, got {max_model_len}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, enable_kv_cache_events)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(g.kv_cache_spec, self.block_pool, enable_caching=enable_caching, kv_cache_group_id=i,
                         max_num_seqs=max_num_seqs, spare_may_evict=lazy_spare_may_evict)
            for i, g in enumerate(groups)
        )
        self.mamba_managers = tuple(m for m in self.managers if isinstance(m, MambaManager))
        #: ALIGN_LAZY groups: validated, told the computed tokens, and given spares last
        self.lazy_managers = tuple(m for m in self.managers if isinstance(m, LazyMambaManager))
        self._manager_kinds = tuple((m, m in self.lazy_managers) for m in self.managers)
        self._publish_at_allocation = tuple(m for m in self.managers if m.publishes_at_allocation)
        self._publish_at_retire = tuple(m for m in self.managers if not m.publishes_at_allocation)
        self._retiring = tuple(m for m in self.managers if m.retires)
        #: most draft tokens one step may verify: each needs a scratch block in every eager
        #: Mamba group (lazy groups check their own rule); no limit without Mamba groups
        self._max_drafts = min((m.num_speculative_blocks for m in self.mamba_managers
                                if not isinstance(m, LazyMambaManager)), default=1 << 62)
        self._no_hits: tuple[tuple[()], ...] = ((),) * len(self.managers)
        self._empty_blocks = KVCacheBlocks(tuple([] for _ in self.managers))
        #: hits must end on a multiple of every group's block size
        self.alignment_tokens = math.lcm(*sizes)
        self._hits = PrefixHitFinder(self.managers, self.block_pool, self.alignment_tokens)
        #: request id -> (Request, most tokens any allocate covered): one entry per request
        #: that holds blocks; retire publishes with its hashes and is bounded by its count.
        self._live: dict[str, _LiveRequest] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_steps = 0

    # ------------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of `request` cached in every group, capped at
        ``num_tokens - 1`` (the last token is recomputed for its logits).

        Each group may only shorten the candidate length; groups are re-queried until none
        shortens it (fixed point), lengths aligned to the LCM of the block sizes. With
        ``use_eagle``, the fixed point is then recomputed once from the next aligned length
        below it. The blocks are not pinned until ``allocate``.

        Returns ``(blocks per group, hit tokens)``.

        Raises:
            HashBlockSizeMismatchError: the request hashes with another block size.
        """
        request.set_hash_block_size(self.hash_block_size)
        if not self.enable_caching:
            return self._empty_blocks, 0
        hits, length = self._hits.find(request, use_eagle=self.use_eagle)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += length
        return (KVCacheBlocks(tuple(hits)) if length else self._empty_blocks), length

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
        request.set_hash_block_size(self.hash_block_size)
        return self._hits.shared_prefix_length(request) if self.enable_caching else 0

    # ------------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                 new_computed_blocks: KVCacheBlocks | None = None,
                 num_lookahead_tokens: int = 0, num_draft_tokens: int | None = None) -> KVCacheBlocks | None:
        """Make every group's table cover ``computed + num_new_tokens`` tokens.

        ``computed = request.num_computed_tokens + num_new_computed_tokens``; tokens beyond
        ``request.num_tokens`` are draft tokens under verification (never hashed; the Mamba
        groups expect ``accept_drafts`` after the verify). `num_lookahead_tokens` reserves
        attention slots for the drafter's next proposals (never Mamba blocks).
        `num_draft_tokens`: how many of the new tokens are drafts; None derives it as
        ``computed + num_new_tokens - request.num_tokens``. Pass it under async scheduling
        with drafts (an optimistic computed count makes the derived value too large); lazy
        Mamba groups refuse more drafts than their nspec.

        Returns the newly allocated blocks per group (a shared empty result when no group got a
        block: do not mutate it), or None when the pool cannot supply them (hit blocks still in
        the free queue count too): then nothing changed. It never retires.

        Raises (nothing changed):
            InvalidTokenCountError: ``num_new_tokens <= 0``, a negative count, or more than
                ``max_model_len`` tokens.
            StaleCacheHitError: a hit block was evicted and reused since ``get_computed_blocks``.
            HashBlockSizeMismatchError: the request hashes with another block size.
            InvalidDraftCountError: a lazy Mamba group's draft rule (LazyMambaManager.check_step).

        None is also returned when a lazy Mamba group's scratch region has no rows for a
        request's first step with drafts (more than ``max_num_seqs`` such requests).
        """
        if not (type(num_new_tokens) is int and num_new_tokens > 0  # plain ints skip the slow path
                and type(num_new_computed_tokens) is int and num_new_computed_tokens >= 0
                and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0):
            num_new_tokens = as_count(num_new_tokens, "num_new_tokens", 1)
            num_new_computed_tokens = as_count(num_new_computed_tokens, "num_new_computed_tokens")
            num_lookahead_tokens = as_count(num_lookahead_tokens, "num_lookahead_tokens")
        if num_draft_tokens is not None and not 0 <= as_count(num_draft_tokens, "num_draft_tokens") < num_new_tokens:
            raise InvalidTokenCountError(f"num_draft_tokens must be in 0..{num_new_tokens - 1}, got {num_draft_tokens!r}")
        rid = request.request_id
        live = self._live.get(rid)
        if (live is None or live.request is not request or num_new_computed_tokens
                or request.num_computed_tokens > live.num_scheduled):  # all but a running request's step
            self._check_computed(request, live, num_new_computed_tokens, new_computed_blocks)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        if num_tokens > self.max_model_len:
            raise InvalidTokenCountError(f"request {rid!r} would reach {num_tokens} tokens > max_model_len {self.max_model_len}")
        if request.hash_block_size != self.hash_block_size:
            request.set_hash_block_size(self.hash_block_size)
        if new_computed_blocks is None:
            hits: Sequence[Sequence[KVCacheBlock]] = self._no_hits
        else:
            hits = self._hits.checked_hits(request, new_computed_blocks, num_new_computed_tokens)
        managers = self.managers
        if num_draft_tokens is None:
            num_drafts = num_tokens - request.num_tokens
            if num_drafts < 0:
                num_drafts = 0
        else:
            num_drafts = num_draft_tokens
        if num_drafts > self._max_drafts:
            raise InvalidDraftCountError(
                f"{num_drafts} draft tokens but the Mamba groups have {self._max_drafts} speculative blocks")
        for m in self.lazy_managers:
            if not m.check_step(rid, num_tokens, num_computed, num_drafts):
                return None
        # Most decode steps fit the tables as they are: then no group needs counting.
        if live is None or num_tokens + num_lookahead_tokens > live.num_covered or self.lazy_managers:
            need = 0
            for m, hit in zip(managers, hits):
                need += m.get_num_blocks_to_allocate(rid, num_tokens, hit, num_computed, num_lookahead_tokens)
            if need > self.block_pool.free_block_queue.num_free_blocks:
                return None
        new_blocks = []
        any_new = False
        if hits is not self._no_hits:
            # Pin every group's hits before any group takes a new block: new blocks come off the
            # queue head, which may be another group's hit still in the queue (it would be
            # evicted and end up in two tables).
            for m, hit in zip(managers, hits):
                if hit:
                    m.add_computed_blocks(rid, hit)
        for m, is_lazy in self._manager_kinds:
            if is_lazy:
                blocks = m.allocate_new_blocks(rid, num_tokens, num_lookahead_tokens,  # type: ignore[call-arg]
                                               num_draft_tokens=num_drafts, num_computed_tokens=num_computed,
                                               defer_spare=True)
            else:
                blocks = m.allocate_new_blocks(rid, num_tokens, num_lookahead_tokens, num_draft_tokens=num_drafts)
            new_blocks.append(blocks)
            if blocks:
                any_new = True
        for m in self.lazy_managers:  # optional spares last: they may only use blocks nobody counted on
            m.plan_checkpoint_write(rid)
        if live is None:
            live = self._live[rid] = _LiveRequest(request, num_tokens)
        elif live.num_scheduled < num_tokens:
            live.num_scheduled = num_tokens
        if any_new or not live.num_covered:
            live.num_covered = min(m.num_covered_tokens(rid) for m in managers)
        if self.enable_caching:
            num_real = num_tokens if num_drafts == 0 else request.num_tokens
            for m in self._publish_at_allocation:
                m.cache_blocks(request, num_real)
        # Most decode steps need no block: hand out one shared empty result (do not mutate it).
        return KVCacheBlocks(tuple(new_blocks)) if any_new else self._empty_blocks

    def _check_computed(self, request: Request, live: _LiveRequest | None, num_new_computed_tokens: int,
                        new_computed_blocks: KVCacheBlocks | None) -> None:
        """Computed tokens must be backed by blocks: a request that holds none starts from 0
        (after a preemption the engine resets ``num_computed_tokens``) plus exactly its hit;
        a running one cannot have computed more than was ever scheduled, and takes no hits.
        Otherwise blocks that were never computed would be published to the prefix cache."""
        if live is None:
            if request.num_computed_tokens != 0:
                raise InvalidTokenCountError(
                    f"request {request.request_id!r} holds no blocks but has num_computed_tokens="
                    f"{request.num_computed_tokens}; reset it to 0 after a preemption")
            if num_new_computed_tokens and new_computed_blocks is None:
                raise InvalidTokenCountError(
                    f"num_new_computed_tokens={num_new_computed_tokens} needs the hit blocks of get_computed_blocks")
            return
        if live.request is not request:
            raise InvalidRequestError(f"another live request already has the id {request.request_id!r}")
        if num_new_computed_tokens:
            raise InvalidTokenCountError(f"request {request.request_id!r} is running: hits are for new requests")
        if request.num_computed_tokens > live.num_scheduled:
            raise InvalidTokenCountError(
                f"request {request.request_id!r} has num_computed_tokens={request.num_computed_tokens} but only "
                f"{live.num_scheduled} were ever scheduled")

    # ------------------------------------------------------------------ step results
    def retire(self, request_id: str, num_processed_tokens: int) -> None:
        """Outputs came back: `num_processed_tokens` (settled, never the optimistic scheduled
        count) of the request are processed. First publish the Mamba states that are now
        known, then retire what no group needs any more. Idempotent; a request holding no
        blocks is a no-op.

        Raises (nothing changed):
            InvalidTokenCountError: a negative count, or more than the request's tokens or than
                any ``allocate`` covered (tokens never scheduled cannot be processed).
        """
        if type(num_processed_tokens) is not int:
            num_processed_tokens = as_count(num_processed_tokens, "num_processed_tokens")
        elif num_processed_tokens < 0:
            raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
        live = self._live.get(request_id)
        if live is None or num_processed_tokens == 0:
            return
        request = live.request
        if num_processed_tokens > request.num_tokens or num_processed_tokens > live.num_scheduled:
            raise InvalidTokenCountError(
                f"request {request_id!r} has {request.num_tokens} tokens, {live.num_scheduled} "
                f"scheduled: cannot have processed {num_processed_tokens}")
        if self.enable_caching:
            for m in self._publish_at_retire:
                m.cache_blocks(request, num_processed_tokens)
        for m in self._retiring:
            m.remove_skipped_blocks(request_id, num_processed_tokens)

    def accept_drafts(self, request_id: str, num_accepted: int) -> dict[int, list[tuple[int, int]]]:
        """After a verify step: per Mamba group, the copies (accepted scratch -> running
        block) to run after the step's forward. See MambaManager.accept_drafts.

        Raises:
            InvalidDraftCountError: `num_accepted` outside the step's draft count.
        """
        num_accepted = as_count(num_accepted, "num_accepted", error=InvalidDraftCountError)
        # {group id: list} for the groups whose list is not empty (the same shape below)
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.accept_drafts(request_id, num_accepted))}

    def free(self, request_id: str) -> None:
        """A request finished or is preempted: free every group's table and drop all of its
        bookkeeping. Unknown ids are a no-op."""
        for m in self.managers:
            m.free(request_id)
        self._live.pop(request_id, None)

    def preempt_all(self) -> list[str]:
        """Free every request (the engine re-queues them to recompute) and return their ids,
        so that ``reset_prefix_cache`` can succeed with requests running. Each preempted
        request's ``num_computed_tokens`` is set to 0 (it recomputes from scratch), and every
        piece of its bookkeeping, pending state copies included, is dropped: resumed, it
        looks up its prefix and builds a fresh table like a new request."""
        requests = [live.request for live in self._live.values()]
        for request in requests:
            self.free(request.request_id)
            request.num_computed_tokens = 0
        return [r.request_id for r in requests]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changed) while any block is in use. To reset
        with requests running, call ``preempt_all()`` first."""
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ queries
    def new_step(self) -> None:
        """Mark a scheduling step (statistics only; hits never depend on it)."""
        self.num_steps += 1

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids of the request's table in every group (null entries are 0)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def take_copy_plan(self) -> dict[int, list[tuple[int, int]]]:
        """Per Mamba group with copies: ``(src, dst)`` block ids to run before the forward."""
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.take_copy_plan())}

    def take_checkpoint_writes(self) -> dict[int, list[tuple[str, int, int]]]:
        """Per lazy Mamba group: ``(request id, block id, position)`` for each step planned
        since the last call inside a crossing window: its forward writes the state at
        `position` into that block if the step computes that position (drafts included)."""
        return {m.kv_cache_group_id: w for m in self.lazy_managers if (w := m.take_checkpoint_writes())}

    def get_state_plan(self, request_id: str) -> dict[int, StatePlan]:
        """Per lazy Mamba group holding the request: its working / checkpoint / spare /
        scratch block ids and the latest step's write target (LazyMambaManager.get_state_plan)."""
        out = {}
        for m in self.lazy_managers:
            plan = m.get_state_plan(request_id)
            if plan is not None:
                out[m.kv_cache_group_id] = plan
        return out

    def take_zero_plan(self) -> dict[int, list[int]]:
        """Per Mamba group: running blocks that start with no initial state (zero them)."""
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.take_zero_plan())}

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
        num_blocks - 1."""
        pool = self.block_pool
        pool.check_invariants()
        holders: dict[int, int] = {}
        owner: dict[int, int] = {}
        for gid, m in enumerate(self.managers):
            m.check_invariants()
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
                        assert owner.setdefault(b.block_id, gid) == gid, f"block {b.block_id} in two groups"
        for m in self.lazy_managers:  # the scratch regions: held for good, in no table
            for b in m.reserved_blocks:
                assert b.block_id not in holders, f"reserved block {b.block_id} in a table"
                holders[b.block_id] = 1
        assert pool.num_reserved_blocks == sum(len(m.reserved_blocks) for m in self.lazy_managers)
        for bid, n in holders.items():
            assert pool.blocks[bid].ref_cnt == n, f"block {bid}: ref {pool.blocks[bid].ref_cnt} != {n} tables"
        assert pool.get_num_free_blocks() + len(holders) == pool.num_blocks - 1, "blocks leaked"
        for rid, live in self._live.items():
            assert live.request.request_id == rid and live.num_scheduled > 0, f"{rid}: bad live entry"
            assert self.lazy_managers or live.num_covered == min(m.num_covered_tokens(rid) for m in self.managers), \
                f"{rid}: covered-token cache {live.num_covered} out of date"  # (unused with lazy groups)
            assert any(rid in m.req_to_blocks for m in self.managers), f"{rid}: request kept without blocks"
