"""A fleet of reference schedulers behind a router, on a trace's real arrival clock.

Each instance is a :class:`~mambakv.sim.scheduler.Scheduler` with its own coordinator and
memory and its own step clock (a step lasts ``step_ms + ms_per_token x tokens``). One global
loop keeps them on one simulated time line::

    t = the smallest clock among busy instances (inf when all are idle)
    next arrival a <= t   -> route it (mambakv.sim.router) and append it to the chosen
                             instance's waiting queue, as Scheduler.run does; an idle
                             instance's clock first jumps to a
    else                  -> step the busy instance with the smallest clock (ties: lowest
                             index); drain its KV events into the kv router's index

    e.g. A (1,536 tokens) at 0 ms and B at 30 ms on one instance: A's first chunk (1,088
    tokens) runs 0 -> 64.4 ms; B joins the queue at 30 and is admitted at the next step, at
    64.4 ms: a queueing delay of 34.4 ms.

So a router sees every instance as of the end of its last step (a busy instance's clock is at
or past the arrival). Deterministic: no wall time enters a decision. Results are processed in
the step that scheduled them (no async lag).

Oracle probes: the oracle asks each instance's ``get_computed_blocks`` with the request
itself (its hashes are computed once and kept); that call pins nothing but counts the
instance's ``prefix_cache_stats``, so the probe restores the three counters afterwards, and the
instance's own admission later counts the request once, as in a single-instance run.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.errors import InvalidSpecError, MambaKVError
from mambakv.events.announce import RouterAnnouncer
from mambakv.groups import group_block_hashes
from mambakv.sim.conversation import REPLAY_MODES, chain_hooks, prepare_replay
from mambakv.sim.router import DEFAULT_LOAD_BOUND, ROUTERS, DynamoIndex, PrefixIndex, RouterKind, choose, least_loaded
from mambakv.sim.runner import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL, build_coordinator
from mambakv.sim.scheduler import Scheduler
from mambakv.sim.sim_request import SimRequest
from mambakv.sim.workloads import RequestSpec, load_trace

__all__ = ["INDEXES", "Fleet", "FleetResult", "percentile", "run_fleet"]

#: ``--index`` values of the kv router: mambakv's own index, or Dynamo's RadixTree.
INDEXES = ("mambakv", "dynamo")

_now = time.perf_counter


class _Instance:
    """One engine of the fleet: scheduler, announce filter, and what the fleet measures."""

    __slots__ = ("index", "sched", "announcer", "unadmitted", "delays_ms", "routed", "peak_waiting")

    def __init__(self, index: int, sched: Scheduler, announcer: RouterAnnouncer | None) -> None:
        self.index = index
        self.sched = sched
        self.announcer = announcer
        self.unadmitted: deque[SimRequest] = deque()  # routed here, never admitted yet (FIFO)
        self.delays_ms: list[float] = []
        self.routed = 0
        self.peak_waiting = 0

    @property
    def clock_ms(self) -> float:
        return self.sched.metrics.clock_ms

    def load(self) -> int:
        """Tokens still owed to the requests waiting or running here (mambakv.sim.router)."""
        s = self.sched
        return sum(r.spec.num_prompt_tokens + r.spec.output_len - r.processed
                   for q in (s.waiting, s.running) for r in q)


class Fleet:
    """N schedulers behind a router (module docstring).

    Args:
        coords: one coordinator per instance (built with ``enable_kv_cache_events=True`` for
            the kv router).
        router: a :class:`~mambakv.sim.router.RouterKind` or its value.
        load_bound: the kv / oracle routers' bound (>= 1).
        index: the kv router's index, ``"mambakv"`` or ``"dynamo"``.
        on_finish: called with each finished request (any instance).
        check_invariants: call :meth:`check_invariants` after every step (tests; slow).
        scheduler_kwargs: passed to every Scheduler (``lag`` must stay 0); instance i gets
            ``seed + i``, so that two instances never generate the same output ids.

    Raises:
        InvalidSpecError: no instance, unknown router or index, a bound < 1, kv without events,
            instances that hash (or, for kv, announce) blocks of different sizes.
    """

    def __init__(self, coords: Sequence[KVCacheCoordinator], router: RouterKind | str, *,
                 load_bound: float = DEFAULT_LOAD_BOUND, index: str = "mambakv",
                 on_finish: Callable[[SimRequest], None] | None = None, check_invariants: bool = False,
                 **scheduler_kwargs: Any) -> None:
        if not coords:
            raise InvalidSpecError("a fleet needs at least one instance")
        try:
            self.router = RouterKind(router)
        except ValueError:
            raise InvalidSpecError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}") from None
        if not load_bound >= 1 or not math.isfinite(load_bound):
            raise InvalidSpecError(f"the load bound must be a finite number >= 1, got {load_bound!r}")
        if index not in INDEXES:
            raise InvalidSpecError(f"unknown index {index!r}; known: {', '.join(INDEXES)}")
        if scheduler_kwargs.get("lag", 0):
            raise InvalidSpecError("a fleet processes each step's results in that step (lag 0)")
        if len({c.hash_block_size for c in coords}) > 1:  # one request object is hashed for all
            raise InvalidSpecError(f"instances hash blocks of different sizes {sorted({c.hash_block_size for c in coords})}")
        self.load_bound = load_bound
        self.check = check_invariants
        self.index_name = index
        kv = self.router is RouterKind.KV
        self.instances = []
        for i, c in enumerate(coords):
            if kv and not c.block_pool.enable_kv_cache_events:
                raise InvalidSpecError("the kv router needs coordinators built with enable_kv_cache_events=True")
            kw = dict(scheduler_kwargs, seed=scheduler_kwargs.get("seed", 0) + i)  # outputs differ across instances
            sched = Scheduler(c, on_finish=on_finish, **kw)
            self.instances.append(_Instance(i, sched, RouterAnnouncer.for_coordinator(c) if kv else None))
        self.index: PrefixIndex | DynamoIndex | None = None
        self.block_size = 0  # the announced block size (kv router)
        if kv:
            sizes = {inst.announcer.block_size for inst in self.instances}  # type: ignore[union-attr]
            if len(sizes) > 1:
                raise InvalidSpecError(f"instances announce blocks of different sizes {sorted(sizes)}")
            bs = sizes.pop()
            self.block_size = bs
            self.index = PrefixIndex(len(coords)) if index == "mambakv" else DynamoIndex(len(coords), bs)
        self.assignments: list[int] = []  # instance of each routed request, in arrival order
        self.wall_s = 0.0

    # ------------------------------------------------------------------ routing
    def route(self, sreq: SimRequest) -> int:
        """The instance `sreq` goes to (module docstring of mambakv.sim.router)."""
        n = len(self.instances)
        if self.router is RouterKind.ROUND_ROBIN:
            return len(self.assignments) % n
        loads = [inst.load() for inst in self.instances]
        if self.router is RouterKind.LEAST_LOADED:
            return least_loaded(loads)
        if self.router is RouterKind.KV:
            return choose(loads, self._overlaps(sreq), load_bound=self.load_bound)
        return choose(loads, [self._probe(inst.sched.coord, sreq) for inst in self.instances],
                      load_bound=self.load_bound)

    def _overlaps(self, sreq: SimRequest) -> list[int]:
        """Overlap tokens per instance of the prompt queried as ``tokens[:N-1]``."""
        assert self.index is not None
        req, bs = sreq.request, self.block_size
        req.set_hash_block_size(self.instances[0].sched.coord.hash_block_size)  # the instances' (one config)
        full = (req.num_tokens - 1) // bs
        keys = group_block_hashes(req, bs)[:full] if isinstance(self.index, PrefixIndex) else []
        tokens = req.all_token_ids[: full * bs].tolist() if isinstance(self.index, DynamoIndex) else []
        return [b * bs for b in self.index.overlaps(keys, tokens)]

    @staticmethod
    def _probe(coord: KVCacheCoordinator, sreq: SimRequest) -> int:
        """Hit tokens on `coord`, its prefix-cache counters left as they were."""
        stats = coord.prefix_cache_stats
        saved = stats.requests, stats.queries, stats.hits
        _, hit = coord.get_computed_blocks(sreq.request)
        stats.requests, stats.queries, stats.hits = saved
        return hit

    def _submit(self, spec: RequestSpec) -> None:
        sreq = SimRequest(spec)
        i = self.route(sreq)
        inst = self.instances[i]
        self.assignments.append(i)
        sched, mt = inst.sched, inst.sched.metrics
        if sched.idle() and mt.clock_ms < spec.arrival_ms:
            mt.clock_ms = spec.arrival_ms  # an idle engine waits for the arrival (Scheduler.run)
        sched.waiting.append(sreq)
        mt.requests += 1
        inst.routed += 1
        inst.unadmitted.append(sreq)
        inst.peak_waiting = max(inst.peak_waiting, len(sched.waiting))

    # ------------------------------------------------------------------ the clock
    def _step(self, inst: _Instance) -> None:
        start = inst.clock_ms
        if not inst.sched.step():
            raise MambaKVError(f"instance {inst.index} made no progress")  # pragma: no cover
        while inst.unadmitted and inst.unadmitted[0].admitted:
            inst.delays_ms.append(start - inst.unadmitted.popleft().spec.arrival_ms)
        if inst.announcer is not None:
            routed = inst.announcer.feed(inst.sched.coord.take_events())
            if routed:
                assert self.index is not None
                self.index.apply(inst.index, routed)
        if self.check:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Assert: every coordinator and announce filter is consistent, and mambakv's index
        holds exactly what each instance announces."""
        for inst in self.instances:
            inst.sched.coord.check_invariants()
            if inst.announcer is not None:
                inst.announcer.check_invariants()
                if isinstance(self.index, PrefixIndex):
                    assert self.index.keys(inst.index) == inst.announcer.announced_keys(), inst.index

    def run(self, specs: Sequence[RequestSpec]) -> None:
        """Route and run `specs` (in arrival order) to completion."""
        t0 = _now()
        order = sorted(specs, key=lambda s: s.arrival_ms)
        i = 0
        while True:
            busy = [inst for inst in self.instances if not inst.sched.idle()]
            t = min(inst.clock_ms for inst in busy) if busy else math.inf
            if i < len(order) and order[i].arrival_ms <= t:
                self._submit(order[i])
                i += 1
            elif busy:
                self._step(min(busy, key=lambda x: (x.clock_ms, x.index)))
            else:
                break
        self.wall_s += _now() - t0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the ``ceil(q/100 x n)``-th smallest value (0.0 for none);
    p90 of [0, 34.4] is 34.4."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@dataclass
class FleetResult:
    """A finished fleet run; ``to_dict()`` is what ``mambakv fleet --json`` prints."""

    fleet: Fleet
    settings: dict[str, Any] = field(default_factory=dict)
    rejected: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        insts = self.fleet.instances
        ms = [inst.sched.metrics for inst in insts]
        prompt = sum(m.prompt_tokens for m in ms)
        cached = sum(m.cached_tokens for m in ms)
        scheduled = sum(m.scheduled_tokens for m in ms)
        delays = [d for inst in insts for d in inst.delays_ms]
        per = []
        for inst, m in zip(insts, ms):
            per.append({
                "instance": inst.index, "requests": inst.routed, "finished": m.finished,
                "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens, "hit_rate": round(m.hit_rate, 6),
                "preemptions": m.preemptions, "peak_running": m.peak_running, "peak_waiting": inst.peak_waiting,
                "scheduled_tokens": m.scheduled_tokens,
                "scheduled_share": round(m.scheduled_tokens / scheduled, 6) if scheduled else 0.0,
                "queue_delay_ms_mean": round(sum(inst.delays_ms) / len(inst.delays_ms), 3) if inst.delays_ms else 0.0,
                "steps": m.steps, "sim_clock_ms": round(m.clock_ms, 3),
                "evictions": inst.sched.coord.block_pool.num_evictions,
            })
        return {
            **self.settings,
            "requests": sum(m.requests for m in ms) + self.rejected,
            "finished": sum(m.finished for m in ms),
            "rejected": self.rejected,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
            "preemptions": sum(m.preemptions for m in ms),
            "queue_delay_ms_mean": round(sum(delays) / len(delays), 3) if delays else 0.0,
            "queue_delay_ms_p90": round(percentile(delays, 90), 3),
            "scheduled_tokens": scheduled,
            "max_scheduled_share": max(p["scheduled_share"] for p in per),
            "sim_clock_ms": round(max(m.clock_ms for m in ms), 3),
            "wall_s": round(self.fleet.wall_s, 3),
            "per_instance": per,
            **self.extra,
        }


def run_fleet(path: str | Path, model: str | Path = DEFAULT_MODEL, *, instances: int = 4,
              router: str = "round-robin", load_bound: float = DEFAULT_LOAD_BOUND, index: str = "mambakv",
              memory_gib: float = 60.0, limit: int | None = None, skip: int = 0, replay: str = "strict",
              max_num_seqs: int = 256, max_output_tokens: int | None = None,
              specs: Sequence[RequestSpec] | None = None, on_finish: Callable[[SimRequest], None] | None = None,
              num_blocks: int | None = None, layout: str = "unified", max_model_len: int | None = None,
              **scheduler_kwargs: Any) -> FleetResult:
    """A Mooncake trace (first `limit` requests after `skip` lines) through `instances`
    schedulers of `memory_gib` GiB each behind `router` (module docstring), each in `layout`
    (as ``build_kv_cache_config``; routers see the attention pages' events).

    `replay` as in :func:`~mambakv.sim.runner.run_trace`; `specs`, when given, must be the
    trace's (``load_trace(path, limit=limit, skip=skip, ...)``). `max_model_len`: the instances'
    (None: ``DEFAULT_MAX_MODEL_LEN``); a request of more prompt + output tokens is rejected
    before the run (``rejected``), as :func:`~mambakv.sim.runner.run_workload` does.

    Raises:
        InvalidSpecError: `instances` < 1, unknown router / index / replay, a bound < 1;
        TraceFormatError; ModelConfigError; BudgetTooSmallError.
    """
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise InvalidSpecError(f"need at least one instance, got {instances!r}")
    if replay not in REPLAY_MODES:
        raise InvalidSpecError(f"unknown replay {replay!r}; known: {', '.join(REPLAY_MODES)}")
    if router not in ROUTERS:
        raise InvalidSpecError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
    if specs is None:
        specs = load_trace(path, limit=limit, max_output_tokens=max_output_tokens, skip=skip)
    specs, conv, hooks = prepare_replay(specs, path, skip=skip, limit=limit, replay=replay)
    if on_finish is not None:
        hooks.append(on_finish)
    finished = chain_hooks(hooks)

    base = build_coordinator(model, memory_gib, num_blocks=num_blocks, max_num_seqs=max_num_seqs, layout=layout,
                             max_model_len=DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len)
    kv = router == RouterKind.KV.value  # the kv router reads each instance's KV events
    coords = [KVCacheCoordinator(base.kv_cache_config, max_model_len=base.max_model_len, enable_kv_cache_events=kv,
                                 max_num_seqs=max_num_seqs) for _ in range(instances)]
    limit_len = coords[0].max_model_len
    kept = [s for s in specs if s.num_prompt_tokens + s.output_len <= limit_len]
    fleet = Fleet(coords, router, load_bound=load_bound, index=index, on_finish=finished,
                  max_num_seqs=max_num_seqs, **scheduler_kwargs)
    fleet.run(kept)
    settings = {"workload": "fleet", "trace": str(path), "model": str(model), "instances": instances,
                "router": router, "load_bound": load_bound, "index": index if router == "kv" else None,
                "memory_gib": memory_gib, "layout": layout, "replay": replay, "skip": skip, "limit": limit,
                "max_num_seqs": max_num_seqs, "max_model_len": limit_len}
    result = FleetResult(fleet, settings, rejected=len(specs) - len(kept))
    if replay == "conversation":
        result.extra.update(conversation_children=conv.num_children, strict_fallbacks=conv.strict_fallbacks)
    return result
