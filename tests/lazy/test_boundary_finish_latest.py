"""decode_checkpoints="latest": issue 16's boundary-finish grid, with the reference layer.

Block 64, 3 drafts, async lag 1, a 500-token prompt (chunks end at 448, published, and
500); every verify accepts 0 drafts except the final steps (tests/lazy/test_boundary_finish.py
``script``). The continuation runs twice (on the cache, then after reset_prefix_cache) and
must equal the from-scratch run. Worked out with decode_checkpoints.py's rules:

* 768: the step from 767 settles at 768 (0 accepted): its running block holds 768; the
  verify copies it out into a free block no forward writes, published at the retire (768).
* 830, 831: the final step from 829 settles below 832 -> served 768.
* 832..834: the final step crosses 832 (from 829 accepting 2 or 3, or from 830 accepting
  3): 832's state (a scratch block's) is copied out at the verify and published at the
  retire before the finish; the step planned after it (lag 1) writes only running and
  scratch blocks, so the copy is safe. Served 832 for 833 and 834; a continuation of 832
  tokens hits below 832 -> 768. (Before, the spare was that in-flight step's write target:
  never published, served 768 for 830..834.)
* 848 / 864: the step 831 -> 832 crosses; published at its retire -> 832.
* every checkpoint-block allocation fails: no decode checkpoint at all -> 448 everywhere.
* drafts off (nspec 0): 830 / 831 / 832 -> 768 (a continuation of 832 tokens may hit < 832),
  833 and up -> 832.
"""

from __future__ import annotations

import pytest

from mambakv import KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, MambaSpec, MambaStatePool
from tests.lazy import test_boundary_finish as grid
from tests.lazy.lazy_engine import LazyEngine
from tests.ref_layer import CONV_SHAPE, SSM_SHAPE, states_equal


def make_engine(nspec: int, mode: str = "latest") -> LazyEngine:
    spec = MambaSpec(grid.BS, (CONV_SHAPE, SSM_SHAPE), ("float64", "float64"), mode="align",
                     num_speculative_blocks=nspec, decode_checkpoints=mode)
    coord = KVCacheCoordinator(KVCacheConfig(40, [KVCacheGroupSpec(["m.0", "m.1"], spec)]), max_model_len=1024)
    return LazyEngine(coord, MambaStatePool(spec, num_layers=2, num_blocks=40, device="cpu"), grid.MODEL)


def run_case(n: int, *, nspec: int = grid.K, spare_fails: bool = False, mode: str = "latest") -> tuple[int, list[int]]:
    engine = make_engine(nspec, mode)
    if spare_fails:
        engine.coord.block_pool.get_new_unhashed_block = lambda: None
    a = engine.add("A", grid.TRUTH, grid.PROMPT, n, nspec, grid.script(n) if nspec else (lambda s: 0))
    engine.run()
    assert a.hit == 0 and states_equal(a.final_states, grid.TRAJ[n])
    published = grid.published_positions(engine, a)
    outs = []
    for rid in ("C1", "C2"):
        if rid == "C2":
            assert engine.coord.reset_prefix_cache()
        c = engine.add(rid, grid.TRUTH, n, n + 32, nspec)
        engine.run()
        assert [int(x) for x in c.req.all_token_ids[n:]] == grid.TRUTH[n : n + 32]
        assert states_equal(c.final_states, grid.TRAJ[n + 32])
        outs.append((c.hit, [int(x) for x in c.req.all_token_ids]))
    (hit1, out1), (hit2, out2) = outs
    assert hit2 == 0 and out1 == out2
    engine.coord.check_invariants()
    assert 0 not in engine.written
    return hit1, published


@pytest.mark.parametrize("n,served,last", [(830, 768, 768), (831, 768, 768), (832, 768, 832), (833, 832, 832),
                                           (834, 832, 832), (848, 832, 832), (864, 832, 832)])
def test_grid_free_blocks(n, served, last):
    hit, published = run_case(n)
    assert hit == served
    assert published == [448, *range(512, last + 1, 64)]  # the chunk end, then every decode boundary


@pytest.mark.parametrize("n", grid.FINISHES)
def test_grid_every_spare_fails(n):
    hit, published = run_case(n, spare_fails=True)
    assert hit == 448 and published == [448]


@pytest.mark.parametrize("n,served", [(830, 768), (831, 768), (832, 768), (833, 832), (834, 832),
                                      (848, 832), (864, 832)])
def test_grid_drafts_off(n, served):
    hit, _ = run_case(n, nspec=0)
    assert hit == served


@pytest.mark.parametrize("n", [830, 848])
def test_grid_none_publishes_no_decode_state(n):
    hit, published = run_case(n, mode="none")
    assert hit == 448 and published == [448]
