"""The hypothesis state machine of the fuzzer: picks FuzzEngine actions and their arguments.

One example = one drawn config (fuzz_model.fuzz_configs) and up to ``stateful_step_count``
rules::

    add_request -> lookup -> admit ----------> schedule -> execute -> settle -> ... -> finish
                      \\-> abort (dropped)          (a batch of steps,          \\-> preempt
                                                    run on the device)              (re-queued)
    anytime: evict, reset_prefix_cache (nothing running), drain (everything ends)
    engine_step: one whole scheduler iteration (settle, schedule, admit, execute) from a seed

Each rule is also a precondition-guarded single action, so that hypothesis interleaves them
freely (a request freed between its allocate and its execute, a lookup gone stale while other
requests allocate, ...). ``engine_step`` keeps examples deep when swarm testing switches rules
off. After every rule: ``FuzzEngine.check()``.
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.property.fuzz_engine import STATS, FuzzEngine
from tests.property.fuzz_model import ALPHABET, REQUEST_IDS, fuzz_configs

__all__ = ["KVFuzzMachine", "STATS", "active_settings", "teeth_settings"]

idx = st.integers(0, 7)
tokens = st.lists(st.sampled_from(ALPHABET), max_size=6)


def active_settings(**overrides) -> settings:
    """The profile registered in conftest.py: ``MAMBAKV_FUZZ=deep`` selects the long one."""
    name = "mambakv-deep" if os.environ.get("MAMBAKV_FUZZ") == "deep" else "mambakv-ci"
    return settings(settings.get_profile(name), **overrides)


def teeth_settings(max_examples: int) -> settings:
    """Deterministic, no shrinking, first failure only: for the tests that plant a bug."""
    return settings(max_examples=max_examples, stateful_step_count=60, deadline=None, derandomize=True,
                    database=None, phases=[Phase.generate], print_blob=False, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


class KVFuzzMachine(RuleBasedStateMachine):
    force_mamba: bool | None = None  # subclasses (teeth) may insist on a Mamba group
    decoupled = False  # subclasses may run the decoupled layout (pages and slots over superblocks)

    def __init__(self) -> None:
        super().__init__()
        self.e: FuzzEngine | None = None

    def _on(self) -> bool:
        return self.e is not None

    @initialize(data=st.data(), first=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40), tokens,
                                                         st.integers(1, 8)), min_size=1, max_size=2))
    def setup(self, data, first) -> None:
        self.e = FuzzEngine(data.draw(fuzz_configs(mamba=self.force_mamba, decoupled=self.decoupled), label="config"))
        for args in first:
            self.e.add_request(*args)

    # ------------------------------------------------------------------ admission
    @precondition(lambda self: self._on() and len(self.e.reqs) < len(REQUEST_IDS)
                  and sum(not sr.running for sr in self.e.reqs.values()) < 2)
    @rule(src=st.integers(0, 30), cut=st.integers(0, 40), tail=tokens, max_tokens=st.integers(1, 8))
    def add_request(self, src: int, cut: int, tail: list[int], max_tokens: int) -> None:
        self.e.add_request(src, cut, tail, max_tokens)

    @precondition(lambda self: self._on() and self.e.any(lambda sr: not sr.running and sr.pending_hit is None))
    @rule(i=idx)
    def lookup(self, i: int) -> None:
        self.e.lookup(self.e.pick(i, lambda sr: not sr.running and sr.pending_hit is None))

    @precondition(lambda self: self._on() and self.e.any(lambda sr: not sr.running))
    @rule(i=idx, how=st.integers(0, 2), frac=st.integers(0, 60))
    def admit(self, i: int, how: int, frac: int) -> None:
        self.e.admit(self.e.pick(i, lambda sr: not sr.running), how, frac)

    @precondition(lambda self: self._on() and self.e.any(lambda sr: sr.pending_hit is not None))
    @rule(i=idx)
    def abort(self, i: int) -> None:
        self.e.abort(self.e.pick(i, lambda sr: sr.pending_hit is not None))

    # ------------------------------------------------------------------ steps
    @precondition(lambda self: self._on() and self.e.any(self.e.can_schedule))
    @rule(i=idx, how=st.integers(0, 2), frac=st.integers(0, 60), k=st.integers(0, 3), a=st.integers(0, 3),
          drafts=st.tuples(*[st.sampled_from(ALPHABET)] * 3), bonus=st.sampled_from(ALPHABET),
          lookahead=st.integers(0, 2))
    def schedule(self, i, how, frac, k, a, drafts, bonus, lookahead) -> None:
        self.e.schedule(self.e.pick(i, self.e.can_schedule), how, frac, k, a, drafts, bonus, lookahead)

    @precondition(lambda self: self._on() and self.e.batch)
    @rule()
    def execute(self) -> None:
        self.e.execute()

    @precondition(lambda self: self._on() and self.e.any(lambda sr: sr.running and sr.unsettled))
    @rule(i=idx, keep=st.integers(0, 2), again=st.booleans())
    def settle(self, i: int, keep: int, again: bool) -> None:
        self.e.settle(self.e.pick(i, lambda sr: sr.running and sr.unsettled), keep, again)

    @precondition(lambda self: self._on())
    @rule(seed=st.integers(0, 2**32 - 1))
    def engine_step(self, seed: int) -> None:
        """One scheduler iteration with seeded choices: retire what came back (keeping up to
        ``max_lag`` steps in flight), schedule running requests (preempting a victim when the
        pool is short), look up and admit a waiting one, run the batch."""
        e, rnd = self.e, random.Random(seed)
        for sr in [sr for _, sr in sorted(e.reqs.items()) if sr.running and sr.unsettled]:
            lag = e.cfg.max_lag if rnd.random() < 0.7 else 0
            if len(sr.unsettled) > lag:
                e.settle(sr, min(lag, len(sr.unsettled) - 1), rnd.random() < 0.1)
        for sr in [sr for _, sr in sorted(e.reqs.items()) if e.can_schedule(sr)]:
            if sr.rid not in e.reqs or not e.can_schedule(sr) or rnd.random() < 0.15:
                continue
            args = (rnd.randrange(3), rnd.randrange(61), rnd.randrange(4), rnd.randrange(4),
                    tuple(rnd.choice(ALPHABET) for _ in range(3)), rnd.choice(ALPHABET), rnd.randrange(3))
            if not e.schedule(sr, *args) and rnd.random() < 0.5:
                victims = [v for _, v in sorted(e.reqs.items()) if v.running and v is not sr]
                if victims:
                    e.preempt(victims[-1])
        waiting = [sr for _, sr in sorted(e.reqs.items()) if not sr.running]
        if waiting:
            sr = rnd.choice(waiting)
            if sr.pending_hit is None and rnd.random() < 0.8:
                e.lookup(sr)
            e.admit(sr, rnd.randrange(3), rnd.randrange(61))
        if e.batch and rnd.random() < 0.9:
            e.execute()
        for sr in [sr for _, sr in sorted(e.reqs.items()) if sr.running and e.done(sr) and sr.scheduled is None]:
            if rnd.random() < 0.5:
                e.finish(sr)

    # ------------------------------------------------------------------ endings
    @precondition(lambda self: self._on() and self.e.any(lambda sr: sr.running and self.e.done(sr)))
    @rule(i=idx)
    def finish(self, i: int) -> None:
        self.e.finish(self.e.pick(i, lambda sr: sr.running and self.e.done(sr)))

    @precondition(lambda self: self._on() and self.e.any(lambda sr: sr.running) and self.e.pressure())
    @rule(i=idx)
    def preempt(self, i: int) -> None:
        self.e.preempt(self.e.pick(i, lambda sr: sr.running))

    @precondition(lambda self: self._on() and self.e.any(lambda sr: sr.running)
                  and all(sr.running and self.e.done(sr) for sr in self.e.reqs.values()))
    @rule()
    def drain(self) -> None:
        self.e.drain()

    # ------------------------------------------------------------------ cache maintenance
    @precondition(lambda self: self._on() and self.e.hashed() and not self.e.any(lambda sr: sr.running))
    @rule()
    def reset_prefix_cache(self) -> None:
        self.e.reset_prefix_cache()

    @precondition(lambda self: self._on() and self.e.hashed())
    @rule(ids=st.lists(st.integers(0, 60), min_size=1, max_size=3))
    def evict(self, ids: list[int]) -> None:
        self.e.evict(ids)

    @invariant()
    def consistent(self) -> None:
        if self.e is not None:
            self.e.check()
