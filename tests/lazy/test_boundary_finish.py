"""ALIGN_LAZY: the boundary-finish grid of issue 10, with the reference recurrent layer.

Block 64, 3 drafts, use_eagle off, async lag 1 (lazy_engine.py), a 500-token prompt: the
prefill chunks end at 448 (the stop (500 - 1) // 64 * 64, published) and 500; decode
boundaries 512, ..., 832. Every verify accepts 0 drafts (one token per step) except: for N in
830..833 the final step starts at 829 and accepts N - 830; for N = 834 the step 829 -> 830 is
followed by a final step 830 -> 834. The request stops at exactly N tokens. From the N
tokens a 32-token continuation runs twice: on the cache, then after reset_prefix_cache; both
must equal the from-scratch greedy run (and each other); the first one's hit is the
checkpoint it was served from.

Expected (worked out in mambakv/managers/mamba_lazy.py's rules; lag 1 means the step after
the final one is planned, with the same window, before the request is known to finish):

* free blocks: the spare S is taken when 832 - p <= 8 (p = settled tokens at planning).
  830..834: the last steps target S, never C (= 768, valid) -> C published, S (which may
  hold 832) freed: no promotion at finish. Continuation cap N - 1 -> 768.
  848 / 864: 832 was crossed into S by the step 831 -> 832 while running -> promoted ->
  published at finish (the next window, 896 - 847 > 8, is never entered) -> 832.
* every spare allocation fails: window steps write C in place. The step 828 (computes
  829..832) writes a rejected draft's state at 832 into C -> C invalid; for 830..832 it stays
  so; for 833 / 834 the final step crosses 832 in place, but "this step wrote it in place" ->
  not published. Only the prefill's 448 remains -> 448. 848 / 864: the step 831 -> 832 wrote
  the true 832 in place, later steps do not write C -> 832.
* drafts off (nspec 0, window 2): 830 / 831 -> 768; 832: the crossing is the final step
  (no promotion) -> 768; 833 and up: crossed while running -> 832.
"""

from __future__ import annotations

import pytest
import torch

from mambakv import KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, MambaSpec, MambaStatePool
from mambakv.groups.base import group_block_hashes
from tests.lazy.lazy_engine import LazyEngine
from tests.ref_layer import CONV_SHAPE, SSM_SHAPE, RefModel, V, reference, states_equal

BS, K, PROMPT = 64, 3, 500
MODEL = RefModel(num_layers=2, seed=0)
FINISHES = [830, 831, 832, 833, 834, 848, 864]


def _truth() -> tuple[list[int], list]:
    g = torch.Generator().manual_seed(10)
    prompt = [int(x) for x in torch.randint(V, (PROMPT,), generator=g)]
    outs, traj = reference(MODEL, prompt, 864 + 32 + 2 * K + 4 - PROMPT)
    return prompt + outs, traj


TRUTH, TRAJ = _truth()


def script(n: int):
    """Drafts accepted by the step starting at `start` (see the module docstring)."""
    def accept(start: int) -> int:
        if n <= 833 and start == 829:
            return n - 830
        if n == 834 and start == 830:
            return 3
        return 0
    return accept


def make_engine(nspec: int, mode: str = "align_lazy") -> LazyEngine:
    spec = MambaSpec(BS, (CONV_SHAPE, SSM_SHAPE), ("float64", "float64"), mode=mode, num_speculative_blocks=nspec)
    coord = KVCacheCoordinator(KVCacheConfig(40, [KVCacheGroupSpec(["m.0", "m.1"], spec)]), max_model_len=1024,
                               max_num_seqs=2)
    return LazyEngine(coord, MambaStatePool(spec, num_layers=2, num_blocks=40, device="cpu"), MODEL)


def published_positions(engine: LazyEngine, seq) -> list[int]:
    """Boundaries published under `seq`'s keys; each one's state must be the true state."""
    out = []
    for slot, key in enumerate(group_block_hashes(seq.req, BS)):
        cached = engine.coord.block_pool.get_cached_block(key, [engine.gid])
        if cached is not None:
            pos, b = (slot + 1) * BS, cached[0].block_id
            got = [(engine.pool.conv_state(i)[b], engine.pool.ssm_state(i)[b]) for i in range(2)]
            assert states_equal(got, TRAJ[pos]), f"published state at {pos} is not the true one"
            out.append(pos)
    return out


def run_grid_case(n: int, *, nspec: int = K, spare_fails: bool = False) -> tuple[int, list[int]]:
    """Run the first request to `n`, then the two continuations; returns (served hit,
    positions published for the first request)."""
    engine = make_engine(nspec)
    if spare_fails:
        engine.coord.block_pool.get_new_unhashed_block = lambda: None  # every spare allocation fails
    k = nspec
    a = engine.add("A", TRUTH, PROMPT, n, k, script(n) if k else (lambda s: 0))
    engine.run()
    assert a.hit == 0 and states_equal(a.final_states, TRAJ[n])
    published = published_positions(engine, a)
    outs = []
    for rid in ("C1", "C2"):
        if rid == "C2":
            assert engine.coord.reset_prefix_cache()
        c = engine.add(rid, TRUTH, n, n + 32, k)
        engine.run()
        assert [int(x) for x in c.req.all_token_ids[n:]] == TRUTH[n : n + 32]  # == from scratch
        assert states_equal(c.final_states, TRAJ[n + 32])
        outs.append((c.hit, [int(x) for x in c.req.all_token_ids]))
    (hit1, out1), (hit2, out2) = outs
    assert hit2 == 0 and out1 == out2
    engine.coord.check_invariants()
    assert 0 not in engine.written
    return hit1, published


@pytest.mark.parametrize("n,served", [(830, 768), (831, 768), (832, 768), (833, 768), (834, 768),
                                      (848, 832), (864, 832)])
def test_grid_free_blocks(n, served):
    hit, published = run_grid_case(n)
    assert hit == served
    assert published[0] == 448 and published[-1] == served


@pytest.mark.parametrize("n,served", [(830, 448), (831, 448), (832, 448), (833, 448), (834, 448),
                                      (848, 832), (864, 832)])
def test_grid_every_spare_fails(n, served):
    hit, published = run_grid_case(n, spare_fails=True)
    assert hit == served
    # while running, decode checkpoints stay private: only the prefill's 448 and what finish published
    assert published == ([448] if served == 448 else [448, served])


@pytest.mark.parametrize("n,served", [(830, 768), (831, 768), (832, 768), (833, 832), (834, 832),
                                      (848, 832), (864, 832)])
def test_grid_drafts_off(n, served):
    hit, _ = run_grid_case(n, nspec=0)
    assert hit == served


def test_teeth_publishing_a_checkpoint_still_written_is_caught(monkeypatch):
    """Negative control. Every spare fails; finish at 828: the final step computes 828..831,
    so C still holds the true 768 and the last step did not write it; but the step planned
    after it (p = 827, 832 - 827 <= 8: target C in place) computes 829..832 and writes a
    draft's state at 832 into C. The rule keeps C private (published: only 448); with the
    "may still write" check disabled, C is published under 768's key and then overwritten:
    the published-state check catches it."""
    from mambakv.groups.lazy_state import LazyRequestBlocks

    for disabled in (False, True):
        engine = make_engine(K)
        engine.coord.block_pool.get_new_unhashed_block = lambda: None
        if disabled:
            monkeypatch.setattr(LazyRequestBlocks, "may_still_write", lambda self, block: False)
        a = engine.add("A", TRUTH, PROMPT, 828, K, script(828))
        engine.run()
        if not disabled:
            assert published_positions(engine, a) == [448]
        else:
            with pytest.raises(AssertionError, match="published state at 768"):
                published_positions(engine, a)
