"""A reference recurrent model and a toy engine that keeps its states in a MambaStatePool.

Model (float64, CPU, ``num_layers`` stacked layers, vocabulary ``V``)::

    x_0 = embed[token]                                          [D]
    layer l:  window = cat(conv_state, x)                       [KCONV, D]  (conv state = last KCONV-1 inputs)
              u      = sum_i w[i] * window[i]                   [D]         depthwise causal conv
              h      = a * h + Bm @ u                           [N]         diagonal linear recurrence
              x      = tanh(Cm @ h) + x                         [D]
    next token = argmax(head @ x)                               greedy readout over V

The engine runs one token at a time with the same torch calls whatever the chunking, so a
state computed through the prefix cache and a state computed from scratch are bit-identical
exactly when the library handed the right state block at every step.

``Engine`` drives a KVCacheCoordinator as docs/engine-integration.md says: per step allocate,
then the zero plan and copy plan on the pool, then the forward (reads the running block, writes
the running block and, with drafts, scratch block ``j - 1`` for draft ``j``), then (``lag``
steps later) accept_drafts and its copies, append tokens, retire, free.  ``lag=1`` plans step
t+1 before step t's forward runs and its results are processed (async scheduling without
drafts): the device queue still runs copies(t), forward(t), copies(t+1), ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mambakv import KVCacheCoordinator, MambaManager, MambaStatePool, Request

V, D, N, KCONV = 13, 4, 6, 4  # vocabulary, channels, SSM state size, conv kernel
CONV_SHAPE, SSM_SHAPE = (KCONV - 1, D), (N,)

States = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (conv [KCONV-1, D], ssm [N])


class RefModel:
    """Fixed random weights (seeded); ``step`` is pure: (token, states) -> (greedy next, states)."""

    def __init__(self, num_layers: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1

        self.num_layers = num_layers
        self.embed, self.head = rand(V, D), rand(V, D)
        # decay in [0.9, 0.99]: a state reaches far, so a leaked state changes the outputs
        self.layers = [(rand(KCONV, D), 0.945 + 0.045 * rand(N), rand(N, D), rand(D, N))
                       for _ in range(num_layers)]

    def zero_states(self) -> States:
        return [(torch.zeros(CONV_SHAPE, dtype=torch.float64), torch.zeros(SSM_SHAPE, dtype=torch.float64))
                for _ in range(self.num_layers)]

    def step(self, token: int, states: States) -> tuple[int, States]:
        x = self.embed[token]
        out: States = []
        for (w, a, bm, cm), (conv, ssm) in zip(self.layers, states):
            window = torch.cat([conv, x[None]], 0)
            u = (window * w).sum(0)
            ssm = a * ssm + bm @ u
            x = torch.tanh(cm @ ssm) + x
            out.append((window[1:].clone(), ssm))
        return int(torch.argmax(self.head @ x)), out


def reference(model: RefModel, prompt: list[int], num_out: int) -> tuple[list[int], list[States]]:
    """From-scratch greedy run, no cache: (the ``num_out`` greedy tokens, states[p] = state after
    p tokens of ``prompt + outputs`` for p = 0 .. len(prompt) + num_out - 1)."""
    states, seq, outs = model.zero_states(), list(prompt), []
    trajectory = [states]
    p = 0
    while len(outs) < num_out:
        nxt, states = model.step(seq[p], states)
        trajectory.append(states)
        p += 1
        if p == len(seq):
            outs.append(nxt)
            seq.append(nxt)
    return outs, trajectory


def states_equal(a: States, b: States) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def prefill_chunk(num_prompt: int, done: int, budget: int, bs: int) -> int:
    """Next prefill chunk (docs/engine-integration.md): end on a Mamba boundary, stop once at
    ``(P - 1) // B * B`` so that a repeat of the prompt finds a state there."""
    end, stop = min(num_prompt, done + budget), (num_prompt - 1) // bs * bs
    if done < stop < end:
        end = stop
    return end - done if end == num_prompt else end // bs * bs - done


@dataclass
class Seq:
    req: Request
    arrival: int
    max_tokens: int
    drafter: Callable[[Seq, int], list[int]] | None = None
    admitted: bool = False
    busy: bool = False            # a step that samples is in flight
    done: bool = False
    hit: int = -1
    out: list[int] = field(default_factory=list)
    verify_log: list[tuple[int, int]] = field(default_factory=list)  # (computed before, accepted)
    planned: list[int] = field(default_factory=list)    # the drafter's intended acceptance counts
    final_states: States | None = None   # running block's state when it finished
    final_table: list[int] = field(default_factory=list)   # its Mamba table then


@dataclass
class Entry:
    seq: Seq
    start: int
    tokens: list[int]
    num_drafts: int
    running: int
    scratch: list[int]
    samples: list[int] = field(default_factory=list)


class Engine:
    """Toy engine over one coordinator and the MambaStatePool of its (single) Mamba group."""

    def __init__(self, coord: KVCacheCoordinator, pool: MambaStatePool, model: RefModel, *,
                 budget: int = 32, lag: int = 0, num_drafts: int = 0, apply_zero_plan: bool = True) -> None:
        assert lag in (0, 1) and not (lag and num_drafts), "exact states: drafts only without lag"
        self.coord, self.pool, self.model = coord, pool, model
        (self.gid,) = [i for i, m in enumerate(coord.managers) if isinstance(m, MambaManager)]
        self.bs = coord.managers[self.gid].block_size
        self.budget, self.lag, self.K, self.apply_zero_plan = budget, lag, num_drafts, apply_zero_plan
        self.seqs: list[Seq] = []
        self.written: set[int] = set()   # every block id the forward wrote
        self.zeroed: list[int] = []      # every zero plan entry, in order
        self.entries: list[Entry] = []   # every scheduled forward, in order

    def add(self, rid: str, prompt: list[int], max_tokens: int, arrival: int = 0, drafter=None) -> Seq:
        seq = Seq(Request(rid, prompt, max_tokens=max_tokens), arrival, max_tokens, drafter)
        self.seqs.append(seq)
        return seq

    # ------------------------------------------------------------------ scheduling (CPU)
    def _schedule(self, t: int) -> tuple[list[Entry], list[tuple[int, int]], list[int]]:
        coord, entries = self.coord, []
        coord.new_step()
        for seq in self.seqs:
            if seq.done or seq.busy or seq.arrival > t:
                continue
            req, hit, blocks = seq.req, 0, None
            if not seq.admitted:
                blocks, hit = coord.get_computed_blocks(req)
                seq.hit, seq.admitted = hit, True
            c = req.num_computed_tokens + hit
            drafts: list[int] = []
            if c < req.num_prompt_tokens:
                n = prefill_chunk(req.num_prompt_tokens, c, self.budget, self.bs)
                tokens = [int(x) for x in req.all_token_ids[c : c + n]]
            else:
                assert c == req.num_tokens - 1
                drafts = seq.drafter(seq, c) if self.K else []
                assert len(drafts) == self.K
                tokens, n = [int(req.all_token_ids[c])] + drafts, 1 + self.K
            assert coord.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks) is not None
            req.num_computed_tokens = c + n
            seq.busy = c + n >= req.num_prompt_tokens      # this step samples: wait for it
            table = coord.get_block_ids(req.request_id)[self.gid]
            running = -(-(c + n) // self.bs) - 1
            assert len(table) == running + 1 + coord.managers[self.gid].num_speculative_blocks
            entries.append(Entry(seq, c, tokens, len(drafts), table[running], table[running + 1 :]))
        self.entries.extend(entries)
        zeros = coord.take_zero_plan().get(self.gid, [])
        copies = coord.take_copy_plan().get(self.gid, [])
        coord.check_invariants()
        return entries, copies, zeros

    # ------------------------------------------------------------------ device
    def _load(self, block: int) -> States:
        p = self.pool
        return [(p.conv_state(i)[block].clone(), p.ssm_state(i)[block].clone()) for i in range(p.num_layers)]

    def _store(self, block: int, states: States) -> None:
        self.written.add(block)
        for i, (conv, ssm) in enumerate(states):
            self.pool.conv_state(i)[block] = conv
            self.pool.ssm_state(i)[block] = ssm

    def _execute(self, work) -> None:
        entries, copies, zeros = work
        self.zeroed.extend(zeros)
        if self.apply_zero_plan:
            self.pool.zero_(zeros)
        self.pool.copy_(copies)
        for e in entries:
            states = self._load(e.running)
            for i, tok in enumerate(e.tokens):
                nxt, states = self.model.step(tok, states)
                e.samples.append(nxt)
                if e.num_drafts and i == 0:
                    self._store(e.running, states)            # state after the first token
                elif e.num_drafts:
                    self._store(e.scratch[i - 1], states)     # state after draft i
            if not e.num_drafts:
                self._store(e.running, states)
        self.pool.check_invariants()

    # ------------------------------------------------------------------ results (CPU)
    def _process(self, work) -> None:
        coord = self.coord
        for e in work[0]:
            seq, req = e.seq, e.seq.req
            end = e.start + len(e.tokens)
            if e.num_drafts:
                drafts, j = e.tokens[1:], 0
                while j < e.num_drafts and drafts[j] == e.samples[j]:
                    j += 1
                self.pool.copy_(coord.accept_drafts(req.request_id, j).get(self.gid, []))
                seq.verify_log.append((e.start, j))
                new, end = drafts[:j] + [e.samples[j]], e.start + 1 + j
                req.num_computed_tokens = end
            else:
                new = [e.samples[-1]] if end >= req.num_prompt_tokens else []
            if new:
                req.append_output_token_ids(new)
                seq.out.extend(new)
                seq.busy = False
            coord.retire(req.request_id, end)
            if len(seq.out) >= seq.max_tokens:
                seq.final_states, seq.done = self._load(e.running), True
                seq.final_table = coord.get_block_ids(req.request_id)[self.gid]
                coord.free(req.request_id)
        coord.check_invariants()
        self.pool.check_invariants()

    def run(self, max_steps: int = 500) -> None:
        pending = []
        for t in range(max_steps):
            if all(s.done for s in self.seqs):
                break
            pending.append(self._schedule(t))
            while len(pending) > self.lag:       # lag 1: step t-1 runs after step t is planned
                work = pending.pop(0)
                self._execute(work)
                self._process(work)
        else:
            raise AssertionError("engine did not finish")
        for work in pending:
            self._execute(work)
            self._process(work)
