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
request's prefix). Admission of waiting requests: :mod:`mambakv.sim.admission`.

Decode: a request whose last step samples a token waits for that result (no placeholders);
with K speculative tokens a decode step schedules ``1 + K`` tokens, ``K`` of them drafts
beyond ``request.num_tokens``; the seeded acceptance count ``a`` is the number of leading
drafts that pass a coin of probability `acceptance_rate`.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.errors import MambaKVError
from mambakv.core.spec import MambaSpec
from mambakv.sim.admission import Admission, pool_capacity
from mambakv.sim.metrics import SimMetrics
from mambakv.sim.results import BudgetTooSmallError, ResultProcessor, ScheduledEntry, SimRequest
from mambakv.sim.workloads import RequestSpec

if TYPE_CHECKING:
    from mambakv.device.state_pool import MambaStatePool

__all__ = ["BudgetTooSmallError", "SimRequest", "Scheduler"]

_now = time.perf_counter


class Scheduler(ResultProcessor, Admission):
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
        """Process every in-flight step (the engine waits for its outputs)."""
        while self.in_flight:
            self._process(self.in_flight.popleft())

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
