"""Admission of waiting requests, and the allocation helpers a scheduler step shares (``Scheduler``'s base).

The waiting queue is FCFS; a request is admitted while the step has budget left and fewer than
``max_num_seqs`` run::

    hash the prompt once (timed apart: SimMetrics.hash_s)
    host tier, first lookup: get_computed_blocks_tiered -> a load: wait for it (Scheduler.loading)
    hits, hit = get_computed_blocks(request)
    reserve_full_prompt and others run and the whole prompt does not fit  -> stop admitting
    n = next_chunk_end(request, budget, num_computed_tokens=hit) - hit   (the placement's rules;
                                                           its junction rule looks up the shared prefix)
    allocate(request, n, num_new_computed_tokens=hit, new_computed_blocks=hits, num_draft_tokens=0)
        None: stop admitting (nothing runs: BudgetTooSmallError)
    first admission: count prompt, hit and state-missing tokens (max(0, J - hit))

A preempted request comes back at the head of the queue and is admitted again the same way; its
prefix-cache statistics are counted only at its first admission.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from mambakv.core.request import Request
from mambakv.groups import MambaManager
from mambakv.plans import KVCacheBlocks
from mambakv.sim.chunking import prefill_chunk
from mambakv.sim.results import BudgetTooSmallError, ScheduledEntry, SimRequest

if TYPE_CHECKING:
    from mambakv.coordinator import KVCacheCoordinator
    from mambakv.sim.metrics import SimMetrics

__all__ = ["Admission"]

_now = time.perf_counter


def pool_capacity(coord: KVCacheCoordinator) -> str:
    """The pool's size for messages: ``"641 blocks"`` unified, ``"4,550 superblocks (40,958 page
    ids)"`` decoupled."""
    if coord.arena is None:
        return f"{coord.block_pool.num_blocks - 1} blocks"
    g = coord.arena.geometry
    return f"{g.num_superblocks - 1:,} superblocks ({g.num_pages - 1:,} page ids)"


class Admission:
    """Admission, the chunk choice (``next_chunk``), preemption and the timed ``allocate``;
    needs the attributes declared below (set by :class:`~mambakv.sim.scheduler.Scheduler`)."""

    coord: KVCacheCoordinator
    metrics: SimMetrics
    waiting: deque[SimRequest]
    running: list[SimRequest]
    max_num_seqs: int
    reserve_full_prompt: bool
    align: int
    stop_before_last_token: bool
    now_s: Callable[[], float]  # Scheduler.now_s
    h2d_gbps: float
    loading: list[tuple[float, SimRequest]]

    # ------------------------------------------------------------------ token choice
    def next_chunk(self, request: Request, computed: int, budget: int) -> int:
        """Tokens to schedule for `request`'s next prefill chunk from `computed`:
        ``coord.next_chunk_end`` (the checkpoint placement, :mod:`mambakv.placement`), timed as
        library time."""
        t = _now()
        end = self.coord.next_chunk_end(request, budget, num_computed_tokens=computed)
        self.metrics.library_s += _now() - t
        self.metrics.library_calls += 1
        return end - computed

    def prefill_chunk(self, computed: int, num_tokens: int, budget: int, junction: int = 0) -> int:
        """vLLM 0.33's chunk rule for this scheduler's alignment and stop rule, given the
        junction (:func:`mambakv.sim.chunking.prefill_chunk`): what ``next_chunk`` gives under
        the unified layout's default placement (tests/test_placement.py checks it)."""
        return prefill_chunk(computed, num_tokens, budget, align=self.align,
                             stop_before_last_token=self.stop_before_last_token, junction=junction)

    # ------------------------------------------------------------------ preemption
    def preempt(self, sreq: SimRequest) -> None:
        """Free, re-queue at the front, recompute from scratch (in-flight results dropped)."""
        t = _now()
        self.coord.free(sreq.request.request_id, now=self.now_s())
        self.metrics.library_s += _now() - t
        self.metrics.library_calls += 1
        self.running.remove(sreq)
        sreq.is_running = False
        sreq.generation += 1
        sreq.request.num_computed_tokens = 0
        sreq.processed = 0
        sreq.awaiting_output = False
        self.waiting.appendleft(sreq)
        self.metrics.preemptions += 1

    # ------------------------------------------------------------------ allocation
    def _timed_allocate(self, req: Request, n: int, *, num_draft_tokens: int, num_new_computed_tokens: int = 0,
                        new_computed_blocks: KVCacheBlocks | None = None) -> KVCacheBlocks | None:
        t = _now()
        new = self.coord.allocate(req, n, num_new_computed_tokens=num_new_computed_tokens,
                                  new_computed_blocks=new_computed_blocks, num_draft_tokens=num_draft_tokens,
                                  now=self.now_s())
        self.metrics.library_s += _now() - t
        self.metrics.library_calls += 1
        return new

    def _after_allocate(self, sreq: SimRequest, new: KVCacheBlocks) -> bool:
        """Per-request Mamba peaks; True when any block was added."""
        grew = False
        for gid, blocks in enumerate(new.blocks):
            if blocks:
                grew = True
                m = self.coord.managers[gid]
                if isinstance(m, MambaManager):
                    self.metrics.observe_mamba(m, sreq.request.request_id)
        return grew

    def _admit(self, budget: int, batch: list[ScheduledEntry]) -> tuple[int, bool]:
        """Admit waiting requests FCFS into `batch` while `budget` tokens, seats and blocks
        last (the steps of the module docstring); returns the budget left and whether any
        group's usage grew."""
        coord, mt = self.coord, self.metrics
        grew = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            sreq = self.waiting[0]
            req = sreq.request
            if req.hash_block_size is None:  # hash the prompt once, outside the library's time
                t = _now()
                req.set_hash_block_size(coord.hash_block_size)
                req.block_hashes  # noqa: B018 - computes and keeps the hashes
                mt.hash_s += _now() - t
            looked_up = None
            if coord.host is not None and not sreq.tiered:
                looked_up = self._start_load(sreq)
                if looked_up is None:
                    continue  # it waits for its host-tier load (Scheduler.loading)
            if looked_up is not None:  # the tiered lookup's GPU part is get_computed_blocks'
                hits, hit = looked_up
            else:
                t = _now()
                hits, hit = coord.get_computed_blocks(req)
                mt.library_s += _now() - t
                mt.library_calls += 1
            if self.reserve_full_prompt and self.running and not self._fits(req, hits, hit):
                break
            n = self.next_chunk(req, hit, budget)
            if "junction" in coord.checkpoint_placement.names:
                junction = coord.checkpoint_placement.junction(req.request_id)
            else:  # the metric only: where attention hit but no state was published
                junction = coord.get_shared_prefix_length(req) if self.align else 0
            new = self._timed_allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=hits,
                                       num_draft_tokens=0)
            if new is None:
                if not self.running:
                    raise BudgetTooSmallError(
                        f"budget too small for one request: {req.request_id!r} ({req.num_tokens} tokens) "
                        f"does not fit in {pool_capacity(coord)}")
                break
            self.waiting.popleft()
            self.running.append(sreq)
            sreq.is_running = True
            if not sreq.admitted:
                sreq.admitted = True
                mt.prompt_tokens += req.num_prompt_tokens
                mt.cached_tokens += hit
                mt.state_missing_tokens += max(0, junction - hit)  # attention hit without a state (causes.py)
                sreq.hit = hit
            req.num_computed_tokens = hit
            sreq.processed = hit
            sreq.junction = junction
            grew |= self._after_allocate(sreq, new) or hit > 0
            batch.append(self._schedule(sreq, n, 0))
            budget -= n
        return budget, grew

    def _start_load(self, sreq: SimRequest) -> tuple[KVCacheBlocks, int] | None:
        """The host-tier lookup of a new request (``get_computed_blocks_tiered``). When it starts a
        load, the request leaves the queue until the load's time at ``h2d_gbps`` has passed on
        the step clock (``Scheduler.loading``), as an engine runs it on a side stream and admits
        the request once it is done: None. Else its GPU hit ``(blocks, tokens)``."""
        sreq.tiered = True
        t = _now()
        tiered = self.coord.get_computed_blocks_tiered(sreq.request, now=self.now_s())
        self.metrics.library_s += _now() - t
        self.metrics.library_calls += 1
        if tiered.load is None:
            return tiered.blocks, tiered.num_gpu_tokens
        self.waiting.popleft()
        load_ms = tiered.load.num_bytes / (self.h2d_gbps * 1e6)  # bytes / (GB/s) in ms
        self.metrics.host_loads += 1
        self.metrics.host_load_ms += load_ms
        self.loading.append((self.metrics.clock_ms + load_ms, sreq))
        return None

    def _complete_loads(self) -> None:
        """Loads whose time has passed: ``complete_load``, the request back at the queue's head."""
        done = [sreq for at, sreq in self.loading if at <= self.metrics.clock_ms]
        if not done:
            return
        self.loading = [(at, sreq) for at, sreq in self.loading if at > self.metrics.clock_ms]
        t = _now()
        for sreq in done:
            self.coord.complete_load(sreq.request.request_id)
        self.metrics.library_s += _now() - t
        self.waiting.extendleft(reversed(done))

    def _wait_for_load(self) -> bool:
        """Nothing could run: jump the clock to the next load's end (False: none in flight)."""
        if not self.loading:
            return False
        self.metrics.clock_ms = max(self.metrics.clock_ms, min(at for at, _ in self.loading))
        self._complete_loads()
        return True

    def _fits(self, req: Request, hits: KVCacheBlocks, hit: int) -> bool:
        """The pool can hold all of `req`'s known tokens (``num_blocks_needed``, the count
        ``allocate`` makes)."""
        t = _now()
        coord = self.coord
        ok = coord.can_allocate(req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=hits)
        self.metrics.library_s += _now() - t
        self.metrics.library_calls += 1
        return ok

    def _schedule(self, sreq: SimRequest, n: int, drafts: int) -> ScheduledEntry:
        req = sreq.request
        req.num_computed_tokens += n
        samples = req.num_computed_tokens - drafts >= req.num_tokens
        if samples:
            sreq.awaiting_output = True
        return (sreq, sreq.generation, n, drafts, samples)
