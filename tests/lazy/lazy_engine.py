"""A toy engine for ALIGN_LAZY with async lag 1 *and* drafts (tests/ref_layer.py's engine
refuses that mix): the reference recurrent model of tests/ref_layer.py keeps its states in a
MambaStatePool whose rows are the blocks the coordinator names through ``get_state_plan``.

Order (lag 1, vLLM-style async scheduling)::

    plan(0) plan(1) run(0) results(0) plan(2) run(1) results(1) plan(3) ...

plan(t): allocate every active request (prefill chunk, or a decode step of 1 + K tokens with
an optimistic computed count and ``num_draft_tokens=K``), take the zero / copy plans and the
checkpoint writes. run(t): copies, then the forward from the request's settled position (the
drafter proposes then; steps of a request finished meanwhile still run: their writes are what
the finish rules guard against). results(t): verify, ``accept_drafts`` (+ its copies), append,
``retire``, ``free`` at the target length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mambakv import KVCacheCoordinator, MambaStatePool, Request
from tests.ref_layer import RefModel, States, V, prefill_chunk


@dataclass
class LSeq:
    req: Request
    target: int                       # finish once this many tokens are processed
    truth: list[int]                  # the from-scratch greedy sequence (prompt + outputs)
    accept: Callable[[int], int]      # step start position -> drafts the drafter gets right
    K: int
    scheduled: int = 0                # prefill tokens scheduled so far
    settled: int = 0
    hit: int = -1
    done: bool = False
    final_states: States | None = None


@dataclass
class Work:
    seq: LSeq
    prefill: tuple[int, int] | None   # (start, end) of a prefill chunk
    working: int
    scratch: tuple[int, ...]
    target: tuple[int, int] | None = None   # (block, position) the forward also writes
    start: int = -1
    tokens: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)


class LazyEngine:
    def __init__(self, coord: KVCacheCoordinator, pool: MambaStatePool, model: RefModel, *, budget: int = 512,
                 lag: int = 1) -> None:
        self.coord, self.pool, self.model, self.budget, self.lag = coord, pool, model, budget, lag
        (self.gid,) = [m.kv_cache_group_id for m in coord.mamba_managers]
        self.bs = coord.managers[self.gid].block_size
        self.seqs: list[LSeq] = []
        self.written: set[int] = set()

    def add(self, rid: str, truth: list[int], prompt_len: int, target: int, K: int,
            accept: Callable[[int], int] = lambda start: 0) -> LSeq:
        seq = LSeq(Request(rid, truth[:prompt_len]), target, truth, accept, K)
        self.seqs.append(seq)
        return seq

    # ------------------------------------------------------------------ CPU: plan
    def _plan(self) -> tuple[list[Work], list, list, dict]:
        coord, works = self.coord, []
        coord.new_step()
        for seq in self.seqs:
            if seq.done:
                continue
            req, blocks, hit = seq.req, None, 0
            if seq.hit < 0:
                blocks, hit = coord.get_computed_blocks(req)
                seq.hit = seq.scheduled = seq.settled = hit
            P = req.num_prompt_tokens
            if seq.scheduled < P:
                n = prefill_chunk(P, seq.scheduled, self.budget, self.bs)
                assert coord.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks) is not None
                prefill = (seq.scheduled, seq.scheduled + n)
                seq.scheduled += n
            else:
                assert coord.allocate(req, 1 + seq.K, num_draft_tokens=seq.K) is not None
                n, prefill = 1 + seq.K, None
            req.num_computed_tokens += hit + n
            plan = coord.get_state_plan(req.request_id).get(self.gid)
            if plan is None:  # eager group (drafts-off control): the running slot of the table
                table = coord.get_block_ids(req.request_id)[self.gid]
                running = -(-req.num_computed_tokens // self.bs) - 1
                works.append(Work(seq, prefill, table[running], tuple(table[running + 1 :])))
            else:
                works.append(Work(seq, prefill, plan.working_block_id, plan.scratch_block_ids))
        listed = coord.take_checkpoint_writes().get(self.gid, [])
        writes = {}
        for w in works:  # the boundary write: a block other than the running and scratch blocks
            rid, own = w.seq.req.request_id, {w.working, *w.scratch[: w.seq.K]}
            writes[rid] = w.target = next(((b, p) for r, b, p in listed if r == rid and b not in own), None)
        zeros = coord.take_zero_plan().get(self.gid, [])
        copies = coord.take_copy_plan().get(self.gid, [])
        coord.check_invariants()
        return works, zeros, copies, writes

    # ------------------------------------------------------------------ device
    def _load(self, block: int) -> States:
        p = self.pool
        return [(p.conv_state(i)[block].clone(), p.ssm_state(i)[block].clone()) for i in range(p.num_layers)]

    def _store(self, block: int, states: States) -> None:
        assert block != 0
        self.written.add(block)
        for i, (conv, ssm) in enumerate(states):
            self.pool.conv_state(i)[block] = conv
            self.pool.ssm_state(i)[block] = ssm

    def _run(self, work) -> None:
        works, zeros, copies, _ = work
        self.pool.zero_(zeros)
        self.pool.copy_(copies)
        for w in works:
            seq = w.seq
            if w.prefill is not None:
                w.start, end = w.prefill
                w.tokens = seq.truth[w.start : end]
            else:  # decode: starts where the request's last step settled (known only now)
                w.start = seq.settled
                m = seq.accept(w.start)
                true = seq.truth[w.start + 1 : w.start + 1 + seq.K]
                w.tokens = [seq.truth[w.start]] + true[:m] + [(t + 1) % V for t in true[m:]]
            states = self._load(w.working)
            for i, tok in enumerate(w.tokens):
                nxt, states = self.model.step(tok, states)
                w.samples.append(nxt)
                pos = w.start + i + 1
                if w.target is not None and pos == w.target[1]:
                    self._store(w.target[0], states)      # the boundary state, drafts included
                if w.prefill is None and i > 0:
                    self._store(w.scratch[i - 1], states)  # state after draft i
                elif w.prefill is None or i == len(w.tokens) - 1:
                    self._store(w.working, states)
        self.pool.check_invariants()

    # ------------------------------------------------------------------ CPU: results
    def _results(self, work) -> None:
        coord = self.coord
        for w in work[0]:
            seq, req = w.seq, w.seq.req
            if seq.done:
                continue  # a step planned before the request finished: results dropped
            rid = req.request_id
            if w.prefill is not None:
                seq.settled = w.prefill[1]
                new = [w.samples[-1]] if seq.settled == req.num_prompt_tokens else []
            else:
                a = 0
                while a < seq.K and w.tokens[1 + a] == w.samples[a]:
                    a += 1
                self.pool.copy_(coord.accept_drafts(rid, a).get(self.gid, []))
                req.num_computed_tokens -= seq.K - a
                seq.settled = w.start + 1 + a
                new = w.tokens[1 : 1 + a] + [w.samples[a]]
            new = new[: max(0, seq.target - req.num_tokens)]
            if new:
                req.append_output_token_ids(new)
            coord.retire(rid, seq.settled)
            if seq.settled >= seq.target:
                assert seq.settled == seq.target and req.num_tokens == seq.target
                assert [int(x) for x in req.all_token_ids] == seq.truth[: seq.target]
                seq.final_states = self._load(w.working)
                seq.done = True
                coord.free(rid)
        coord.check_invariants()

    def run(self, max_steps: int = 5000) -> None:
        pending = []
        for _ in range(max_steps):
            if all(s.done for s in self.seqs):
                break
            pending.append(self._plan())
            while len(pending) > self.lag:
                work = pending.pop(0)
                self._run(work)
                self._results(work)
        else:
            raise AssertionError("engine did not finish")
        for work in pending:  # steps still in flight run on the device
            self._run(work)
            self._results(work)
