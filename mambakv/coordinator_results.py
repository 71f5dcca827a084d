"""The step-results side of :class:`~mambakv.coordinator.KVCacheCoordinator`: what an engine
calls when a step's outputs come back (``retire``, ``accept_drafts``) and when a request ends
(``free``, ``preempt_all``). Each call checks every group first, then publishes, then frees."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mambakv.core.arena import SuperblockArena
from mambakv.core.errors import (
    InvalidDraftCountError,
    InvalidRequestError,
    InvalidTokenCountError,
    as_count,
    as_seconds,
)
from mambakv.core.host_tier import HostTier, HostWrite
from mambakv.core.request import Request
from mambakv.core.units import UnitIndex
from mambakv.groups import MambaManager, SingleTypeKVCacheManager
from mambakv.groups.tables import group_block_hashes
from mambakv.hits import PrefixCacheStats
from mambakv.placement import CheckpointPlacement
from mambakv.request_state import RequestState

__all__ = ["CoordinatorResults"]


class CoordinatorResults:
    """Mixed into KVCacheCoordinator, which sets every attribute declared here."""

    managers: tuple[SingleTypeKVCacheManager, ...]
    policies: tuple[SingleTypeKVCacheManager, ...]
    enable_caching: bool
    _mamba_policies: tuple[MambaManager, ...]
    _live: dict[str, RequestState]
    checkpoint_placement: CheckpointPlacement
    prefix_cache_stats: PrefixCacheStats
    units: UnitIndex | None
    arena: SuperblockArena | None
    now: float
    _unit_tables: tuple[SingleTypeKVCacheManager, ...]
    host: HostTier | None
    _loads: dict[str, Any]

    if TYPE_CHECKING:  # CoordinatorHost's and CoordinatorSteps'
        def _retire_chunk(self, live: RequestState, num_processed_tokens: int) -> bool: ...
        def _release_load(self, request_id: str, *, admitted_tokens: int | None = None) -> None: ...
        def _store_freed(self, request: Request) -> None: ...

    def retire(self, request_id: str, num_processed_tokens: int) -> None:
        """Outputs came back: `num_processed_tokens` (settled, never the optimistic scheduled
        count) of the request are processed. First publish what is now known (attention blocks
        full within the processed real tokens, Mamba states that settled), then retire what no
        group needs any more. Idempotent; a request holding no blocks is a no-op. O(1) below
        the request's next event.

        Raises (nothing changed):
            InvalidTokenCountError: a negative count, or more than the request's tokens or than
                any ``allocate`` covered (tokens never scheduled cannot be processed).
            InvalidDraftCountError: the count passes a step with drafts whose ``accept_drafts``
                has not come.
        """
        if type(num_processed_tokens) is not int:
            num_processed_tokens = as_count(num_processed_tokens, "num_processed_tokens")
        elif num_processed_tokens < 0:
            raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
        live = self._live.get(request_id)
        if live is None or num_processed_tokens == 0:
            if type(request_id) is not str:
                raise InvalidRequestError(f"request ids are strs, got {type(request_id).__name__} {request_id!r}")
            return
        request = live.request
        if num_processed_tokens > request.num_tokens or num_processed_tokens > live.num_scheduled:
            raise InvalidTokenCountError(
                f"request {request_id!r} has {request.num_tokens} tokens, {live.num_scheduled} "
                f"scheduled: cannot have processed {num_processed_tokens}")
        if num_processed_tokens >= live.retire_quiet and (
                self.arena is not None or not self._retire_chunk(live, num_processed_tokens)):
            self._retire_live(live, num_processed_tokens)  # not every policy in a prefill chunk's state

    def _retire_live(self, live: RequestState, num_processed_tokens: int) -> None:
        """``retire``'s general work once its count checks passed, the count reached the
        request's next event and the chunk path declined (``_retire_chunk``): every group
        checked, then published, then retired."""
        request = live.request
        policies, tables = self.policies, live.tables
        dead = [m.dead_slots(t, num_processed_tokens) for m, t in zip(policies, tables)]  # raises first
        if self.enable_caching:  # publish, then retire: a state published and retired lands cached
            for m in policies:
                m.cache_blocks(request, num_processed_tokens)
        for m, t, num_dead in zip(policies, tables, dead):
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
        """
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

    def set_now(self, now: float) -> None:
        """Set the engine's clock (seconds; ``allocate`` and ``free`` take it as ``now=``).

        Raises:
            InvalidClockError: not a finite number.
        """
        self.now = as_seconds(now)
        if self.units is not None:
            self.units.now = self.now

    def free(self, request_id: str, *, now: float | None = None) -> None:
        """A request finished or is preempted: free every group's table and drop its one
        RequestState. Unknown ids are a no-op. In the decoupled layout its chain joins the
        eviction units (:mod:`mambakv.core.units`) with its ``retain`` hint, at `now` (seconds;
        None: the latest given).

        Raises:
            DoubleFreeError: a block of its tables is already free (an earlier misuse); nothing
                changed (every group is checked before any is freed).
            InvalidClockError: `now` is not a finite number; nothing changed.
        """
        if now is not None:
            now = as_seconds(now)
        if self._loads and request_id in self._loads:  # a load in flight or its hold (never live)
            if now is not None:
                self.set_now(now)
            self._release_load(request_id)
            return
        if request_id not in self._live and not any(request_id in m.req_to_blocks for m in self.managers):
            if type(request_id) is not str:
                raise InvalidRequestError(f"request ids are strs, got {type(request_id).__name__} {request_id!r}")
            self.checkpoint_placement.forget(request_id)
            return
        for m in self.policies:
            m.check_free(request_id)
        if now is not None:  # every check passed: the clock moves
            self.set_now(now)
        units = self.units
        tables = [list(m.req_to_blocks.get(request_id, ())) for m in self._unit_tables] if units is not None else None
        for m in self.policies:
            m.free(request_id)
        live = self._live.pop(request_id, None)
        self.checkpoint_placement.forget(request_id)
        if units is not None and live is not None and tables is not None:
            request = live.request
            units.register(group_block_hashes(request, units.page_tokens), tables, retain=request.retain, arrival=live.arrival,
                           prompt_tokens=request.num_prompt_tokens, parent=live.parent, now=self.now)
            units.settle()
        if self.host is not None and live is not None and self.host.write is HostWrite.THROUGH:
            self._store_freed(live.request)

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
        loading = list(self._loads)  # host-tier loads (in flight or held): aborted, re-queued too
        for rid in loading:
            self._release_load(rid)
        return [r.request_id for r in requests] + loading

    def _count_admission(self, request: Request, num_hit_tokens: int) -> None:
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
