"""VllmKVCacheManager: the ``kv_cache_manager`` vLLM 0.33's Scheduler reads, on mambakv.

vLLM's ``Scheduler`` calls its block manager by name (``allocate_slots``,
``get_computed_blocks``, ``free``, ``cache_blocks``, ``get_blocks``, ``take_events``, ...). This
class answers those names with one :class:`~mambakv.coordinator.KVCacheCoordinator` (unified
layout) underneath; each vLLM request is read in place through a
:class:`~mambakv.integrations.vllm.request_view.VllmRequestView` (its hashes are vLLM's).

How vLLM's calls map (attention-only and hybrid models, unified layout):

=============================================  ==========================================
vLLM's call                                     mambakv
=============================================  ==========================================
``get_computed_blocks(req, max_len)``           ``get_computed_blocks(view, max_length=)``
``allocate_slots(req, n, ...)``                 admission gates, then ``allocate(view, n,
                                                num_draft_tokens=d)``; returns the step's
                                                ``table_appends`` (what the worker appends)
``cache_blocks(req, n)`` (after outputs)        ``retire(request_id, n)``; a running
                                                request's settled tokens are also retired
                                                in its next ``allocate``
``free(req)``                                   ``free(request_id, num_processed_tokens=
                                                settled)``: publish, then free whole
``get_blocks`` / ``get_block_ids`` / ``usage``  the same names
``take_events()``                               ``take_events()`` as vLLM event objects
``make_prefix_cache_stats()``                   ``make_prefix_cache_stats()`` as vLLM's
                                                ``PrefixCacheStats`` (None without log_stats)
``new_step_starts()``                           ``new_step()``
``take_new_block_ids()``                        ``take_step_plan()``'s new attention blocks
=============================================  ==========================================

The drafts of a step, ``d``: the scheduled tokens past the request's known tokens and its
output placeholders (``computed + n - (num_tokens + num_output_placeholders)``), so an async
step's placeholder is never taken for a draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock as VllmKVCacheBlock
from vllm.v1.metrics.stats import PrefixCacheStats as VllmPrefixCacheStats
from vllm.v1.request import RequestStatus

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import UnsupportedEngineError
from mambakv.integrations.vllm.config import convert_kv_cache_config
from mambakv.integrations.vllm.events import event_metadata, to_vllm_events
from mambakv.integrations.vllm.request_view import VllmRequestView
from mambakv.plans import EMPTY_STEP_PLAN, KVCacheBlocks, StepPlan

__all__ = ["VllmKVCacheManager"]

_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _vllm_blocks(groups: tuple[list[KVCacheBlock], ...]) -> VllmKVCacheBlocks:
    """mambakv's blocks per group in vLLM's ``KVCacheBlocks``. vLLM's scheduler and worker
    read only ``block_id``, ``block_hash`` and ``is_null`` of a result's blocks, which a
    mambakv block has with the same meaning; the lists are the coordinator's (not copied)."""
    return VllmKVCacheBlocks(cast("tuple[Sequence[VllmKVCacheBlock], ...]", groups))


class VllmKVCacheManager:
    """vLLM's block-manager surface over one mambakv coordinator.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (converted by
            :func:`~mambakv.integrations.vllm.config.convert_kv_cache_config`).
        max_model_len: tokens; the scheduler's ``max_model_len``.
        hash_block_size: tokens per entry of vLLM's ``request.block_hashes``.
        enable_caching: prefix caching (vLLM's ``enable_prefix_caching``).
        use_eagle: back hits off by one block (vLLM's EAGLE block drop).
        log_stats: keep prefix-cache statistics for ``make_prefix_cache_stats``.
        enable_kv_cache_events: record KV events for ``take_events``.
        watermark: fraction of the blocks kept free when admitting a waiting or preempted
            request while others are scheduled (vLLM's ``SchedulerConfig.watermark``;
            ``int(watermark x num_blocks)`` blocks, as vLLM counts it).

    Raises:
        UnsupportedEngineError: a KV-cache group kind the integration refuses (one line).
    """

    def __init__(self, kv_cache_config: Any, *, max_model_len: int, hash_block_size: int, enable_caching: bool,
                 use_eagle: bool, log_stats: bool, enable_kv_cache_events: bool, watermark: float) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        #: the mambakv coordinator underneath (unified layout)
        self.kv = KVCacheCoordinator(convert_kv_cache_config(kv_cache_config), max_model_len=max_model_len,
                                     enable_caching=enable_caching, use_eagle=use_eagle,
                                     hash_block_size=hash_block_size, enable_kv_cache_events=enable_kv_cache_events)
        self.hash_block_size = hash_block_size
        self.block_pool: BlockPool = self.kv.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        #: the result for "no blocks" (vLLM's name; immutable tuples)
        self.empty_kv_cache_blocks = VllmKVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._event_metadata = event_metadata(kv_cache_config)
        #: request id -> its view, from the first lookup to the finish (preemptions included)
        self._views: dict[str, VllmRequestView] = {}
        self._reset_since_stats = False
        self._has_mamba = bool(self.kv.mamba_managers)
        self._attention_gids = frozenset(i for i, m in enumerate(self.kv.managers) if m not in self.kv.mamba_managers)
        #: the coordinator's step plan drained by the latest ``take_new_block_ids`` (once a step)
        self.last_step_plan: StepPlan = EMPTY_STEP_PLAN

    # ------------------------------------------------------------------ requests
    def _view(self, request: Any) -> VllmRequestView:
        """The request's view, made on first sight (and again for another object with the
        same id): one per request from its first lookup to its finish."""
        view = self._views.get(request.request_id)
        if view is None or view.request is not request:
            view = self._views[request.request_id] = VllmRequestView(request, self.hash_block_size)
        return view

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether a prefix-cache lookup may run for `request` (caching on and the request does
        not skip reading the cache, e.g. for prompt logprobs)."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The request's prefix hit: ``(vLLM KVCacheBlocks, hit tokens, junction)``, the hit
        capped at ``num_tokens - 1`` and at `max_cache_hit_length` tokens. `junction` (tokens,
        vLLM's shared-prefix boundary, where its scheduler ends a chunk): with Mamba groups the
        coordinator's ``get_shared_prefix_length`` when it reaches past the hit, else 0 (always 0
        for attention-only models)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        view = self._view(request)
        blocks, length = self.kv.get_computed_blocks(view, max_length=max_cache_hit_length)
        junction = self.kv.get_shared_prefix_length(view) if self._has_mamba else 0
        if junction <= length:
            junction = 0
        if not length:
            return self.empty_kv_cache_blocks, 0, junction
        return _vllm_blocks(blocks.blocks), length, junction

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """vLLM's admission-time count: the coordinator already counted this admission in its
        ``allocate`` (the same moment, the same numbers), so nothing is added here."""

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        """Slots for the step's `num_new_tokens` (after `num_new_computed_tokens` hit tokens);
        the new suffix of every worker table as vLLM ``KVCacheBlocks``, or None when the cache
        cannot hold the step (nothing changed: vLLM preempts or keeps the request waiting).

        Admission gates, as vLLM's: with `full_sequence_must_fit` the request's whole sequence
        (``min(num_tokens, max_model_len)`` tokens) must fit, and a waiting or preempted request
        admitted while others are scheduled must leave ``watermark_blocks`` free.

        Raises:
            UnsupportedEngineError: an argument of a refused feature (external / connector
                tokens, encoder tokens, delayed caching, reserved blocks).
            mambakv errors of ``KVCacheCoordinator.allocate`` (nothing changed).
        """
        if num_external_computed_tokens or num_encoder_tokens or delay_cache_blocks or reserved_blocks:
            raise UnsupportedEngineError("mambakv.integrations.vllm does not support KV connectors or encoder "
                                         "tokens (allocate_slots got external / encoder / delayed / reserved blocks)")
        rid = request.request_id
        view = self._views.get(rid)  # (inline: once per scheduled request and step)
        if view is None or view.request is not request:
            view = self._views[rid] = VllmRequestView(request, self.hash_block_size)
        kv = self.kv
        computed = request.num_computed_tokens + num_new_computed_tokens
        hits = None
        # A running request's step passes none of these (vLLM asks no gate of it); the
        # watermark is read first: 0 unless configured.
        if num_new_computed_tokens or full_sequence_must_fit or (
                self.watermark_blocks and has_scheduled_reqs and request.status in _ADMITTING):
            if num_new_computed_tokens and new_computed_blocks is not None:
                hits = KVCacheBlocks(tuple(list(g) for g in new_computed_blocks.blocks))
            watermark = (self.watermark_blocks if has_scheduled_reqs and request.status in _ADMITTING else 0)
            free = self.block_pool.get_num_free_blocks()
            if full_sequence_must_fit:
                full = min(request.num_tokens, self.max_model_len)
                need = kv.num_blocks_needed(view, max(full - computed, 0), num_new_computed_tokens=num_new_computed_tokens,
                                            new_computed_blocks=hits)
                if need + watermark > free:
                    return None
            if watermark:
                need = kv.num_blocks_needed(view, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
                                            new_computed_blocks=hits, num_lookahead_tokens=num_lookahead_tokens)
                if need + watermark > free:
                    return None
        num_drafts = computed + num_new_tokens - request.num_tokens - request.num_output_placeholders
        # A running request's settled tokens (vLLM calls no manager method after a synchronous
        # step without drafts): retired in the same call, so what they completed is published.
        # (A request holding no blocks has 0 settled tokens here, or its retire is a no-op.)
        settled = computed - request.num_in_flight_tokens if hits is None else 0
        result = kv.allocate(view, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
                             new_computed_blocks=hits, num_lookahead_tokens=num_lookahead_tokens,
                             num_draft_tokens=num_drafts if num_drafts > 0 else 0,
                             num_processed_tokens=settled if settled > 0 else None)
        if result is None:
            return None
        appends = result.table_appends
        if appends is None:
            appends = result.blocks
        if not any(appends):
            return self.empty_kv_cache_blocks
        return _vllm_blocks(appends)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Outputs came back: `num_computed_tokens` of the request are settled; publish what they
        complete (the coordinator's ``retire``)."""
        if self.enable_caching and self.kv.holds_blocks(request.request_id):
            self.kv.retire(request.request_id, min(num_computed_tokens, request.num_tokens))

    def free(self, request: Any) -> None:
        """Free the request's blocks (finished or preempted), publishing what its settled tokens
        complete first (``free(..., num_processed_tokens=)``: one free of the whole tables, in
        vLLM's order, so the request's deepest Mamba state is not evicted before its attention
        blocks); a finished request's view goes."""
        settled = min(request.num_computed_tokens - request.num_in_flight_tokens, request.num_tokens)
        self.kv.free(request.request_id, num_processed_tokens=settled if self.enable_caching and settled > 0 else None)
        if request.is_finished():
            self._views.pop(request.request_id, None)

    def new_step_starts(self) -> None:
        """A scheduler step begins."""
        self.kv.new_step()

    # ------------------------------------------------------------------ reads
    def get_blocks(self, request_id: str) -> Any:
        """The request's tables as vLLM ``KVCacheBlocks`` (empty when it holds none)."""
        tables = self.kv.get_blocks(request_id).blocks
        return _vllm_blocks(tables) if any(tables) else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (null entries are 0)."""
        return self.kv.get_block_ids(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """vLLM keeps this name for out-of-tree schedulers (cascade attention is gone): 0 per group."""
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's prefix whose blocks carry a hash (published), the smallest
        over the groups; vLLM's prefill statistics read it when a request first emits output."""
        tokens = None
        for m, blocks in zip(self.kv.managers, self.kv.get_blocks(request.request_id).blocks):
            n = 0
            for j in range(len(blocks) - 1, -1, -1):
                if blocks[j].block_hash is not None:
                    n = (j + 1) * m.block_size
                    break
            tokens = n if tokens is None else min(tokens, n)
        return tokens or 0

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks in tables (0.0 .. 1.0)."""
        return self.kv.usage

    def take_events(self) -> list[Any]:
        """The KV events since the last call, as vLLM event objects (BlockStored carries the
        group's kind and sliding window)."""
        return to_vllm_events(self.kv.take_events(), self._event_metadata)

    def make_prefix_cache_stats(self) -> Any:
        """Take and reset the prefix-cache statistics as vLLM's ``PrefixCacheStats`` (None when
        ``log_stats`` is off, as vLLM's manager)."""
        if not self.log_stats:
            return None
        ours = self.kv.make_prefix_cache_stats()
        stats = VllmPrefixCacheStats(reset=self._reset_since_stats, requests=ours.requests, queries=ours.queries,
                                     hits=ours.hits, preempted_requests=ours.preempted_requests,
                                     preempted_queries=ours.preempted_queries, preempted_hits=ours.preempted_hits)
        self._reset_since_stats = False
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changed) while a block is in use."""
        if not self.kv.reset_prefix_cache():
            return False
        if self.log_stats:
            self._reset_since_stats = True
        return True

    # ------------------------------------------------------------------ device-side drains (none here)
    def take_new_block_ids(self) -> list[int]:
        """The attention blocks allocated since the last call, for vLLM's worker to zero (hybrid
        models: a block may have held a Mamba state before). The step plan it drains stays in
        ``last_step_plan``; vLLM's worker derives the Mamba state copies from the block tables
        itself (the plan's copies are the same pairs: tests/integrations)."""
        plan = self.kv.take_step_plan()
        self.last_step_plan = plan
        if not self._has_mamba:
            return []
        return [b for g in plan.groups if g.group_id in self._attention_gids for b in g.new_block_ids]

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Copy-on-write block copies of partial-block hits: none (partial hits are refused)."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states for a KV connector: none (connectors are refused)."""
        return {}

    def check_invariants(self) -> None:
        """The coordinator's invariants, and no view outlives the requests vLLM still knows of
        more than their finish (views are dropped at a finished request's ``free``).

        Raises:
            AssertionError: an invariant does not hold."""
        self.kv.check_invariants()
        for rid in self.kv.request_ids:
            assert rid in self._views, f"request {rid!r} holds blocks but has no view"
