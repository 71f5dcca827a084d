"""KVCacheCoordinator: the one object an engine's scheduler drives, step by step.

Per step, for each scheduled request (DESIGN.md section 6, docs/engine-integration.md)::

    new request:   blocks, n = get_computed_blocks(request)
                   allocate(request, num_new_tokens, num_new_computed_tokens=n, new_computed_blocks=blocks,
                            num_draft_tokens=d)
    running:       allocate(request, num_new_tokens, num_draft_tokens=d)   # None: no room, nothing changed
    before forward: run take_copy_plan() (and zero take_zero_plan()), or take_step_plan()
    after verify:   accept_drafts(request_id, num_accepted)       # run the returned copies
    outputs back:   retire(request_id, num_processed_tokens)      # settled tokens only
    finished / preempted: free(request_id)

Every call flows one way: checks (typed errors, nothing changed) -> count -> commit -> plan.
A running request's step that needs no block, publishes nothing and records nothing is O(1)
(``RequestState.quiet_tokens``); so is a ``retire`` below its next event (``retire_quiet``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mambakv.coordinator_host import CoordinatorHost
from mambakv.coordinator_plans import CoordinatorPlans
from mambakv.coordinator_pools import CoordinatorPools, build_host_tier, build_pools, build_units, unit_table_managers
from mambakv.coordinator_queries import CoordinatorQueries
from mambakv.coordinator_results import CoordinatorResults
from mambakv.coordinator_steps import NOT_A_CHUNK, CoordinatorSteps
from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import (
    HashBlockSizeMismatchError,
    InvalidRequestError,
    InvalidSpecError,
    InvalidTokenCountError,
    as_count,
    as_seconds,
)
from mambakv.core.eviction import EvictionPolicy
from mambakv.core.host_tier import HostTierSpec, HostWrite
from mambakv.core.pool_checks import keeps_calls
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheConfig, MambaCacheMode
from mambakv.groups import MambaManager, SingleTypeKVCacheManager, make_manager, share_identical_policies
from mambakv.hits import PrefixCacheStats, PrefixHitFinder
from mambakv.placement import DEFAULT_PLACEMENT, CheckpointPlacement, resolve_placement
from mambakv.plans import KVCacheBlocks
from mambakv.request_state import RequestState, check_computed, checked_draft_count

__all__ = ["DEFAULT_PLACEMENT", "KVCacheCoordinator", "share_identical_policies"]


class KVCacheCoordinator(CoordinatorSteps, CoordinatorHost, CoordinatorResults, CoordinatorQueries, CoordinatorPlans,
                         CoordinatorPools):
    """One manager per group over one BlockPool (unified) or a SuperblockArena's two pools (decoupled).

    Args:
        kv_cache_config: ``num_blocks`` (block 0 is the null block) and the groups.
        max_model_len: most tokens a request may reach; more raises InvalidTokenCountError.
        enable_caching: prefix caching; when False hits are always empty.
        use_eagle: back the hit off once by one aligned length (EAGLE/MTP drafters recompute
            the last hit position).
        hash_block_size: tokens per request hash block; None = the smallest group block size.
            It must divide every group's block size.
        enable_kv_cache_events: record KV events in the pools (``take_events()``).
        max_num_seqs: accepted for 0.x callers, unused (nothing is reserved per request slot).
        lazy_spare_may_evict: Mamba groups with ``decode_checkpoints="latest"`` may evict a
            cached block for a spare (a benchmark knob; the default never does).
        checkpoint_placement: where ``next_chunk_end`` ends prefill chunks (so where Mamba
            states are published): a :class:`~mambakv.placement.CheckpointPlacement` or rule
            names (``placement_from_names``; a str is split at commas); None: the layout's default
            (``DEFAULT_PLACEMENT``: vLLM 0.33's rules unified, measured ones decoupled).
        eviction: the decoupled layout's unit eviction policy (``"reuse"``, the default, or ``"lru"``).
        host_tier: a :class:`~mambakv.core.host_tier.HostTierSpec`: a host-memory tier holding
            units (``get_computed_blocks_tiered``, :mod:`mambakv.coordinator_host`); None: none.

    Raises:
        HashBlockSizeMismatchError: `hash_block_size` is not a positive int or does not divide a
            group's block size (or, when None, the smallest block size does not divide the others).
        InvalidTokenCountError: `max_model_len` is not a positive int.
        InvalidSpecError: `kv_cache_config` is not a KVCacheConfig, a group's spec has no manager,
            or `max_num_seqs` is not a positive int.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, *, max_model_len: int, enable_caching: bool = True,
                 use_eagle: bool = False, hash_block_size: int | None = None,
                 enable_kv_cache_events: bool = False, max_num_seqs: int = 256,
                 lazy_spare_may_evict: bool = False,
                 checkpoint_placement: CheckpointPlacement | Sequence[str] | None = None,
                 eviction: str | EvictionPolicy | None = None, host_tier: HostTierSpec | None = None) -> None:
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise InvalidSpecError(f"kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}")
        groups = kv_cache_config.kv_cache_groups
        sizes = [g.kv_cache_spec.block_size for g in groups]
        if hash_block_size is None:
            self.hash_block_size = min(sizes)
            if any(s % self.hash_block_size for s in sizes):
                raise HashBlockSizeMismatchError(
                    f"the groups' block sizes {sizes} have no default hash block size (the smallest, "
                    f"{self.hash_block_size}, does not divide them all): pass hash_block_size={math.gcd(*sizes)}")
        else:
            self.hash_block_size = as_count(hash_block_size, "hash_block_size", 1, error=HashBlockSizeMismatchError)
            if any(s % self.hash_block_size for s in sizes):
                raise HashBlockSizeMismatchError(
                    f"hash_block_size {self.hash_block_size} must divide every block size {sizes}")
        self.max_model_len = as_count(max_model_len, "max_model_len", 1)
        as_count(max_num_seqs, "max_num_seqs", 1, error=InvalidSpecError)
        self.kv_cache_config = kv_cache_config
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        #: decoupled: the superblocks behind the page pool (``block_pool``) and the state-slot pool
        #: (``state_block_pool``); unified: None, and one pool is both
        self.arena, self.block_pool, self.state_block_pool = build_pools(kv_cache_config, enable_caching,
                                                                         enable_kv_cache_events)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(g.kv_cache_spec, self.pool_of(g.kv_cache_spec), enable_caching=enable_caching,
                         kv_cache_group_id=i, max_num_seqs=max_num_seqs, spare_may_evict=lazy_spare_may_evict)
            for i, g in enumerate(groups)
        )
        self.mamba_managers = tuple(m for m in self.managers if isinstance(m, MambaManager))
        #: decoupled: the eviction units and their policy (mambakv.core.units), else None
        self.units = build_units(self.arena, self.managers, eviction, enable_caching)
        self._unit_tables = unit_table_managers(self.units, self.managers)
        #: the host-memory tier (``host_tier``), else None
        self.host = build_host_tier(host_tier, kv_cache_config, self.managers, self.block_pool, self.state_block_pool,
                                    self.units, enable_caching, use_eagle)
        if self.host is not None and self.host.write is HostWrite.EVICT and self.units is not None:
            self.units.before_evict = self._store_evicted
        self._loads = {}
        #: seconds: the engine's clock, the latest ``now`` given to allocate / free (ages of units)
        self.now = 0.0
        #: the managers that run a policy (groups with one Mamba spec share the first one's)
        self.policies: tuple[SingleTypeKVCacheManager, ...] = share_identical_policies(self.managers)
        self._columns = tuple(m.column_ids for m in self.policies)
        #: the policies' columns in policy order, and where each group's column sits among them
        flat = [g for cols in self._columns for g in cols]
        self._column_of_group = tuple(flat.index(g) for g in range(len(self.managers)))
        self._columns_in_order = flat == list(range(len(self.managers)))
        #: per policy, its columns' (empty) hit lists when a step has no hits
        self._policy_no_hits = tuple(((),) * len(cols) for cols in self._columns)
        self._mamba_policies = tuple(m for m in self.policies if isinstance(m, MambaManager))
        self._attention = tuple(m for m in self.policies if m.publishes_at_allocation)
        #: most draft tokens one step may verify without a group refusing it (each eager Mamba
        #: group checks its own rule above this); no limit without Mamba groups
        self._max_drafts = min((m.num_speculative_blocks for m in self.mamba_managers), default=1 << 62)
        self._no_hits: tuple[tuple[()], ...] = ((),) * len(self.managers)
        self._empty_blocks = KVCacheBlocks.shared_empty(len(self.managers))  # changes to it raise
        #: hits must end on a multiple of every group's block size
        self.alignment_tokens = math.lcm(*sizes)
        self._hits = PrefixHitFinder(self.managers, self.alignment_tokens)
        #: request id -> its one RequestState (tables, thresholds), for requests that hold blocks
        self._live: dict[str, RequestState] = {}
        #: the per-group new blocks of every allocate since the last new_step / take_step_plan
        self._new_results: list[tuple[list[KVCacheBlock], ...]] = []
        #: a Mamba group may have copies / zeros to drain (set with its new blocks)
        self._copies_pending = self._zeros_pending = False
        #: every Mamba manager keeps MambaManager's own ``take_copy_plan``: drain their lists here
        self._own_copy_drains = all(keeps_calls(type(m), MambaManager, ("take_copy_plan",)) for m in self.mamba_managers)
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_steps = 0
        #: the rules ``next_chunk_end`` follows (mambakv.placement)
        self.checkpoint_placement = resolve_placement(checkpoint_placement, kv_cache_config.layout)
        #: prefill chunks end on multiples of this (the hit alignment) when a Mamba group caches
        #: states in align mode, else 0 (no rule applies: a chunk is what the budget allows)
        self.chunk_alignment = self.alignment_tokens if enable_caching and any(
            m.mode is MambaCacheMode.ALIGN for m in self.mamba_managers) else 0
        self.checkpoint_placement.check_alignment(self.chunk_alignment)

    # ------------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                 new_computed_blocks: KVCacheBlocks | None = None,
                 num_lookahead_tokens: int = 0, num_draft_tokens: int | None = None,
                 now: float | None = None, num_processed_tokens: int | None = None) -> KVCacheBlocks | None:
        """Make every group's table cover ``computed + num_new_tokens`` tokens.

        ``computed = request.num_computed_tokens + num_new_computed_tokens``; the step's main
        tokens are ``computed + num_new_tokens``. `num_draft_tokens` (keyword): how many of the
        new tokens are unverified drafts (never hashed; each Mamba group expects
        ``accept_drafts`` after the verify). None derives it as ``computed + num_new_tokens -
        request.num_tokens``, which is right only under synchronous scheduling: with async
        scheduling the next step's placeholders would count as drafts (and ``retire`` then
        raises InvalidDraftCountError). `num_lookahead_tokens` reserves attention slots for
        the drafter's next proposals (never Mamba blocks); it is capped at ``max_model_len``.
        `now` (keyword, seconds on any monotonic clock of the engine's): the time of the step,
        which the decoupled layout's eviction ages units by (None: the latest ``now`` given); it
        is set once every check passed, even when the pool is short. `num_processed_tokens`
        (keyword): the running request's settled tokens, to retire in the same call: the same
        as ``retire(request.request_id, n)`` just before, once this call's own checks passed
        (the retire stands when the pool is short or a group refuses the step); None: no retire.

        Returns the newly allocated blocks per group (a shared empty result when no group got a
        block: its lists raise ReadOnlyResultError on an addition; read a fresh result's lists,
        which ``take_step_plan`` reads too, and copy one before changing it), or None when the
        pool cannot supply them (hit blocks still in the free queue count too): then nothing
        changed. It never retires.

        Raises (nothing changed):
            InvalidTokenCountError: ``num_new_tokens <= 0``, a negative count, more than
                ``max_model_len`` tokens, or ``num_draft_tokens`` not below ``num_new_tokens``.
            InvalidClockError: `now` is not a finite number.
            InvalidDraftCountError: more drafts than a Mamba group's scratch blocks (raised by
                that group).
            StaleCacheHitError: a hit block was evicted and reused since ``get_computed_blocks``.
            HashBlockSizeMismatchError: the request hashes with another block size.
            InvalidTokenCountError: a Mamba group would rewrite a published running state (the
                engine set ``num_computed_tokens`` below a retired count).
            InvalidDraftCountError / InvalidTokenCountError from the retire of
                `num_processed_tokens` (see ``retire``). The retire runs once the count, draft
                and clock checks passed; a refusal after it (a stale hit, a published state
                to rewrite) leaves the retire done, as ``retire`` then ``allocate`` would.
        """
        if not (type(num_new_tokens) is int and num_new_tokens > 0  # plain ints skip the slow path
                and type(num_new_computed_tokens) is int and num_new_computed_tokens >= 0
                and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0):
            num_new_tokens = as_count(num_new_tokens, "num_new_tokens", 1)
            num_new_computed_tokens = as_count(num_new_computed_tokens, "num_new_computed_tokens")
            num_lookahead_tokens = as_count(num_lookahead_tokens, "num_lookahead_tokens")
        try:
            rid = request.request_id
        except AttributeError:
            raise InvalidRequestError(f"allocate needs a Request, got {type(request).__name__}") from None
        if now is not None and not (type(now) is float and now - now == 0.0):  # finite floats pass
            now = as_seconds(now)
        live = self._live.get(rid)
        if (live is None or live.request is not request or num_new_computed_tokens
                or request.num_computed_tokens > live.num_scheduled):  # all but a running request's step
            check_computed(request, live, num_new_computed_tokens, new_computed_blocks)
            if live is None and self._loads:
                self._check_load_ready(rid)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        if num_tokens > self.max_model_len:
            raise InvalidTokenCountError(f"request {rid!r} would reach {num_tokens} tokens > max_model_len {self.max_model_len}")
        if num_draft_tokens is None:  # the synchronous derivation
            num_drafts = max(num_tokens - request.num_tokens, 0)
        elif type(num_draft_tokens) is int and 0 <= num_draft_tokens < num_new_tokens:  # the hot path: no call
            num_drafts = num_draft_tokens
        else:
            num_drafts = checked_draft_count(num_draft_tokens, num_new_tokens)  # raises
        if num_tokens + num_lookahead_tokens > self.max_model_len:  # lookahead is capped, never refused
            num_lookahead_tokens = self.max_model_len - num_tokens
        if num_drafts > self._max_drafts and new_computed_blocks is None:  # (with hits: after their check)
            for m in self.mamba_managers:  # the group whose rule it breaks raises
                m.check_step(num_tokens, num_drafts)
        if num_processed_tokens is not None:  # retire(rid, n) first, inline for a plain count
            n = num_processed_tokens
            if live is not None and type(n) is int and 0 < n <= live.num_scheduled and n <= request.num_tokens:
                if n >= live.retire_quiet and (self.arena is not None or not self._retire_chunk(live, n)):
                    self._retire_live(live, n)
            else:
                self.retire(rid, n)  # 0 or a new request: nothing to do; else it raises (nothing changed)
        # The quiet step: no group needs a block, publishes or records anything.
        if (live is not None and num_drafts == 0 and num_tokens <= live.quiet_tokens
                and num_tokens + num_lookahead_tokens <= live.num_covered):
            if now is not None:  # every check passed: the clock moves
                self.now = now
            if num_tokens > live.num_scheduled:
                live.num_scheduled = num_tokens
            return self._empty_blocks
        # A running prefill chunk (no hits, no drafts): the fused path, unless a policy declines.
        if (live is not None and not num_drafts and new_computed_blocks is None and self.arena is None
                and num_computed < request.num_prompt_tokens and not (self._loads and rid in self._loads)):
            out = self._allocate_chunk(request, live, num_tokens, num_lookahead_tokens)
            if out is not NOT_A_CHUNK:
                if now is not None:  # (the unified layout's chunk never reads the clock)
                    self.now = now
                return out
        return self._allocate_slow(request, live, num_new_computed_tokens, new_computed_blocks, num_computed,
                                   num_tokens, num_lookahead_tokens, num_drafts, now)
