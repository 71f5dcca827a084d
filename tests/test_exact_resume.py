"""Cached Mamba states resume exactly (issue 5, DESIGN.md 5.1 and 7).

A reference recurrent model (tests/ref_layer.py: causal depthwise conv + diagonal linear
recurrence + greedy readout, float64 on CPU) keeps its states in a MambaStatePool whose rows
are the blocks the coordinator hands out. Every request's greedy tokens and final state must
equal a from-scratch run without any cache BIT FOR BIT (torch.equal), and every state the
library publishes must be the state after exactly its block boundary:

1. synchronous, no drafts: hits on prefill and decode states;
2. spec decode (K = 3 drafts) under synchronous scheduling: scratch blocks and accept_drafts;
3. async lag of one step without drafts (pipelined prefill): same results as synchronous;
4. a reused block does not leak its previous owner's state (zero plan), with a negative control;
and row 0 (the null block) is never written.
"""

from __future__ import annotations

import pytest
import torch

from mambakv import FullAttentionSpec, KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, MambaSpec, MambaStatePool
from mambakv.groups.base import group_block_hashes
from tests.ref_layer import CONV_SHAPE, SSM_SHAPE, Engine, RefModel, V, reference, states_equal

BS = 16          # Mamba block size (tokens between states)
ATTN_BS = 8      # full-attention block size: hits align to lcm(8, 16) = 16


def setup(*, nspec: int = 0, hybrid: bool = True, num_blocks: int = 128, **kw):
    mamba = MambaSpec(BS, (CONV_SHAPE, SSM_SHAPE), ("float64", "float64"), mode="align",
                      num_speculative_blocks=nspec)
    groups = [KVCacheGroupSpec(["attn.0"], FullAttentionSpec(ATTN_BS, 1, 8, "float16"))] if hybrid else []
    groups.append(KVCacheGroupSpec(["mamba.0", "mamba.1"], mamba))
    coord = KVCacheCoordinator(KVCacheConfig(num_blocks, groups), max_model_len=512)
    pool = MambaStatePool(mamba, num_layers=2, num_blocks=num_blocks, device="cpu")
    return Engine(coord, pool, MODEL, num_drafts=nspec, **kw)


MODEL = RefModel(num_layers=2, seed=0)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(V, (n,), generator=g)]


def full_seq(seq) -> list[int]:
    return [int(x) for x in seq.req.all_token_ids]


def check_exact(engine: Engine, extra: int = 0) -> dict[str, list[int]]:
    """Every request: outputs == from-scratch greedy, final state == from-scratch state after
    the same tokens, and each Mamba state published under its keys == the state after exactly
    (slot + 1) * BS of its tokens. Returns the published positions per request."""
    pool, gid = engine.pool, engine.gid
    published = {}
    for seq in engine.seqs:
        req = seq.req
        assert seq.done and len(seq.out) >= seq.max_tokens
        want, traj = reference(MODEL, full_seq(seq)[: req.num_prompt_tokens], len(seq.out) + extra)
        assert seq.out == want[: len(seq.out)], req.request_id
        assert states_equal(seq.final_states, traj[req.num_computed_tokens]), req.request_id
        published[req.request_id] = []
        for slot, key in enumerate(group_block_hashes(req, BS)):
            cached = engine.coord.block_pool.get_cached_block(key, [gid])
            if cached is None:
                continue
            pos = (slot + 1) * BS
            published[req.request_id].append(pos)
            got = [(pool.conv_state(i)[cached[0].block_id], pool.ssm_state(i)[cached[0].block_id])
                   for i in range(pool.num_layers)]
            assert states_equal(got, traj[pos]), (req.request_id, pos)
    assert 0 not in engine.written
    return published


# ---------------------------------------------------------------- 1. synchronous, no drafts
A_PROMPT = tokens(70, seed=1)


def sync_workload(engine: Engine) -> None:
    """A: 70-token prompt, 30 outputs. Prefill (budget 32, stop at (70 - 1) // 16 * 16 = 64):
    chunks end at 32, 64, 70 -> states published at 32 and 64 (70 is off a boundary); decode
    computes tokens 71..99 and publishes 80 and 96 once processed.
    B (step 5, A decoding): A's first 50 tokens + 10 others: blocks of 16 match up to 48, the
    only state <= 48 is at 32 -> hit 32.
    C (step 40, A finished): A's first 90 tokens (prompt + 20 outputs) + 6 others = 96 tokens,
    cap 95 -> 80; block [64, 80) matches and holds the decode state at 80 -> hit 80.
    D (step 40): A's prompt again: cap 69 -> 64, the prefill stop state -> hit 64."""
    a = engine.add("A", A_PROMPT, 30)
    engine.run()
    assert a.done
    s = full_seq(a)
    engine.add("B", A_PROMPT[:50] + [(t + 1) % V for t in A_PROMPT[50:60]], 8, arrival=0)
    engine.add("C", s[:90] + [(t + 5) % V for t in s[90:96]], 8, arrival=0)
    engine.add("D", list(A_PROMPT), 12, arrival=0)
    engine.run()


def sync_workload_concurrent(engine: Engine) -> None:
    """As `sync_workload`, but B arrives at step 5 while A decodes (A: prefill steps 0-2)."""
    engine.add("A", A_PROMPT, 30)
    engine.add("B", A_PROMPT[:50] + [(t + 1) % V for t in A_PROMPT[50:60]], 8, arrival=5)
    engine.run()


def test_sync_hits_resume_exactly():
    engine = setup()
    sync_workload(engine)
    assert {s.req.request_id: s.hit for s in engine.seqs} == {"A": 0, "B": 32, "C": 80, "D": 64}
    published = check_exact(engine)
    # under A's keys: A's 32, 64 (prefill), 80, 96 (decode), and 48 from B, which shares A's
    # first 50 tokens and stops its prefill at (60 - 1) // 16 * 16 = 48
    assert published["A"] == [32, 48, 64, 80, 96]


def test_sync_concurrent_hit_while_decoding():
    engine = setup()
    sync_workload_concurrent(engine)
    assert [s.hit for s in engine.seqs] == [0, 32]
    check_exact(engine)


def test_hits_actually_copy_state():
    """Teeth: the hit path must depend on the copy plan. Skipping the pre-forward copies makes
    B resume from a zeroed/foreign running block, and its outputs diverge."""
    engine = setup()
    engine.add("A", A_PROMPT, 30)
    engine.run()
    b = engine.add("B", A_PROMPT[:50] + [(t + 1) % V for t in A_PROMPT[50:60]], 8)
    copy = engine.pool.copy_
    engine.pool.copy_ = lambda pairs: None
    engine.run()
    engine.pool.copy_ = copy
    assert b.hit == 32
    _, traj = reference(MODEL, b.req.all_token_ids[:60].tolist(), len(b.out))
    assert not states_equal(b.final_states, traj[b.req.num_computed_tokens])


# ---------------------------------------------------------------- 2. spec decode, synchronous
K = 3
CYCLE = (0, 2, 1, 3, 1, 0)


def oracle_drafter(truth: list[int]):
    """Proposes the true greedy continuation for the first m drafts and a wrong token after:
    m = K when the verify window c+1 .. c+1+K ends on a block boundary (all accepted: the state
    at that boundary is published); else, when reachable, the m that makes the next window end
    on one (next c = c+1+m with c+1+m+1+K = 0 mod BS); else a fixed cycle. From any c the
    window reaches the next boundary (steps advance 1..4, the landing zone is 4 wide), so every
    boundary after the prefill gets a state, except 80: that window (c = 76) accepts K - 1, so
    the request then holds 80 tokens (the key of slot 4 exists) while slot 4's block holds the
    state after 79."""
    count = [0]

    def draft(seq, c):
        if c + 1 + K == 80:
            m = K - 1  # the state after 79 lands in slot 4 (boundary 80): it must not be published
        elif (c + 1 + K) % BS == 0:
            m = K
        elif (-(c + 2 + K)) % BS <= K:
            m = (-(c + 2 + K)) % BS
        else:
            m = CYCLE[count[0] % len(CYCLE)]
        count[0] += 1
        seq.planned.append(m)
        true = truth[c + 1 : c + 1 + K]
        return true[:m] + [(t + 1) % V for t in true[m:]]
    return draft


def spec_workload(engine: Engine):
    """A: 72-token prompt, chunks end at 32, 64 (the stop (72 - 1) // 16 * 16), 72; the chunk
    32 -> 64 moves the running state from slot 1 to slot 3, so slot 2's scratch block is
    relocated to the table end. Then >= 60 outputs with 3 drafts per verify: first window
    c = 72 (73..76) accepts 3 to land on c = 76, whose window ends on 80 but accepts 2 (no
    state at 80), then states at 96, 112, ... C (after A): A's first 100 tokens + 6 others:
    cap 105 -> 96, blocks match up to 96 -> hit 96, a decode-published state."""
    prompt = tokens(72, seed=2)
    truth, _ = reference(MODEL, prompt, 80)
    a = engine.add("A", prompt, 60, drafter=oracle_drafter(prompt + truth))
    engine.run()
    s = full_seq(a)
    c_prompt = s[:100] + [(t + 3) % V for t in s[100:106]]
    c_truth, _ = reference(MODEL, c_prompt, 30)
    c = engine.add("C", c_prompt, 20, drafter=oracle_drafter(c_prompt + c_truth))
    engine.run()
    return a, c


def test_spec_decode_resumes_exactly():
    engine = setup(nspec=K)
    a, c = spec_workload(engine)
    published = check_exact(engine, extra=K + 1)
    # acceptance varies and the verify found exactly the planned number of correct drafts
    assert [j for _, j in a.verify_log] == a.planned
    assert {j for _, j in a.verify_log} == {0, 1, 2, 3}
    # states published during decode: full acceptance with the window ending on a boundary
    by_decode = sorted(c0 + 1 + K for c0, j in a.verify_log if j == K and (c0 + 1 + K) % BS == 0)
    assert a.verify_log[:2] == [(72, K), (76, K - 1)] and by_decode[:2] == [96, 112]
    assert published["A"] == [32, 64] + [p for p in by_decode if p <= a.req.num_tokens]
    assert c.hit == 96
    # relocation (chunk 32 -> 64): the new running block was step 1's second scratch block
    # (slot 3), and step 1's first scratch block (slot 2) moved to the end, a scratch again
    e1, e2 = [e for e in engine.entries if e.seq is a][:2]
    assert e2.running == e1.scratch[1] and e1.scratch[0] in e2.scratch
    # the final greedy sequence is plain greedy decoding (checked against the reference above)
    plain = setup()
    plain.add("A", a.req.all_token_ids[:72].tolist(), len(a.out))
    plain.run()
    assert plain.seqs[0].out == a.out


# ---------------------------------------------------------------- 3. async lag, no drafts
def async_workload(engine: Engine) -> None:
    """A: 100-token prompt, budget 32 -> chunks end at 32, 64, 96, 100, pipelined under lag.
    B (step 1, A's prefill in flight): A's first 40 tokens + 20 others. Synchronous: step 0 is
    processed, the state at 32 is published -> hit 32. Lag 1: step 0's results are not back
    when B is admitted, nothing is published -> hit 0 (zero plan).
    C (step 3): A's first 70 tokens + 10 others, blocks match up to 64. Synchronous: A processed
    96 -> states at 32, 64, 96 -> hit 64. Lag 1: processed 64 -> states at 32, 64 -> hit 64.
    D (step 2): like C but 75 tokens. Synchronous: 64 processed -> hit 64. Lag 1: only step 0
    is processed (step 1, which writes the state at 64, is planned but has not run) -> hit 32."""
    a_prompt = tokens(100, seed=3)
    engine.add("A", a_prompt, 20)
    engine.add("B", a_prompt[:40] + [(t + 2) % V for t in a_prompt[40:60]], 20, arrival=1)
    engine.add("C", a_prompt[:70] + [(t + 4) % V for t in a_prompt[70:80]], 10, arrival=3)
    engine.add("D", a_prompt[:70] + [(t + 6) % V for t in a_prompt[70:75]], 6, arrival=2)
    engine.run()


def test_async_lag_matches_sync():
    runs = {}
    for lag in (0, 1):
        engine = setup(lag=lag)
        async_workload(engine)
        check_exact(engine)
        runs[lag] = engine
    assert [s.hit for s in runs[0].seqs] == [0, 32, 64, 64]
    assert [s.hit for s in runs[1].seqs] == [0, 0, 64, 32]
    for s0, s1 in zip(runs[0].seqs, runs[1].seqs):
        assert s0.out == s1.out and states_equal(s0.final_states, s1.final_states)
    # and the sync-workload (hits on decode states) under lag
    engine = setup(lag=1)
    sync_workload(engine)
    assert [s.hit for s in engine.seqs] == [0, 32, 80, 64]
    check_exact(engine)


# ---------------------------------------------------------------- 4. no leak through reuse
def leak_setup(apply_zero_plan: bool):
    """Mamba-only, 16 blocks. A: 40-token prompt (chunks end at 32, 40), 6 outputs -> computed
    45; its state at 32 is published and retired (LRU tail); its running block (slot 2, the
    state after 45 tokens, unhashed) goes to the free-queue head on free. B (20 other tokens,
    no hit) takes the head block: A's old running block."""
    engine = setup(hybrid=False, num_blocks=16, apply_zero_plan=apply_zero_plan)
    a = engine.add("A", tokens(40, seed=4), 6)
    engine.run()
    (old,) = [b for b in a.final_table if b != 0]
    head = engine.coord.block_pool.free_block_queue.get_all_free_blocks()[0].block_id
    assert head == old and engine.pool.ssm_state(0)[old].abs().sum() > 0  # precondition: dirty
    b = engine.add("B", tokens(20, seed=5), 10)
    engine.run()
    assert old in engine.zeroed  # B's running block was A's old one, in B's zero plan
    return engine, b


def test_reused_block_does_not_leak():
    engine, b = leak_setup(apply_zero_plan=True)
    assert b.hit == 0
    check_exact(engine)


def test_skipping_zero_plan_leaks():
    _, b = leak_setup(apply_zero_plan=False)
    want, traj = reference(MODEL, b.req.all_token_ids[:20].tolist(), len(b.out))
    assert not states_equal(b.final_states, traj[b.req.num_computed_tokens])
    assert b.out != want


# ---------------------------------------------------------------- null block
def test_null_row_never_written():
    """The forward writes only blocks the library names, never block 0; every step ran the
    pool's check (row 0 all zero) and the coordinator's. check_invariants has teeth: a write
    to row 0 is caught."""
    for engine in (setup(), setup(nspec=K)):
        (sync_workload if engine.K == 0 else spec_workload)(engine)
        assert 0 not in engine.written and len(engine.written) > 5
        engine.pool.check_invariants()
    engine.pool.ssm_state(1)[0, 2] = 1.0
    with pytest.raises(AssertionError):
        engine.pool.check_invariants()
