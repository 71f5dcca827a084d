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

Every call flows one way: **checks -> count -> commit -> publish -> plan**::

    allocate(request, n, num_draft_tokens=d)            retire(request_id, processed)
      type, count and draft checks                        count checks
      [num_processed_tokens=p: retire(p) here]            quiet?  -> return (O(1))
      quiet step?  -> shared empty result (O(1))          every policy whose next event came:
      stale-hit check, Mamba rewrite checks                 dead_slots (raises first)
      count (every active policy) -> None if short          publish: full attention blocks,
      pin hits, allocate (every active policy)                       settled Mamba states
      publish attention blocks of real tokens               retire: slots below the skip line
      recount: thresholds and next events                   settle; recount

The checks raise a typed error before anything changes. The count is an upper bound of the free
blocks the commit takes (hit blocks still in the free queue included): ``allocate`` returns None
before the commit when the pool is short. A running request's step that needs no block,
publishes nothing and records nothing is O(1) (``RequestState.quiet_tokens``); so is a
``retire`` below its next event (``retire_quiet``). A policy with nothing to do in a step (a
decode step that crosses an attention page is no event for a Mamba group in decode) is skipped.

The coordinator keeps one :class:`RequestState` per live request: the engine's Request (its
hashes publish Mamba states at ``retire``), one table per policy (the very objects the managers
keep, so no lookup is repeated) and these thresholds::

    num_scheduled   the most tokens any allocate covered       retire may not pass it
    num_covered     tokens every table covers (lookahead too)  allocate below it takes no block
    quiet_tokens    a step without drafts up to here changes   allocate: no per-group call
                    nothing but counts (0 until counted)
    retire_quiet    below this processed count no group        retire: no per-group call
                    publishes, retires or raises (0 until counted)
    events          per policy, its own next event (the        retire: a policy below its
                    minimum is retire_quiet)                   own is skipped

Layouts: ``unified`` (one :class:`~mambakv.core.block_pool.BlockPool`, vLLM's) or ``decoupled``
(a :class:`~mambakv.core.arena.SuperblockArena`: pages for attention groups, state slots for Mamba
groups, one byte budget, eviction by units)::

    layout      block_pool            state_block_pool      arena
    unified     the one BlockPool     block_pool itself     None
    decoupled   arena.pages (pages)   arena.slots (states)  SuperblockArena

A host tier (``host_tier=``) is an object the coordinator holds (:class:`~mambakv.host_link.HostLink`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import compress
from typing import NoReturn

from mambakv.core.arena import SuperblockArena
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.engine_request import EngineRequest
from mambakv.core.errors import (
    HashBlockSizeMismatchError,
    InvalidBlockError,
    InvalidDraftCountError,
    InvalidFenceError,
    InvalidRequestError,
    InvalidSpecError,
    InvalidTokenCountError,
    LoadPendingError,
    MambaKVError,
    StaleCacheHitError,
    as_count,
    as_seconds,
)
from mambakv.core.events import KVCacheEvent
from mambakv.core.eviction import EvictionPolicy, make_eviction_policy
from mambakv.core.host_tier import HostTier, HostTierSpec, HostWrite
from mambakv.core.modes import MambaCacheMode
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheConfig, KVCacheSpec, MambaSpec
from mambakv.core.transfers import EMPTY_TRANSFER_PLAN, TransferPlan
from mambakv.core.unit_types import Unit
from mambakv.core.units import UnitIndex
from mambakv.groups import (
    BlockTable,
    GroupKind,
    MambaManager,
    SingleTypeKVCacheManager,
    group_block_hashes,
    make_manager,
    share_identical_policies,
)
from mambakv.hits import PrefixCacheStats, PrefixHitFinder
from mambakv.host_link import HostLink, build_host_tier
from mambakv.placement import DEFAULT_PLACEMENT, CheckpointPlacement, resolve_placement
from mambakv.plans import (
    EMPTY_STEP_PLAN,
    GroupPlan,
    KVCacheBlocks,
    RequestView,
    StatePlan,
    StepPlan,
    TableView,
    TieredHit,
)

__all__ = ["DEFAULT_PLACEMENT", "KVCacheCoordinator", "RequestState"]


class RequestState:
    """A request that holds blocks (see the module docstring for the thresholds)."""

    __slots__ = ("request", "tables", "num_scheduled", "num_covered", "quiet_tokens", "retire_quiet", "events",
                 "thresholds", "quiet_max", "arrival", "parent")

    def __init__(self, request: EngineRequest, tables: tuple[BlockTable, ...], num_scheduled: int) -> None:
        self.request = request
        self.tables = tables
        self.num_scheduled = num_scheduled
        self.num_covered = 0
        self.quiet_tokens = 0
        self.retire_quiet = 0
        self.events = [0] * len(tables)
        #: per policy, its own ``(covered, quiet)`` (the two thresholds above are their minima)
        self.thresholds: list[tuple[int, int]] = [(0, 0)] * len(tables)
        #: the largest ``min(covered, quiet)`` of any policy: a step beyond it leaves none quiet
        self.quiet_max = 0
        #: seconds (the engine's clock) at admission, and the unit of the prompt it continues
        #: (decoupled layout's eviction units; None elsewhere)
        self.arrival = 0.0
        self.parent: Unit | None = None

    def recount(self, policies: Sequence[SingleTypeKVCacheManager], active: list[bool] | None = None) -> None:
        """Recompute the thresholds and every policy's next event from the tables (after a
        step that changed them); with `active`, only those policies' thresholds (the others'
        tables did not change)."""
        per, events = self.thresholds, self.events
        covered = quiet = retire = 1 << 62
        most = 0
        for i, (m, t) in enumerate(zip(policies, self.tables)):
            if active is None or active[i]:
                c, q = per[i] = m.thresholds(t)
            else:
                c, q = per[i]
            e = events[i] = m.next_event(t)
            if c < covered:
                covered = c
            if q < quiet:
                quiet = q
            if q > most and c > most:
                most = c if c < q else q
            if e < retire:
                retire = e
        self.num_covered, self.quiet_tokens, self.quiet_max, self.retire_quiet = covered, quiet, most, retire

    def active_policies(self, num_tokens: int, num_lookahead_tokens: int) -> list[bool] | None:
        """For a running step without hits or drafts: per policy, whether it has anything to
        do (False: the step is within its own quiet and covered thresholds, so it would only
        count); None when every policy has."""
        end = num_tokens + num_lookahead_tokens
        if end > self.quiet_max:
            return None
        active = []
        for c, q in self.thresholds:  # a loop, not a comprehension: once per running step
            active.append(num_tokens > q or end > c)
        return None if all(active) else active


def _checked_draft_count(num_draft_tokens: object, num_new_tokens: int) -> int:
    """``allocate``'s explicit `num_draft_tokens`: an int in ``0 .. num_new_tokens - 1``.

    Raises:
        InvalidTokenCountError: anything else (a step has a real token).
    """
    n = as_count(num_draft_tokens, "num_draft_tokens")
    if not 0 <= n < num_new_tokens:
        raise InvalidTokenCountError(
            f"num_draft_tokens must be in 0..{num_new_tokens - 1} (a step has a real token), got {num_draft_tokens!r}")
    return n


def _is_request(obj: object) -> bool:
    """A mambakv Request (checked first: the common case costs one isinstance) or an engine's
    own request with the EngineRequest members (mambakv.core.engine_request)."""
    return isinstance(obj, Request) or isinstance(obj, EngineRequest)


def _check_computed(request: EngineRequest, live: RequestState | None, num_new_computed_tokens: int,
                    new_computed_blocks: KVCacheBlocks | None) -> None:
    """Computed tokens must be backed by blocks: a request that holds none starts from 0
    (after a preemption the engine resets ``num_computed_tokens``) plus exactly its hit; a
    running one cannot have computed more than was ever scheduled, and takes no hits.
    Otherwise blocks that were never computed would be published to the prefix cache.

    Raises:
        InvalidTokenCountError: computed tokens without blocks or hits to back them.
        InvalidRequestError: neither a Request nor an EngineRequest; another live request has the same id.
        InvalidBlockError: `new_computed_blocks` is not a KVCacheBlocks.
    """
    if not _is_request(request):
        raise InvalidRequestError(f"allocate needs a Request or an EngineRequest, got {type(request).__name__}")
    if new_computed_blocks is not None and not isinstance(new_computed_blocks, KVCacheBlocks):
        raise InvalidBlockError(f"new_computed_blocks must be the KVCacheBlocks of get_computed_blocks, got "
                                f"{type(new_computed_blocks).__name__}")
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


def _build_pools(config: KVCacheConfig, enable_caching: bool,
                 enable_kv_cache_events: bool) -> tuple[SuperblockArena | None, BlockPool, BlockPool]:
    """``(arena, block_pool, state_block_pool)`` of `config` (see the module docstring's table)."""
    if config.superblocks is None:
        pool = BlockPool(config.num_blocks, enable_caching, enable_kv_cache_events)
        return None, pool, pool
    arena = SuperblockArena(config.superblocks, enable_caching=enable_caching,
                            enable_kv_cache_events=enable_kv_cache_events)
    return arena, arena.pages, arena.slots


def _build_units(arena: SuperblockArena | None, managers: Sequence[SingleTypeKVCacheManager],
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


def _refuse_id(request_id: object) -> None:
    """Raise InvalidRequestError for a request id that is not a str (call on a lookup's miss)."""
    if type(request_id) is not str:
        raise InvalidRequestError(f"request ids are strs, got {type(request_id).__name__} {request_id!r}")


class KVCacheCoordinator:
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
            units (``get_computed_blocks_tiered``); None: none.

    Raises:
        HashBlockSizeMismatchError: `hash_block_size` is not a positive int or does not divide a
            group's block size (or, when None, the smallest block size does not divide the others).
        InvalidTokenCountError: `max_model_len` is not a positive int.
        InvalidSpecError: `kv_cache_config` is not a KVCacheConfig, a group's spec has no manager,
            `max_num_seqs` is not a positive int, or the host tier / eviction cannot be built.
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
        self.arena, self.block_pool, self.state_block_pool = _build_pools(kv_cache_config, enable_caching,
                                                                          enable_kv_cache_events)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(g.kv_cache_spec, self.pool_of(g.kv_cache_spec), enable_caching=enable_caching,
                         kv_cache_group_id=i, spare_may_evict=lazy_spare_may_evict)
            for i, g in enumerate(groups)
        )
        self.mamba_managers = tuple(m for m in self.managers if isinstance(m, MambaManager))
        #: decoupled: the eviction units and their policy (mambakv.core.units), else None
        self.units = _build_units(self.arena, self.managers, eviction, enable_caching)
        #: the managers whose tables make a unit's chain (the full-attention groups); () without units
        self._unit_tables = tuple(m for m in self.managers
                                  if self.units is not None and m.kv_cache_group_id in self.units.page_gids)
        self.prefix_cache_stats = PrefixCacheStats()
        #: the host-memory tier (``host_tier``), else None; its side of this coordinator
        self.host: HostTier | None = build_host_tier(host_tier, kv_cache_config, self.managers, self.block_pool,
                                                     self.state_block_pool, self.units, enable_caching, use_eagle)
        self._host = None if self.host is None else HostLink(
            self.host, block_pool=self.block_pool, state_block_pool=self.state_block_pool, arena=self.arena,
            units=self.units, stats=self.prefix_cache_stats)
        if self.host is not None and self.host.write is HostWrite.EVICT and self.units is not None:
            self.units.before_evict = self._store_evicted
        #: seconds: the engine's clock, the latest ``now`` given to allocate / free (ages of units)
        self.now = 0.0
        #: the managers that run a policy (groups with one Mamba spec share the first one's)
        self.policies: tuple[SingleTypeKVCacheManager, ...] = share_identical_policies(self.managers)
        self._columns = tuple(m.column_ids for m in self.policies)
        #: the policies' columns in policy order, and where each group's column sits among them
        flat = [g for cols in self._columns for g in cols]
        self._column_of_group = tuple(flat.index(g) for g in range(len(self.managers)))
        #: per policy, its columns' (empty) hit lists when a step has no hits
        self._policy_no_hits = tuple(((),) * len(cols) for cols in self._columns)
        self._mamba_policies = tuple(m for m in self.policies if isinstance(m, MambaManager))
        #: where the Mamba policies sit among the policies (a request state's tables follow them)
        self._mamba_policy_index = tuple(i for i, m in enumerate(self.policies) if isinstance(m, MambaManager))
        self._attention = tuple(m for m in self.policies if m.publishes_at_allocation)
        #: most draft tokens one step may verify without a group refusing it (each Mamba group
        #: checks its own rule above this); no limit without Mamba groups
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
        #: a Mamba group may have copies / zeros to drain (set with its new blocks), checkpoint
        #: writes (set by every step that reached a Mamba policy)
        self._copies_pending = self._zeros_pending = self._writes_pending = False
        #: post-verify copies of ``retire(..., num_accepted_drafts=)`` not yet taken
        self._verify_copies: dict[int, list[tuple[int, int]]] = {}
        self.num_steps = 0
        #: the rules ``next_chunk_end`` follows (mambakv.placement)
        self.checkpoint_placement = resolve_placement(checkpoint_placement, kv_cache_config.layout)
        #: prefill chunks end on multiples of this (the hit alignment) when a Mamba group caches
        #: states in align mode, else 0 (no rule applies: a chunk is what the budget allows)
        self.chunk_alignment = self.alignment_tokens if enable_caching and any(
            m.mode is MambaCacheMode.ALIGN for m in self.mamba_managers) else 0
        self.checkpoint_placement.check_alignment(self.chunk_alignment)

    # ------------------------------------------------------------------ allocation
    def allocate(self, request: EngineRequest, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
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
            LoadPendingError: its host-tier load is in flight.
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
            raise InvalidRequestError(f"allocate needs a Request or an EngineRequest, got {type(request).__name__}") from None
        if now is not None and not (type(now) is float and now - now == 0.0 and now >= 0.0):  # the hot path: no call
            now = as_seconds(now)
        live = self._live.get(rid)
        num_computed = -1 if live is None or live.request is not request else request.num_computed_tokens
        if (live is None or num_computed < 0 or num_new_computed_tokens
                or num_computed > live.num_scheduled):  # all but a running request's step
            _check_computed(request, live, num_new_computed_tokens, new_computed_blocks)
            if live is None and self._host is not None:
                self._host.check_ready(rid)
            num_computed = request.num_computed_tokens
        num_computed += num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        if num_tokens > self.max_model_len:
            raise InvalidTokenCountError(f"request {rid!r} would reach {num_tokens} tokens > max_model_len {self.max_model_len}")
        if num_draft_tokens is None:  # the synchronous derivation
            num_drafts = max(num_tokens - request.num_tokens, 0)
        elif type(num_draft_tokens) is int and 0 <= num_draft_tokens < num_new_tokens:  # the hot path: no call
            num_drafts = num_draft_tokens
        else:
            num_drafts = _checked_draft_count(num_draft_tokens, num_new_tokens)  # raises
        if num_tokens + num_lookahead_tokens > self.max_model_len:  # lookahead is capped, never refused
            num_lookahead_tokens = self.max_model_len - num_tokens
        if num_drafts > self._max_drafts and new_computed_blocks is None:  # (with hits: after their check)
            self._refuse_drafts(request, num_tokens, num_drafts, num_draft_tokens is None)
        if num_processed_tokens is not None:  # retire(rid, n) first, inline for a plain count
            n = num_processed_tokens
            if live is not None and type(n) is int and 0 < n <= live.num_scheduled and n <= request.num_tokens:
                if n >= live.retire_quiet:
                    self._retire_live(live, n)
            else:
                self.retire(rid, n)  # 0 or a new request: nothing to do; else it raises (nothing changed)
        # The quiet step: no group needs a block, publishes or records anything.
        if (live is not None and num_drafts == 0 and num_tokens <= live.quiet_tokens
                and num_tokens + num_lookahead_tokens <= live.num_covered):
            if now is not None and now > self.now:  # every check passed: the clock moves (never back)
                self.now = now
            if num_tokens > live.num_scheduled:
                live.num_scheduled = num_tokens
            return self._empty_blocks
        return self._allocate_step(request, live, num_new_computed_tokens, new_computed_blocks, num_computed,
                                   num_tokens, num_lookahead_tokens, num_drafts, now, num_draft_tokens is None)

    def _refuse_drafts(self, request: EngineRequest, num_tokens: int, num_drafts: int, derived: bool) -> None:
        """Raise InvalidDraftCountError for more drafts than a Mamba group verifies; `derived`:
        they are the tokens past the request's (``num_draft_tokens=None``), and the error says so."""
        if derived:
            raise InvalidDraftCountError(
                f"request {request.request_id!r}: the step reaches {num_tokens} tokens, {num_drafts} beyond its "
                f"{request.num_tokens}; with num_draft_tokens=None those count as draft tokens and a Mamba group "
                f"verifies at most {self._max_drafts} (append the tokens first, or pass num_draft_tokens)")
        for m in self.mamba_managers:  # the group whose rule it breaks raises
            m.check_step(num_tokens, num_drafts)

    def _allocate_step(self, request: EngineRequest, live: RequestState | None, num_new_computed_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None, num_computed: int, num_tokens: int,
                       num_lookahead_tokens: int, num_drafts: int, now: float | None,
                       derived_drafts: bool) -> KVCacheBlocks | None:
        """``allocate`` once its own checks passed and the step is not quiet: the hit and
        rewrite checks, count, commit, publish, plan."""
        rid = request.request_id
        if live is None and request.hash_block_size != self.hash_block_size:  # (fixed once it was admitted)
            request.set_hash_block_size(self.hash_block_size)
        decode = num_computed >= request.num_prompt_tokens
        if new_computed_blocks is None:
            hits: Sequence[Sequence[KVCacheBlock]] = self._no_hits
        else:
            hits = self._checked_hits(request, new_computed_blocks, num_new_computed_tokens)
            if num_drafts > self._max_drafts:
                self._refuse_drafts(request, num_tokens, num_drafts, derived_drafts)
        if live is not None:  # a group refuses to rewrite a published running state before any group commits
            for mp in self._mamba_policies:
                mp.check_writable_step(rid, num_tokens, decode)
        if now is not None and now > self.now:  # every check passed: the clock moves (even when the pool is short)
            self.now = now
        units = self.units
        if units is not None:
            units.now = self.now
        policies, columns = self.policies, self._columns
        if hits is self._no_hits:
            policy_hits: Sequence[Sequence[Sequence[KVCacheBlock]]] = self._policy_no_hits
        else:
            policy_hits = [[hits[g] for g in cols] for cols in columns]
        # A running step without hits or drafts skips the policies it leaves quiet (one policy: it is not quiet).
        active = live.active_policies(num_tokens, num_lookahead_tokens) if (
            live is not None and hits is self._no_hits and not num_drafts and len(policies) > 1) else None
        if active is not None:
            policies = tuple(compress(policies, active))
            columns = tuple(compress(columns, active))
            policy_hits = tuple(compress(self._policy_no_hits, active))
        # count
        room: tuple[int, int] | None = None  # decoupled: (pages, slots) the step pops
        if live is None or num_tokens + num_lookahead_tokens > live.num_covered:
            if self.arena is None:
                need = 0
                for p, ph in zip(policies, policy_hits):
                    need += p.count_columns(rid, num_tokens, ph, num_computed, num_lookahead_tokens)
                if need > self.block_pool.free_block_queue.num_free_blocks:
                    return None
            else:
                pages, slots = self._count_pools(rid, num_tokens, policies, policy_hits, num_computed,
                                                 num_lookahead_tokens)
                if not self.arena.can_supply(pages, slots, None if hits is self._no_hits
                                             else [b for h in hits for b in h]):
                    return None
                room = pages, slots
        # commit
        new_request = live is None
        if live is None:
            live = self._live[rid] = RequestState(request, tuple(p.table(rid) for p in policies), num_tokens)
            self._count_admission(request, num_new_computed_tokens)
            if units is not None:
                live.arrival = self.now
                page = units.page_tokens
                live.parent = units.admit(group_block_hashes(request, page), request.num_prompt_tokens // page,
                                          num_computed // page, self.now)
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
        if self._host is not None and rid in self._host.loads:  # its hit is touched: a load's hold ends
            self._host.release(rid, self.now, admitted_tokens=num_computed)
        if room is not None:
            self.arena.make_room(*room)  # type: ignore[union-attr]
        new_blocks: list[list[KVCacheBlock]] = list(map(list, self._no_hits))  # a fresh list per group
        any_new = False
        if self.mamba_managers:  # a Mamba policy records the step's checkpoint writes
            self._writes_pending = True
        # a Mamba table's new suffix may hold relocated blocks (table_appends): its length before
        tables = live.tables
        mamba_lengths = None
        if not new_request:
            mamba_lengths = []
            for i in self._mamba_policy_index:  # (none in an attention-only model)
                mamba_lengths.append(len(tables[i].blocks))
        for p, cols in zip(policies, columns):
            per_column = p.allocate_columns(rid, num_tokens, num_lookahead_tokens, num_drafts, decode=decode,
                                            num_computed_tokens=num_computed)
            if per_column[0]:
                any_new = True
                for gid, blocks in zip(cols, per_column):
                    new_blocks[gid] = blocks
        # publish: attention KV is written before it is read; never blocks with drafts or placeholders
        if self.enable_caching:
            num_real = min(num_tokens - num_drafts, request.num_tokens)
            for a in self._attention:
                if active is None or a in policies:
                    a.cache_blocks(request, num_real)
        live.recount(self.policies, active)  # this step may have tagged a state: the next retire event moves
        if units is not None:
            units.settle()
        if not any_new:  # most decode steps need no block: one shared empty result (its lists refuse additions)
            return self._empty_blocks
        if self.mamba_managers:
            self._copies_pending = self._zeros_pending = True
        out = tuple(new_blocks)
        self._new_results.append(out)  # ids are read only if a plan is taken
        return KVCacheBlocks(out, self._table_appends(rid, tables, out, mamba_lengths))

    def _table_appends(self, rid: str, tables: tuple[BlockTable, ...], new_blocks: tuple[list[KVCacheBlock], ...],
                       mamba_lengths: list[int] | None) -> tuple[list[KVCacheBlock], ...]:
        """``KVCacheBlocks.table_appends`` of a step that took blocks: a new request's whole
        tables; for a running one the new blocks, except a Mamba table that grew, whose suffix
        beyond `mamba_lengths` (its length before the step) starts with its relocated scratch."""
        if mamba_lengths is None:
            return tuple([*m.req_to_blocks.get(rid, ())] for m in self.managers)
        appends = None
        for i, before in zip(self._mamba_policy_index, mamba_lengths):
            t = tables[i]
            if len(t.blocks) == before:
                continue
            if appends is None:
                appends = list(new_blocks)
            for gid, col in zip(self.policies[i].column_ids, t.columns):  # type: ignore[attr-defined]
                appends[gid] = col[before:]
        return new_blocks if appends is None else tuple(appends)

    def _checked_hits(self, request: EngineRequest, new_computed_blocks: KVCacheBlocks,
                      num_hit_tokens: int) -> Sequence[Sequence[KVCacheBlock]]:
        """The hit lists, after checking that they are this layout's blocks, cover exactly
        `num_hit_tokens` in every group, and that every hit block still carries the hash of
        its slot in its group (it was not evicted and reused since the lookup).

        Raises:
            StaleCacheHitError: a hit block was evicted and reused since the lookup.
            InvalidBlockError: a hit list's length does not match `num_hit_tokens` in some
                group, or a block belongs to another pool.
            MambaKVError: the hits have the wrong number of groups, or the request already
                holds blocks (hits are for new requests).
        """
        hits = new_computed_blocks.blocks
        if len(hits) != len(self.managers):
            raise MambaKVError(f"new_computed_blocks has {len(hits)} groups, the config {len(self.managers)}")
        if not num_hit_tokens and not any(hits):
            return self._no_hits
        rid = request.request_id
        for gid, (m, hit) in enumerate(zip(self.managers, hits)):
            pool_blocks = m.block_pool.blocks
            if len(hit) * m.block_size != num_hit_tokens:
                raise InvalidBlockError(
                    f"group {gid}: {len(hit)} hit blocks of {m.block_size} tokens do not cover the "
                    f"{num_hit_tokens} computed tokens (pass get_computed_blocks' blocks and length together)")
            if hit and m.req_to_blocks.get(rid):
                raise MambaKVError(f"request {rid!r} already holds blocks; hits are for new requests")
            keys = group_block_hashes(request, m.block_size) if hit else ()
            if m.block_pool.holds_cached(hit, keys, gid):
                continue  # the common case: every block valid (below: nulls allowed, or which one is wrong)
            for slot, block in enumerate(hit):
                if not 0 <= block.block_id < len(pool_blocks) or pool_blocks[block.block_id] is not block:
                    raise InvalidBlockError(f"hit block {block.block_id} is not a block of this pool")
                if block.is_null:
                    continue
                if slot >= len(keys) or block.block_hash != keys[slot] or block.cache_group_id != gid:
                    if block.block_hash is None:
                        why = "was evicted since get_computed_blocks (it holds no prefix now)"
                    else:
                        why = ("holds another prefix: another request's hit, or evicted and reused since "
                               "get_computed_blocks")
                    raise StaleCacheHitError(f"hit block {block.block_id} (group {gid}, slot {slot}) {why}; "
                                             f"look this request up again")
        return hits

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

    def _count_admission(self, request: EngineRequest, num_hit_tokens: int) -> None:
        """PrefixCacheStats: once per admission; a Request seen before is a resumed preemption."""
        if self.enable_caching:
            stats = self.prefix_cache_stats
            if request.num_admissions:
                stats.preempted_requests += 1
                stats.preempted_queries += request.num_tokens
                stats.preempted_hits += num_hit_tokens
            else:
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_hit_tokens
        request.num_admissions += 1

    def num_blocks_needed(self, request: EngineRequest, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                          new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0) -> int:
        """Free blocks ``allocate`` would consume for this step, hit blocks still in the free
        queue included (nano-vllm's ``can_allocate``), summed over every group: in the unified
        layout compare with ``block_pool.get_num_free_blocks()``; in the decoupled one it adds
        pages and state slots of two pools, so ask ``can_allocate`` instead. Read-only.

        Raises:
            InvalidTokenCountError: a negative or non-int count.
            InvalidRequestError: `request` is neither a Request nor an EngineRequest.
        """
        if not _is_request(request):
            raise InvalidRequestError(f"num_blocks_needed needs a Request or an EngineRequest, got "
                                      f"{type(request).__name__}")
        num_new_tokens = as_count(num_new_tokens, "num_new_tokens")
        num_computed = request.num_computed_tokens + as_count(num_new_computed_tokens, "num_new_computed_tokens")
        lookahead = as_count(num_lookahead_tokens, "num_lookahead_tokens")
        num_tokens = num_computed + num_new_tokens
        lookahead = max(0, min(lookahead, self.max_model_len - num_tokens))
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hits
        rid = request.request_id
        return sum(m.count_columns(rid, num_tokens, [hits[g] for g in cols], num_computed, lookahead)
                   for m, cols in zip(self.policies, self._columns))

    def can_allocate(self, request: EngineRequest, num_new_tokens: int, *, num_new_computed_tokens: int = 0,
                     new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                     whole_prompt: bool = False, watermark: float = 0.0) -> bool:
        """Whether ``allocate`` with these arguments would find room now (its own count; free hit
        blocks included), in either layout. Read-only; pins and checks nothing.

        Admission gates (vLLM's): `whole_prompt` asks for room for the request's whole prompt
        (``num_prompt_tokens``, or more when `num_new_tokens` reaches past it) instead of the
        step's tokens; `watermark` (a fraction in ``[0, 1)``) asks that this much of the cache
        stays free after the step: unified ``watermark x (num_blocks - 1)`` blocks, decoupled
        ``watermark`` of the arena's bytes in whole pages. Both are exact in either layout.

        Raises:
            InvalidTokenCountError: a negative or non-int count, or more than ``max_model_len``
                tokens (``allocate`` raises it too).
            InvalidRequestError: `request` is neither a Request nor an EngineRequest.
            InvalidSpecError: `watermark` outside ``[0, 1)``.
        """
        if not _is_request(request):
            raise InvalidRequestError(f"can_allocate needs a Request or an EngineRequest, got {type(request).__name__}")
        if not (isinstance(watermark, (int, float)) and not isinstance(watermark, bool) and 0 <= watermark < 1):
            raise InvalidSpecError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        num_computed = request.num_computed_tokens + as_count(num_new_computed_tokens, "num_new_computed_tokens")
        num_tokens = num_computed + as_count(num_new_tokens, "num_new_tokens")
        if whole_prompt and num_tokens < request.num_prompt_tokens:
            num_tokens = request.num_prompt_tokens
        if num_tokens > self.max_model_len:
            raise InvalidTokenCountError(f"request {request.request_id!r} would reach {num_tokens} tokens > "
                                         f"max_model_len {self.max_model_len}")
        lookahead = max(0, min(as_count(num_lookahead_tokens, "num_lookahead_tokens"), self.max_model_len - num_tokens))
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hits
        policy_hits = [[hits[g] for g in cols] for cols in self._columns]
        pages, slots = self._count_pools(request.request_id, num_tokens, self.policies, policy_hits, num_computed,
                                         lookahead)
        if self.arena is None:
            keep = math.ceil(watermark * (self.block_pool.num_blocks - 1))
            return pages + slots + keep <= self.block_pool.get_num_free_blocks()
        g = self.arena.geometry
        keep = math.ceil(watermark * g.total_bytes / g.page_bytes)  # the free bytes kept, in whole pages
        return self.arena.can_supply(pages + keep, slots, (b for h in hits for b in h))

    # ------------------------------------------------------------------ step results
    def retire(self, request_id: str, num_processed_tokens: int, *, num_accepted_drafts: int | None = None) -> None:
        """Outputs came back: `num_processed_tokens` (settled, never the optimistic scheduled
        count) of the request are processed. `num_accepted_drafts` (keyword): the verify of the
        request's oldest step with drafts came back with that many accepted, for an engine that
        makes no separate ``accept_drafts`` call: the same as ``accept_drafts(request_id, a)``
        then ``retire``, except that the post-verify copies are kept for
        ``take_verify_copies()`` instead of being returned (run them after the verified step's
        forward, before the next step's ``take_copy_plan`` copies). First publish what is now known (attention blocks
        full within the processed real tokens, Mamba states that settled), then retire what no
        group needs any more. Idempotent; a request holding no blocks is a no-op, and so is a
        count below an earlier one (a retired block cannot come back; vLLM lowers
        ``num_computed_tokens`` after rejected drafts). O(1) below the request's next event.

        Raises (nothing changed):
            InvalidTokenCountError: a negative count, or more than the request's tokens or than
                any ``allocate`` covered (tokens never scheduled cannot be processed).
            InvalidDraftCountError: the count passes a step with drafts whose ``accept_drafts``
                has not come.
            InvalidRequestError: `request_id` is not a str.
        """
        if type(num_processed_tokens) is not int or num_processed_tokens < 0:
            num_processed_tokens = as_count(num_processed_tokens, "num_processed_tokens")  # raises
        live = self._live.get(request_id)
        if live is not None and num_processed_tokens:  # the count is checked before a verify is accepted
            self._checked_processed(live, num_processed_tokens)
        if num_accepted_drafts is not None:
            self._accept_into_plan(request_id, num_accepted_drafts)
        if live is None or num_processed_tokens == 0:
            _refuse_id(request_id)
            return
        if num_processed_tokens >= live.retire_quiet:
            self._retire_live(live, num_processed_tokens)

    @staticmethod
    def _checked_processed(live: RequestState, num_processed_tokens: object) -> int:
        """A live request's processed-token count, checked as ``retire`` checks it.

        Raises:
            InvalidTokenCountError: not an int >= 0, or more than the request's tokens or than
                any ``allocate`` covered."""
        n = num_processed_tokens if type(num_processed_tokens) is int else as_count(
            num_processed_tokens, "num_processed_tokens")
        request = live.request
        if n < 0 or n > request.num_tokens or n > live.num_scheduled:  # (n < 0: a plain int, unchecked)
            raise InvalidTokenCountError(
                f"request {request.request_id!r}: {n} processed tokens, but at most "
                f"{min(request.num_tokens, live.num_scheduled)} can be (it has {request.num_tokens} tokens, "
                f"{live.num_scheduled} scheduled)")
        return n

    def _retire_live(self, live: RequestState, num_processed_tokens: int) -> None:
        """``retire`` once its count checks passed and the count reached the request's next
        event: the policies whose own next event came are checked, then publish, then retire
        (the others have nothing to do)."""
        request = live.request
        policies, tables, events = self.policies, live.tables, live.events
        due = []
        for i, e in enumerate(events):
            if e <= num_processed_tokens:
                due.append((policies[i], tables[i], policies[i].dead_slots(tables[i], num_processed_tokens)))  # raises first
        if self.enable_caching:  # publish, then retire: a state published and retired lands cached
            for m, _, _ in due:
                m.cache_blocks(request, num_processed_tokens)
        for m, t, num_dead in due:
            if num_dead > t.retired_below:
                m.retire_slots(t, num_dead)
            m.settle(t, num_processed_tokens)
        live.recount(policies)  # publishing or retiring moves the thresholds and the next events
        if self.units is not None:  # a decode checkpoint may have taken a cached block
            self.units.settle()

    def accept_drafts(self, request_id: str, num_accepted: int) -> dict[int, list[tuple[int, int]]]:
        """After a verify step: per Mamba group, the copies (accepted scratch -> running
        block) to run after the step's forward. See MambaManager.accept_drafts.

        Raises (nothing changed):
            InvalidDraftCountError: `num_accepted` outside the step's draft count.
            InvalidRequestError: `request_id` is not a str.
        """
        _refuse_id(request_id)
        num_accepted = as_count(num_accepted, "num_accepted", error=InvalidDraftCountError)
        out = {}
        for m in self._mamba_policies:
            for gid, pairs in zip(m.column_ids, m.accept_drafts_columns(request_id, num_accepted)):
                if pairs:
                    out[gid] = pairs
        live = self._live.get(request_id)
        if live is not None:  # the verify moved states: recount the thresholds and next events
            live.recount(self.policies)
        if self.units is not None:
            self.units.settle()
        return out

    def _accept_into_plan(self, request_id: str, num_accepted: int) -> None:
        """``accept_drafts`` whose copies are kept for ``take_verify_copies``."""
        for gid, pairs in self.accept_drafts(request_id, num_accepted).items():
            self._verify_copies.setdefault(gid, []).extend(pairs)

    def take_verify_copies(self) -> dict[int, list[tuple[int, int]]]:
        """Per Mamba group, the post-verify copies of the ``retire(..., num_accepted_drafts=)`` /
        ``update_from_output`` calls since the last call, in call order (each request's pairs as
        ``accept_drafts`` returns them; requests never share a block). Run them after the
        verified steps' forward and before the pre-forward copies of ``take_copy_plan``: a copy
        plan's source may be the running block they write (DESIGN.md 5.1, the order of copies)."""
        copies, self._verify_copies = self._verify_copies, {}
        return copies

    def update_from_output(self, outputs: Mapping[str, tuple[int, int | None]]) -> None:
        """Settle a whole step's outputs in one call: for each request id, ``(processed tokens,
        accepted drafts or None)`` as ``retire(request_id, n, num_accepted_drafts=a)`` (requests
        in the mapping's order). For an engine without per-request bookkeeping.

        Raises (nothing changed; every entry is checked before any is settled):
            InvalidRequestError: `outputs` is not a mapping, an id is not a str, or a value is
                not a pair.
            InvalidTokenCountError: a processed count ``retire`` refuses (not an int >= 0, or
                more than a live request's tokens or than any ``allocate`` covered).
            InvalidDraftCountError: an accepted count not None nor an int >= 0.
        Raises (the earlier requests stay settled): InvalidDraftCountError from a request's
            verify (more accepted than its drafts, or a count past a verify not accepted).
        """
        if not isinstance(outputs, Mapping):
            raise InvalidRequestError(f"update_from_output takes a mapping of request id -> (processed tokens, "
                                      f"accepted drafts or None), got {type(outputs).__name__}")
        settled: list[tuple[str, int, int | None]] = []
        for rid, value in outputs.items():
            _refuse_id(rid)
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise InvalidRequestError(f"update_from_output: request {rid!r} needs (processed tokens, accepted "
                                          f"drafts or None), got {value!r}")
            num_processed, num_accepted = value
            n = as_count(num_processed, "num_processed_tokens")
            live = self._live.get(rid)
            if live is not None and n:
                self._checked_processed(live, n)
            if num_accepted is not None:
                num_accepted = as_count(num_accepted, "num_accepted_drafts", error=InvalidDraftCountError)
            settled.append((rid, n, num_accepted))
        for rid, n, num_accepted in settled:
            self.retire(rid, n, num_accepted_drafts=num_accepted)

    def set_now(self, now: float) -> None:
        """Set the engine's clock (seconds on a monotonic clock; ``allocate``, ``free`` and
        ``get_computed_blocks_tiered`` take it as ``now=``). The clock never runs backwards: an
        earlier reading than the latest leaves it where it is (a documented no-op: a wall clock
        stepped back by NTP must not make units younger).

        Raises:
            InvalidClockError: not a finite number >= 0 (nothing changed).
        """
        now = as_seconds(now)
        if now > self.now:
            self.now = now
            if self.units is not None:
                self.units.now = now

    def free(self, request_id: str, *, now: float | None = None, num_processed_tokens: int | None = None) -> None:
        """A request finished or is preempted: free every group's table and drop its one
        RequestState. Unknown ids are a no-op. In the decoupled layout its chain joins the
        eviction units (:mod:`mambakv.core.units`) with its ``retain`` hint, at `now` (seconds;
        None: the latest given). With a host tier: a load in flight is aborted, a held one
        released; write-through stores the request's checkpoints the host lacks.

        `num_processed_tokens` (keyword): the request's settled tokens, for an engine whose
        last step's outputs were not retired yet: what they complete is published first (as
        ``retire`` publishes), then the tables are freed whole, nothing retired apart. So the
        free queue receives the request's blocks in one order, every group's table deepest
        block first, groups in config order (vLLM's order)::

            attention [14 171 172 176]  Mamba [0 0 173 177]   173: the state at 48, published
            free(rid, num_processed_tokens=48)   queue tail gets 176 172 171 14 177 173
            retire(rid, 48) then free(rid)       queue tail gets 173 176 172 171 14 177

        The second order puts the request's deepest state ahead of its attention blocks: it is
        evicted first, and a later hit on the prefix loses that depth while its attention blocks
        are still cached (tests/integrations: the hybrid runs under pressure).

        Raises (nothing changed):
            DoubleFreeError: a block of its tables is already free (an earlier misuse); every
                group is checked before any is freed.
            InvalidClockError: `now` is not a finite number.
            InvalidRequestError: `request_id` is not a str.
            InvalidTokenCountError / InvalidDraftCountError: `num_processed_tokens` as
                ``retire`` refuses it.
        """
        if now is not None:
            now = as_seconds(now)
        if num_processed_tokens is not None and (type(num_processed_tokens) is not int or num_processed_tokens < 0):
            num_processed_tokens = as_count(num_processed_tokens, "num_processed_tokens")  # any id, as retire: raises
        host = self._host
        if host is not None and request_id in host.loads:  # a load in flight or its hold (never live)
            if now is not None:
                self.set_now(now)
            host.release(request_id, self.now)
            return
        if request_id not in self._live and not any(request_id in m.req_to_blocks for m in self.managers):
            _refuse_id(request_id)
            self.checkpoint_placement.forget(request_id)
            return
        live = self._live.get(request_id)
        publish = 0
        if num_processed_tokens is not None and live is not None:
            publish = self._checked_processed(live, num_processed_tokens)
            for m, t in zip(self.policies, live.tables):
                m.dead_slots(t, publish)  # raises what a retire to that count would (a verify not accepted)
        for m in self.policies:
            m.check_free(request_id)
        if now is not None:  # every check passed: the clock moves
            self.set_now(now)
        if publish and self.enable_caching and live is not None:
            for m in self.policies:
                m.cache_blocks(live.request, publish)
        units = self.units
        tables = [list(m.req_to_blocks.get(request_id, ())) for m in self._unit_tables] if units is not None else None
        if self._verify_copies:  # a freed request's post-verify copies must not write its reused blocks
            freed = {b.block_id for m in self.mamba_managers for b in m.req_to_blocks.get(request_id, ())}
            for gid, pairs in self._verify_copies.items():
                self._verify_copies[gid] = [p for p in pairs if p[1] not in freed]
        for m in self.policies:
            m.free(request_id)
        live = self._live.pop(request_id, None)
        self.checkpoint_placement.forget(request_id)
        if units is not None and live is not None and tables is not None:
            request = live.request
            units.register(group_block_hashes(request, units.page_tokens), tables, retain=request.retain,
                           arrival=live.arrival, prompt_tokens=request.num_prompt_tokens, parent=live.parent,
                           now=self.now)
            units.settle()
        if host is not None and live is not None and host.host.write is HostWrite.THROUGH:
            host.store_freed(live.request, self.now)

    def preempt_all(self) -> list[str]:
        """Free every request (the engine re-queues them to recompute) and return their ids,
        so that ``reset_prefix_cache`` can succeed with requests running. Each preempted
        request's ``num_computed_tokens`` is set to 0 (it recomputes from scratch), and every
        piece of its bookkeeping, pending state copies included, is dropped: resumed, it
        looks up its prefix and builds a fresh table like a new request. A host-tier load (in
        flight, or complete and not yet allocated) is aborted and its request id returned too."""
        requests = [live.request for live in self._live.values()]
        for request in requests:
            self.free(request.request_id)
            request.num_computed_tokens = 0
        loading = list(self._host.loads) if self._host is not None else []
        for rid in loading:
            self._host.release(rid, self.now)  # type: ignore[union-attr]
        return [r.request_id for r in requests] + loading

    # ------------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: EngineRequest, *, max_length: int | None = None) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of `request` cached in every group, capped at
        ``num_tokens - 1`` (the last token is recomputed for its logits) and at `max_length`
        tokens when given (an engine's own cap, e.g. a prompt-cache limit).

        Each group may only shorten the candidate length; groups are re-queried until none
        shortens it (fixed point), lengths aligned to the LCM of the block sizes. With
        ``use_eagle``, the fixed point is then recomputed once from the next aligned length
        below it. The blocks are not pinned until ``allocate``.

        Returns ``(blocks per group, hit tokens)``; a miss returns the shared empty result
        (``KVCacheBlocks.shared_empty``: its lists raise ReadOnlyResultError on an addition).

        Raises:
            InvalidRequestError: `request` is neither a Request nor an EngineRequest.
            HashBlockSizeMismatchError: the request hashes with another block size.
            InvalidTokenCountError: `max_length` is not None nor an int >= 0.
        """
        if not _is_request(request):
            raise InvalidRequestError(f"get_computed_blocks needs a Request or an EngineRequest, got {type(request).__name__}")
        if max_length is not None:
            max_length = as_count(max_length, "max_length")
        request.set_hash_block_size(self.hash_block_size)
        if not self.enable_caching:
            return self._empty_blocks, 0
        hits, length = self._hits.find(request, use_eagle=self.use_eagle, max_length=max_length)
        if not length:
            return self._empty_blocks, 0
        found = tuple(hits)
        return KVCacheBlocks(found, found), length

    def get_shared_prefix_length(self, request: EngineRequest) -> int:
        """Tokens: the longest prefix of `request` (aligned like a hit, at most
        ``num_tokens - 1``) that the attention-type groups cache, Mamba groups ignored.

        Beyond the hit of ``get_computed_blocks`` it marks a prefix shared with an earlier
        request whose Mamba state was never published there (states exist only at chunk
        ends). A scheduler that ends a prefill chunk exactly here publishes that state, so
        the next request sharing the prefix hits it (a Marconi-style junction; vLLM 0.33
        stops chunks at the same place). 0 without caching or attention groups. Read-only:
        pins nothing and counts no statistics.

        Raises:
            InvalidRequestError: `request` is neither a Request nor an EngineRequest.
        """
        if not _is_request(request):
            raise InvalidRequestError(f"get_shared_prefix_length needs a Request or an EngineRequest, got {type(request).__name__}")
        request.set_hash_block_size(self.hash_block_size)
        return self._hits.shared_prefix_length(request) if self.enable_caching else 0

    def next_chunk_end(self, request: EngineRequest, budget: int, *, num_computed_tokens: int | None = None) -> int:
        """Where the request's next prefill chunk should end (tokens, absolute): the smallest
        position the checkpoint placement proposes in ``(computed, min(computed + budget, N)]``,
        else that limit (:mod:`mambakv.placement`). The engine schedules ``end - computed``
        tokens. Call it for every prefill chunk, the first one at admission with
        `num_computed_tokens` = the hit length (default ``request.num_computed_tokens``).
        Read-only on the pool (the junction rule looks up the shared prefix at admission).

        Raises:
            InvalidTokenCountError: a negative or non-int count, or more computed tokens than the request has.
            InvalidRequestError: `request` is neither a Request nor an EngineRequest.
        """
        if not _is_request(request):
            raise InvalidRequestError(f"next_chunk_end needs a Request or an EngineRequest, got {type(request).__name__}")
        budget = as_count(budget, "budget")
        computed = request.num_computed_tokens if num_computed_tokens is None else as_count(
            num_computed_tokens, "num_computed_tokens")
        if computed > request.num_tokens:
            raise InvalidTokenCountError(f"request {request.request_id!r}: {computed} computed tokens > its "
                                         f"{request.num_tokens} tokens")
        return self.checkpoint_placement.chunk_end(self, request, computed, budget, self.chunk_alignment)

    # ------------------------------------------------------------------ host tier
    def get_computed_blocks_tiered(self, request: EngineRequest, *, now: float | None = None) -> TieredHit:
        """The longest prefix hit over the GPU and the host tier; starts the load of its host part.

        The GPU part is ``get_computed_blocks(request)``. When the host tier holds a deeper hit
        (whole units: every page up to it in one tier or the other, a state in every Mamba group
        at it), this call allocates GPU blocks for the pages missing on the GPU and the state,
        holds them and the GPU pages of the hit, pins the host copies, and returns the
        :class:`~mambakv.core.transfers.LoadPlan` (also in the next ``take_transfer_plan()``).
        Without a host tier, a deeper host hit, or GPU room for it, it changes nothing and
        returns the GPU part only (``num_host_tokens == 0``). See :mod:`mambakv.host_link`.

        Raises (nothing changed):
            InvalidRequestError: `request` is neither a Request nor an EngineRequest, or it holds blocks already.
            LoadPendingError: its load is in flight (wait for ``complete_load``).
            InvalidClockError: `now` is not a finite number.
        """
        if not _is_request(request):
            raise InvalidRequestError(f"get_computed_blocks_tiered needs a Request or an EngineRequest, got {type(request).__name__}")
        rid = request.request_id
        if self._host is not None:
            self._host.check_ready(rid)
        if rid in self._live:
            raise InvalidRequestError(f"request {rid!r} holds blocks: look up hits before its first allocate")
        if now is not None:
            self.set_now(now)
        blocks, n = self.get_computed_blocks(request)
        if self._host is None:
            return TieredHit(blocks, n, 0, None)
        return self._host.tiered_hit(request, blocks, n, self.now)

    def complete_load(self, request_id: str) -> None:
        """The engine finished the load's copies: publish its destination blocks under their
        hashes (the next ``get_computed_blocks`` returns the whole hit) and unpin the host
        blocks. The GPU blocks stay held for the request until its first ``allocate`` or ``free``.

        Raises (nothing changed):
            LoadPendingError: no load of `request_id` is in flight.
            InvalidRequestError: `request_id` is not a str.
        """
        _refuse_id(request_id)
        if self._host is None:
            raise_no_load(request_id)
        self._host.complete(request_id)

    def abort_load(self, request_id: str) -> None:
        """The load failed or the request was dropped: its GPU blocks are released (destinations
        unpublished, so they hold nothing), its host blocks unpinned; a completed load's hold is
        released. Both tiers stay as they were, less what other calls changed meanwhile.

        Raises (nothing changed):
            LoadPendingError: `request_id` has no load (in flight or held).
            InvalidRequestError: `request_id` is not a str.
        """
        _refuse_id(request_id)
        if self._host is None or request_id not in self._host.loads:
            raise_no_load(request_id)
        self._host.release(request_id, self.now)

    def load_pending(self, request_id: str) -> bool:
        """Whether `request_id`'s host-tier load is in flight (not ready to allocate)."""
        return self._host is not None and self._host.pending(request_id)

    def take_transfer_plan(self) -> TransferPlan:
        """Drain the host tier's transfers since the last drain: stores first, then the loads
        started (order contract in :mod:`mambakv.core.transfers`). A non-empty plan carries a
        new ``fence``: report it with ``transfers_done(plan.fence)`` once its copies ran."""
        return EMPTY_TRANSFER_PLAN if self._host is None else self._host.take_transfer_plan()

    def transfers_done(self, fence: int) -> None:
        """The engine's copies of every transfer plan up to `fence` have run (an event of the
        stream they ran on completed, or they ran on the forward's stream before it): the GPU
        blocks held for them go back to the free queue (the sources of write-through stores;
        the destinations of loads aborted after their plan was drained). Until then no other
        request can be handed them (:mod:`mambakv.core.transfers`, "The fence"). A fence
        already passed, and any fence without a host tier, is a no-op.

        Raises:
            InvalidFenceError: `fence` is not an int in ``0 .. the last plan's fence``; nothing changed.
        """
        if self._host is None:
            if type(fence) is not int or fence != 0:
                raise InvalidFenceError(f"transfers_done({fence!r}): no host tier, so no fence was issued")
            return
        self._host.transfers_done(fence)

    def _store_evicted(self, unit: Unit) -> None:
        """Write-on-evict (``UnitIndex.before_evict``): store `unit` before the GPU evicts it."""
        self._host.store_evicted(unit, self.now)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ plans
    def new_step(self) -> None:
        """Mark a scheduling step (statistics; hits never depend on it). The new block ids and
        checkpoint writes of ``take_step_plan`` / ``take_checkpoint_writes`` cover the steps
        planned since the last ``new_step`` or drain: what an engine did not take is dropped
        here, so nothing accumulates for an engine that never asks."""
        self.num_steps += 1
        if self._new_results:
            self._new_results = []
        if self._writes_pending:
            self._writes_pending = False
            for m in self.mamba_managers:
                m.drop_checkpoint_writes()

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
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.take_copy_plan())}

    def take_zero_plan(self) -> dict[int, list[int]]:
        """Per Mamba group: running blocks that start with no initial state (zero them)."""
        if not self._zeros_pending:
            return {}
        self._zeros_pending = False
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.take_zero_plan())}

    def take_checkpoint_writes(self) -> dict[int, list[tuple[str, int, int]]]:
        """Per Mamba group: ``(request id, block id, position)`` for each block a step planned
        since the last call writes (running state, scratch) and the position it holds after
        the step. See MambaManager.take_checkpoint_writes."""
        if not self._writes_pending:
            return {}
        self._writes_pending = False
        return {m.kv_cache_group_id: w for m in self.mamba_managers if (w := m.take_checkpoint_writes())}

    def get_state_plan(self, request_id: str) -> dict[int, StatePlan]:
        """Per Mamba group holding the request: its running / spare / scratch block ids
        (MambaManager.get_state_plan).

        Raises:
            InvalidRequestError: `request_id` is not a str."""
        _refuse_id(request_id)
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
        the unified one.

        Raises:
            InvalidRequestError: `request_id` is not a str."""
        _refuse_id(request_id)
        out = {}
        for m in self.mamba_managers:
            plan = m.get_state_plan(request_id)
            if plan is None:
                out[m.kv_cache_group_id] = (-1,) * (1 + m.num_speculative_blocks)
            else:
                out[m.kv_cache_group_id] = (plan.working_block_id, *plan.scratch_block_ids)
        return out

    # ------------------------------------------------------------------ queries
    def holds_blocks(self, request_id: str) -> bool:
        """Whether the request holds blocks (allocated and not freed). O(1).

        Raises:
            InvalidRequestError: `request_id` is not a str."""
        if request_id in self._live:
            return True
        _refuse_id(request_id)
        return False

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids of the request's table in every group (null entries are 0); empty lists
        for a request that holds no blocks.

        Raises:
            InvalidRequestError: `request_id` is not a str."""
        _refuse_id(request_id)
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's tables as blocks, one list per group (copies: change them freely; null
        entries are the null block; empty lists for a request that holds none).

        Raises:
            InvalidRequestError: `request_id` is not a str."""
        _refuse_id(request_id)
        tables = tuple([*m.req_to_blocks.get(request_id, ())] for m in self.managers)
        return KVCacheBlocks(tables, tables)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Take the prefix-cache statistics counted since the last call (or since the start)
        and start new ones: what an engine's metrics loop reads once per interval (vLLM's
        name). ``prefix_cache_stats`` is the new, empty object afterwards."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        if self._host is not None:
            self._host.stats = self.prefix_cache_stats
        return stats

    def describe(self, request_id: str) -> RequestView | None:
        """A read-only snapshot of a live request: its token counts and, per group, its table
        (block ids, cursors, the Mamba running slot, unsettled states, pending verifies). None
        for a request that holds no blocks.

        Raises:
            InvalidRequestError: `request_id` is not a str."""
        live = self._live.get(request_id)
        if live is None:
            _refuse_id(request_id)
            return None
        tables: list[TableView] = []
        for gid, m in enumerate(self.managers):
            view = m.describe(request_id)
            tables.append(view if view is not None else TableView(gid, (), 0, 0))
        return RequestView(request_id, live.request.num_tokens, live.num_scheduled, tuple(tables))

    @property
    def num_running_requests(self) -> int:
        """Requests that hold blocks (allocated and not freed)."""
        return len(self._live)

    @property
    def request_ids(self) -> list[str]:
        """Ids of the requests that hold blocks, in allocation order."""
        return list(self._live)

    # ------------------------------------------------------------------ pools
    def pool_of(self, spec: KVCacheSpec) -> BlockPool:
        """The pool a group of `spec` takes blocks from: ``state_block_pool`` for Mamba specs."""
        return self.state_block_pool if isinstance(spec, MambaSpec) else self.block_pool

    @property
    def pools(self) -> tuple[BlockPool, ...]:
        """Every pool: ``(block_pool,)`` unified; ``(block_pool, state_block_pool)`` (pages,
        state slots) decoupled."""
        if self.state_block_pool is self.block_pool:
            return (self.block_pool,)
        return (self.block_pool, self.state_block_pool)

    @property
    def usage(self) -> float:
        """Fraction of the cache memory in tables: ``block_pool.usage`` unified; decoupled, the
        arena's bytes in held pages and slots over its budget (``arena.usage``)."""
        return self.block_pool.usage if self.arena is None else self.arena.usage

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV events of every pool: ``block_pool.take_events()``, then (decoupled)
        ``state_block_pool.take_events()`` (each pool's events in order; empty unless events
        are enabled)."""
        if self.state_block_pool is self.block_pool:
            return self.block_pool.take_events()
        return self.block_pool.take_events() + self.state_block_pool.take_events()

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
        if self.units is not None:
            self.units.clear()
        if host is not None:
            host.units.clear()
            host.stores.clear()
            host.loads.clear()
        return ok

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Pool and per-manager invariants, plus: every held block's ref count equals the
        number of tables holding it (a host-tier load's hold counts as one), and those tables
        are of one group and of its pool; per pool ``free + held + reserved == num_blocks - 1``;
        each live request's tables are its policies' own and its thresholds are at most what
        every group reports.

        Raises:
            AssertionError: an invariant is broken.
        """
        host = self._host
        if self.arena is not None:
            self.arena.check_invariants()
            if self.units is not None:
                page = self.units.page_tokens
                live_keys = {h for live in self._live.values() for h in group_block_hashes(live.request, page)}
                if host is not None:
                    live_keys.update(h for load in host.loads.values() for h in load.hashes)
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
        if host is not None:
            for b in host.holders():  # a host-tier load's hold counts as one holder
                holders[(b.pool_id, b.block_id)] = holders.get((b.pool_id, b.block_id), 0) + 1
            host.host.check_invariants()
            for rid in host.loads:
                assert rid not in self._live, f"{rid}: a load's hold on a live request"
        for pool in self.pools:
            if self.arena is None:
                assert pool.num_reserved_blocks == 0, "no group reserves blocks"
            held = 0
            for (pid, bid), n in holders.items():
                if pid == pool.pool_id:
                    held += 1
                    assert pool.blocks[bid].ref_cnt == n, f"block {bid}: ref {pool.blocks[bid].ref_cnt} != {n} tables"
            assert pool.get_num_free_blocks() + held + pool.num_reserved_blocks == pool.num_blocks - 1, "blocks leaked"
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


def raise_no_load(request_id: str) -> NoReturn:
    """Raise LoadPendingError for a request with no host-tier load."""
    raise LoadPendingError(f"request {request_id!r} has no host-tier load")
