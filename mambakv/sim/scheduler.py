"""A reference scheduler that drives a :class:`KVCacheCoordinator` step by step, as an engine does.

One step::

    new_step()
    running requests, in admission order:  next chunk / decode token (+ K drafts)
        allocate(request, n, num_draft_tokens=K)  -- None: preempt the most recently admitted request, retry
    waiting requests, FCFS (skipped in a step that preempted):
        (host tier, first time: get_computed_blocks_tiered; a load: wait bytes / h2d_gbps, complete_load)
        get_computed_blocks -> allocate(request, n, num_new_computed_tokens=hit, new_computed_blocks=...,
                                        num_draft_tokens=0)
    run take_zero_plan() / take_copy_plan() (on the MambaStatePools when given)
    the step's results are processed `lag` steps later, oldest first:
        accept_drafts(rid, a) (+ run its copies), append a + 1 tokens, retire(rid, processed)
        finished: free(rid)

Chunked prefill: a chunk ends where ``coord.next_chunk_end`` says (the coordinator's checkpoint
placement, :mod:`mambakv.placement`; vLLM's rules by default in the unified layout: chunk ends on
the hit alignment, the replay boundary before the prompt's end, the junction with an earlier
request's prefix).

Decode: a request whose last step samples a token waits for that result (no placeholders);
with K speculative tokens a decode step schedules ``1 + K`` tokens, ``K`` of them drafts
beyond ``request.num_tokens``; the seeded acceptance count ``a`` is the number of leading
drafts that pass a coin of probability `acceptance_rate`.

Admission. Admission of waiting requests, and the allocation helpers a scheduler step shares (``Scheduler``'s base).

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

Results. Engine-side request state and the processing of a step's results (``Scheduler``'s base).

When a step's outputs come back (``lag`` steps after it was scheduled), for each request of
the step, oldest step first::

    drafts:   a = seeded acceptance count; accept_drafts(rid, a) -> run its copies
    sampled:  append min(a + 1, outputs left) tokens
    always:   retire(rid, settled tokens)      # publish Mamba states, free old ones
    finished: free(rid)

Results of a request preempted or finished since the step was scheduled are dropped (its
``generation`` changed), as an engine drops outputs of an aborted request.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.errors import MambaKVError
from mambakv.core.request import Request
from mambakv.core.spec import MambaSpec
from mambakv.groups import MambaManager
from mambakv.plans import KVCacheBlocks
from mambakv.sim.chunking import prefill_chunk
from mambakv.sim.metrics import SimMetrics
from mambakv.sim.sim_request import BudgetTooSmallError, ScheduledEntry, SimRequest, pool_capacity
from mambakv.sim.workloads import RequestSpec

if TYPE_CHECKING:
    from mambakv.device.state_pool import MambaStatePool

__all__ = ["BudgetTooSmallError", "SimRequest", "Scheduler"]

_now = time.perf_counter


class Scheduler:
    """Drives `coord` through a workload.

    Args:
        coord: the coordinator (its pool is the memory budget).
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step.
        num_speculative_tokens: K drafts per decode step (the Mamba groups' nspec must be >= K).
        acceptance_rate: probability that each next draft is accepted (seeded).
        lag: steps between scheduling a step and processing its results (async scheduling).
        stop_before_last_token: chunk stop at ``(N - 1) // B * B`` (True; vLLM 0.33 too) or older vLLM's ``N - N % B``.
        state_pools: group id -> ``MambaStatePool`` to run the copy / zero plans on.
        step_ms, ms_per_token: the step clock: a step lasts ``step_ms + ms_per_token x tokens``.
        seed: output ids and acceptance counts.
        on_finish: called with each finished SimRequest (progress bars).
        reserve_full_prompt: admit a request only when the pool can hold its whole prompt
            (vLLM's default, ``scheduler_reserve_full_isl``); the first one is always tried.
        check_invariants: call ``coord.check_invariants()`` after every step and every
            processed batch (tests; slow).
        h2d_gbps: host-to-GPU bandwidth (GB/s, 1e9 B) of a host tier's loads: a request whose
            hit needs a load waits ``bytes / h2d_gbps`` on the step clock before admission.
    """

    def __init__(self, coord: KVCacheCoordinator, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 num_speculative_tokens: int = 0, acceptance_rate: float = 0.7, lag: int = 0,
                 stop_before_last_token: bool = True, state_pools: Mapping[int, MambaStatePool] | None = None,
                 step_ms: float = 10.0, ms_per_token: float = 0.05, seed: int = 0,
                 vocab: int = 151_936, on_finish: Callable[[SimRequest], None] | None = None,
                 reserve_full_prompt: bool = True, check_invariants: bool = False,
                 h2d_gbps: float = 25.0) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0 or num_speculative_tokens < 0 or lag < 0:
            raise MambaKVError("need max_num_seqs > 0, max_num_batched_tokens > 0, "
                               "num_speculative_tokens >= 0 and lag >= 0")
        if not h2d_gbps > 0:
            raise MambaKVError(f"h2d_gbps must be > 0, got {h2d_gbps!r}")
        if num_speculative_tokens >= max_num_batched_tokens:
            raise MambaKVError("max_num_batched_tokens must exceed num_speculative_tokens")
        for m in coord.mamba_managers:
            spec = m.kv_cache_spec
            assert isinstance(spec, MambaSpec)
            nspec = spec.num_speculative_blocks
            if num_speculative_tokens > nspec:
                raise MambaKVError(f"{num_speculative_tokens} speculative tokens need >= that many "
                                   f"speculative blocks, group {m.kv_cache_group_id} has {nspec}")
        self.coord = coord
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.K = num_speculative_tokens
        self.acceptance_rate = acceptance_rate
        self.lag = lag
        self.stop_before_last_token = stop_before_last_token
        self.state_pools = state_pools or {}
        self.step_ms, self.ms_per_token = step_ms, ms_per_token
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.on_finish = on_finish
        self.check_invariants = check_invariants
        self.reserve_full_prompt = reserve_full_prompt
        # Chunks end where the coordinator's checkpoint placement asks (coord.next_chunk_end),
        # on multiples of its hit alignment when a Mamba group caches states in align mode.
        self.align = coord.chunk_alignment
        if not stop_before_last_token:  # older vLLM's stop rule: the same rules, T = N - N % A
            coord.checkpoint_placement.set_stop_rule(stop_before_last_token=False)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.in_flight: deque[list[ScheduledEntry]] = deque()
        self.h2d_gbps = h2d_gbps
        #: host-tier loads in flight: (step-clock ms when done, request), in start order
        self.loading: list[tuple[float, SimRequest]] = []
        #: transfer plans whose fence has not passed: (fence, ids of its loads not completed)
        self.fences: deque[tuple[int, set[str]]] = deque()
        self.metrics = SimMetrics.for_coordinator(coord)
        #: one-at-a-time runs: the running request's arrival (s), the trace clock
        self._arrival_s: float | None = None

    def now_s(self) -> float:
        """The trace clock in seconds, passed to the coordinator as ``now``: the step clock, or
        in a one-at-a-time run the running request's arrival."""
        return self.metrics.clock_ms / 1000.0 if self._arrival_s is None else self._arrival_s

    def step(self) -> int:
        """Schedule one step (and process the results that come back in it); returns the
        tokens scheduled (0: nothing could run). Timed once as a whole: ``SimMetrics.step_s``
        (prompt hashing, done at admission, is timed apart in ``hash_s``)."""
        t0 = _now()
        tokens = self._step()
        self.metrics.step_s += _now() - t0
        return tokens

    def _step(self) -> int:
        # Hot loop: the timed allocate, _after_allocate's test and _schedule are inlined here
        # (Admission._timed_allocate / _schedule do the same for admissions); the step's timed
        # regions add up in `lib` / `calls` and reach the metrics once.
        coord, mt = self.coord, self.metrics
        if self.loading:
            self._complete_loads()
        now = _now
        t = now()
        coord.new_step()
        lib = now() - t
        calls = 1
        # self.now_s(), constant within a step: the clock moves after scheduling
        now_s = mt.clock_ms / 1000.0 if self._arrival_s is None else self._arrival_s
        budget = self.budget
        batch: list[ScheduledEntry] = []
        grew = preempted = False
        for sreq in list(self.running):
            if budget <= 0:
                break
            if not sreq.is_running or (sreq.awaiting_output and not self._may_schedule_ahead(sreq)):
                continue
            req = sreq.request
            c, N = req.num_computed_tokens, req.num_tokens
            drafts = 0
            if c >= N - 1 and N > req.num_prompt_tokens:  # decoding (an output token exists)
                n = 1
                if c == N - 1 and self.K:  # the last token is known: propose drafts after it
                    drafts = min(self.K, budget - 1, coord.max_model_len - N)
                    n += drafts
            else:
                n = self.next_chunk(req, c, budget)
            while True:
                t = now()
                new = coord.allocate(req, n, num_draft_tokens=drafts, now=now_s)
                lib += now() - t
                calls += 1
                if new is not None:
                    break
                victim = self.running[-1]
                if victim is sreq and len(self.running) == 1:
                    if self.in_flight:
                        break  # its own unprocessed steps still hold states: wait for them
                    raise BudgetTooSmallError(
                        f"budget too small for one request: {req.request_id!r} needs more than the "
                        f"{pool_capacity(coord)} of the pool")
                self.preempt(victim)
                preempted = True
                if victim is sreq:
                    break
            if new is None:
                continue
            if any(new.blocks):
                grew |= self._after_allocate(sreq, new)
            req.num_computed_tokens += n  # _schedule, inlined
            samples = req.num_computed_tokens - drafts >= N  # allocate adds no token
            if samples:
                sreq.awaiting_output = True
            batch.append((sreq, sreq.generation, n, drafts, samples))
            budget -= n
        mt.library_s += lib
        mt.library_calls += calls
        if not preempted and self.waiting:
            budget, grew2 = self._admit(budget, batch)
            grew |= grew2
        if not batch:
            return 0
        self._run_plans()
        tokens = self.budget - budget
        mt.steps += 1
        mt.scheduled_tokens += tokens
        mt.clock_ms += self.step_ms + self.ms_per_token * tokens
        if len(self.running) > mt.peak_running:
            mt.peak_running = len(self.running)
        if grew:
            mt.observe_usage(coord)
        if self.check_invariants:
            coord.check_invariants()
        if self.lag:
            self.in_flight.append(batch)
            while len(self.in_flight) > self.lag:
                self._process(self.in_flight.popleft())
        else:  # synchronous: this step's results come back now (nothing else in flight)
            self._process(batch)
        return tokens

    def _may_schedule_ahead(self, sreq: SimRequest) -> bool:
        """Async scheduling without drafts (``lag > 0``, ``K == 0``): a decoding request whose
        sampled tokens are not back yet schedules its next token on a placeholder, as engines
        do, up to `lag` outstanding tokens and never past its output length or
        ``max_model_len``. ``allocate`` gets ``num_draft_tokens=0``: placeholders are not
        drafts."""
        if not self.lag or self.K:
            return False
        req = sreq.request
        outstanding = req.num_computed_tokens - (req.num_tokens - 1)
        return (req.num_output_tokens > 0 and 0 < outstanding <= self.lag
                and sreq.num_outputs + outstanding < sreq.spec.output_len
                and req.num_computed_tokens < self.coord.max_model_len)

    # ------------------------------------------------------------------ runs
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.in_flight or self.loading)

    def drain(self) -> None:
        """Process every in-flight step (the engine waits for its outputs), then run the host
        tier's last stores (planned by the last frees) and pass their fence."""
        while self.in_flight:
            self._process(self.in_flight.popleft())
        if self.coord.host is not None:
            t = _now()
            self._take_transfers()
            self.metrics.library_s += _now() - t

    def run(self, specs: Sequence[RequestSpec], *, one_at_a_time: bool = False) -> SimMetrics:
        """Run `specs` (in arrival order) to completion and return the metrics.

        Step clock: requests join the waiting queue once ``clock_ms >= arrival_ms``; when
        nothing runs, the clock jumps to the next arrival. `one_at_a_time`: each request runs
        alone to completion, in arrival order (the coordinator's ``now`` is its arrival).
        """
        mt = self.metrics
        t0 = _now()
        order = sorted(specs, key=lambda s: s.arrival_ms)
        mt.requests += len(order)
        if one_at_a_time:
            for spec in order:
                self._arrival_s = spec.arrival_ms / 1000.0
                self.waiting.append(SimRequest(spec))
                self._run_until_idle()
            self._arrival_s = None
            self.drain()
        else:
            i = 0
            while i < len(order) or not self.idle():
                while i < len(order) and order[i].arrival_ms <= mt.clock_ms:
                    self.waiting.append(SimRequest(order[i]))
                    i += 1
                if self.idle():
                    mt.clock_ms = order[i].arrival_ms
                    continue
                if not self.step():
                    if self.in_flight:
                        self._process(self.in_flight.popleft())
                    elif self.loading and (i == len(order) or min(at for at, _ in self.loading)
                                           <= order[i].arrival_ms):
                        self._wait_for_load()
                    elif i < len(order):
                        mt.clock_ms = max(mt.clock_ms, order[i].arrival_ms)
                    else:
                        raise MambaKVError("scheduler made no progress")  # pragma: no cover
            self.drain()
        mt.wall_s += _now() - t0
        return mt

    def _run_until_idle(self) -> None:
        mt, now = self.metrics, _now
        while self.waiting or self.running or self.in_flight or self.loading:  # not self.idle()
            t0 = now()  # self.step(), inlined: the same whole-step timer
            tokens = self._step()
            mt.step_s += now() - t0
            if not tokens:
                if self.in_flight:
                    self._process(self.in_flight.popleft())
                elif not self._wait_for_load():
                    raise MambaKVError("scheduler made no progress")  # pragma: no cover

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
        if self.coord.host is not None:  # its write-through stores run now, before the retried allocation
            self._take_transfers()
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

    def _take_transfers(self) -> None:
        """Drain a host tier's transfer plan (block ids only: no device here), after a batch of
        results (its frees planned write-through stores) and before each forward. Its stores
        run at once; its loads land at their time on the step clock, so the plan's fence passes
        when its last load completed (``transfers_done``, in fence order)."""
        plan = self.coord.take_transfer_plan()
        if plan.fence:
            self.fences.append((plan.fence, {p.request_id for p in plan.loads}))
            self._pass_fences()

    def _pass_fences(self) -> None:
        """``transfers_done`` of the oldest fences whose loads all completed."""
        last = 0
        while self.fences and not self.fences[0][1]:
            last = self.fences.popleft()[0]
        if last:
            self.coord.transfers_done(last)

    def _complete_loads(self) -> None:
        """Loads whose time has passed: ``complete_load``, the request back at the queue's head,
        and the fences they were the last copies of."""
        done = [sreq for at, sreq in self.loading if at <= self.metrics.clock_ms]
        if not done:
            return
        self.loading = [(at, sreq) for at, sreq in self.loading if at > self.metrics.clock_ms]
        t = _now()
        for sreq in done:
            rid = sreq.request.request_id
            self.coord.complete_load(rid)
            for _, rids in self.fences:
                rids.discard(rid)
        self._pass_fences()
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

    def _run_plans(self) -> None:
        coord, mt = self.coord, self.metrics
        t = _now()
        zero = coord.take_zero_plan()
        plan = coord.take_copy_plan()
        coord.take_checkpoint_writes()  # lazy Mamba groups: the kernels' boundary writes (no device here)
        if coord.host is not None:
            self._take_transfers()
        mt.library_s += _now() - t
        mt.library_calls += 1
        if plan:
            mt.copies += sum(len(p) for p in plan.values())
        if self.state_pools:
            self._run_copies(plan, zero)

    def _run_copies(self, plan: Mapping[int, Sequence[tuple[int, int]]],
                    zero: Mapping[int, Sequence[int]] | None = None) -> None:
        pools = self.state_pools
        if not pools:
            return
        t = _now()
        for gid, ids in (zero or {}).items():
            if gid in pools:
                pools[gid].zero_(ids)
        for gid, pairs in plan.items():
            if gid in pools:
                pools[gid].copy_(pairs)
        self.metrics.pool_s += _now() - t

    # ------------------------------------------------------------------ results
    def _process(self, batch: Sequence[ScheduledEntry]) -> None:
        coord, mt = self.coord, self.metrics
        now = _now
        for sreq, gen, n, drafts, samples in batch:
            if gen != sreq.generation or sreq.finished:
                continue  # preempted or finished since: results dropped
            req = sreq.request
            rid = req.request_id
            accepted = 0
            if drafts:
                while accepted < drafts and self.rng.random() < self.acceptance_rate:
                    accepted += 1
                t = now()
                pairs = coord.accept_drafts(rid, accepted)
                mt.library_s += now() - t
                mt.library_calls += 1
                if pairs:
                    mt.copies += sum(len(p) for p in pairs.values())
                    self._run_copies(pairs)
                req.num_computed_tokens -= drafts - accepted
            sreq.processed += n - drafts + accepted
            num_tokens = req.num_tokens
            ids = None
            if samples:
                sreq.awaiting_output = False
                k = sreq.spec.output_len - sreq.num_outputs
                if k > accepted + 1:
                    k = accepted + 1
                ids = self._output_ids(sreq, k)
                sreq.num_outputs += k
                mt.output_tokens += k
                num_tokens += len(ids)  # the request's tokens once `ids` are appended below
            if sreq.processed > num_tokens:  # accepted drafts beyond the output cap are dropped
                sreq.processed = req.num_computed_tokens = num_tokens
            # Finished: all outputs, or the length cap (an engine stops at max_model_len too).
            done = sreq.num_outputs >= sreq.spec.output_len or num_tokens >= coord.max_model_len
            now_s = self.now_s() if done else None
            # One timed region: the appends (Request is library code: they count), retire, free.
            t = now()
            if ids is not None:
                req.append_output_token_ids(ids)
            if done:  # the settled tokens' publishes, then the tables whole: vLLM's free order
                coord.free(rid, now=now_s, num_processed_tokens=sreq.processed)
            else:
                coord.retire(rid, sreq.processed)
            mt.library_s += now() - t
            mt.library_calls += 1
            if done:
                sreq.finished = True
                sreq.is_running = False
                self.running.remove(sreq)
                mt.finished += 1
                if self.on_finish is not None:
                    self.on_finish(sreq)
        if coord.host is not None:  # the frees' write-through stores run now, before the next allocation
            t = now()
            self._take_transfers()
            mt.library_s += now() - t
        if self.check_invariants:
            coord.check_invariants()

    def _output_ids(self, sreq: SimRequest, k: int) -> list[int]:
        fixed = sreq.spec.output_token_ids
        if fixed is not None:
            return [int(x) for x in fixed[sreq.num_outputs : sreq.num_outputs + k]]
        # rng.randrange(vocab), k times, without its two Python frames per id: Random's
        # randrange(n) is _randbelow_with_getrandbits(n), rejection sampling on n.bit_length()
        # random bits, which this repeats draw for draw (the same ids from the same seed).
        v = self.vocab
        if v < 1:
            return [self.rng.randrange(v)]  # raises ValueError (empty range)
        bits, draw = v.bit_length(), self.rng.getrandbits
        out = []
        for _ in range(k):
            r = draw(bits)
            while r >= v:
                r = draw(bits)
            out.append(r)
        return out
