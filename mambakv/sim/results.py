"""Engine-side request state and the processing of a step's results (``Scheduler``'s base).

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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from mambakv.core.errors import MambaKVError
from mambakv.core.request import Request
from mambakv.sim.workloads import RequestSpec

if TYPE_CHECKING:
    from mambakv.coordinator import KVCacheCoordinator
    from mambakv.device.state_pool import MambaStatePool
    from mambakv.sim.metrics import SimMetrics

__all__ = ["BudgetTooSmallError", "ResultProcessor", "ScheduledEntry", "SimRequest"]

_now = time.perf_counter


class BudgetTooSmallError(MambaKVError, RuntimeError):
    """One request alone does not fit in the KV-cache pool."""


class SimRequest:
    """A request in the scheduler: the library's Request plus engine-side progress."""

    __slots__ = ("spec", "request", "processed", "generation", "awaiting_output", "admitted",
                 "finished", "num_outputs", "is_running", "junction", "hit", "tiered")

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.request = Request(spec.request_id, spec.prompt(), max_tokens=spec.output_len, retain=spec.retain)
        self.processed = 0          # settled tokens (results processed)
        self.generation = 0         # +1 at each preemption: older in-flight results are dropped
        self.awaiting_output = False
        self.admitted = False       # admitted at least once (hit counted then)
        self.finished = False
        self.num_outputs = 0
        self.is_running = False
        self.junction = 0           # shared-prefix length to end a prefill chunk at (0: none)
        self.hit = 0                # prefix-hit tokens at the first admission
        self.tiered = False         # its host-tier lookup was made (once, before its first admission)


#: One request's part of a scheduled step: ``(request, its generation when scheduled, tokens
#: scheduled, of which drafts, whether the step samples a token)``.
ScheduledEntry = tuple[SimRequest, int, int, int, bool]


class ResultProcessor:
    """Result handling and copy-plan execution; needs the attributes declared below (set by
    :class:`~mambakv.sim.scheduler.Scheduler`)."""

    coord: KVCacheCoordinator
    metrics: SimMetrics
    rng: random.Random
    acceptance_rate: float
    vocab: int
    running: list[SimRequest]
    now_s: Callable[[], float]  # Scheduler.now_s
    state_pools: Mapping[int, MambaStatePool]
    on_finish: Callable[[SimRequest], None] | None
    check_invariants: bool

    def _run_plans(self) -> None:
        coord, mt = self.coord, self.metrics
        t = _now()
        zero = coord.take_zero_plan()
        plan = coord.take_copy_plan()
        coord.take_checkpoint_writes()  # lazy Mamba groups: the kernels' boundary writes (no device here)
        host = coord.host
        if host is not None and (host.stores or host.loads):
            coord.take_transfer_plan()  # a host tier's stores and loads (block ids only: nothing to copy)
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
            coord.retire(rid, sreq.processed)
            if done:
                coord.free(rid, now=now_s)
            mt.library_s += now() - t
            mt.library_calls += 1
            if done:
                sreq.finished = True
                sreq.is_running = False
                self.running.remove(sreq)
                mt.finished += 1
                if self.on_finish is not None:
                    self.on_finish(sreq)
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
