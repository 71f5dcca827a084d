"""Multi-turn reuse, eager vs lazy vs lazy-evict (issue 10), small sizes: 12 conversations x 3
turns, max_num_seqs 4, 3 drafts (seeded acceptance 0.7), block 64, async lag 1, one Mamba
group (mambakv/sim/reuse.py; the full sizes are bench/bench_lazy_reuse.py).

Relations (values are printed by the benchmark and recorded in docs/replay.md):

* unconstrained pool (1024 blocks): lazy == lazy-evict (no spare ever needs an eviction)
  and lazy > eager: eager publishes a decode boundary only when a verify lands exactly on it,
  lazy publishes the last boundary crossed at finish, so turn t+1 resumes nearer its end.
* constrained pool (32 blocks, 4 running requests pin most of it under eager: 4 x (4..5)):
  with the scratch region charged to the same pool (the lead's decision: 4 x 3 = 12 rows
  reserved for good) lazy falls below eager, because a lazy request in decode pins W + C
  (+ S) + its 3 scratch rows, one more than eager's running block + 3 scratch. With the same
  32 blocks for states and the region beside them (44 blocks in all), lazy beats eager by a
  large factor (>= 4x asserted).
"""

from __future__ import annotations

from mambakv.sim.reuse import run_reuse

SMALL = dict(conversations=12, max_num_seqs=4)


def rate(policy: str, num_blocks: int) -> float:
    r = run_reuse(policy, num_blocks=num_blocks, check_invariants=True, **SMALL)
    assert r["requests"] == 36 and r["blocks_returned"]
    return r["hit_rate_later_turns"]


def test_unconstrained_lazy_equals_lazy_evict_and_beats_eager():
    eager, lazy, evict = rate("eager", 1024), rate("lazy", 1024), rate("lazy-evict", 1024)
    assert lazy == evict > eager > 0


def test_constrained_pool():
    eager = rate("eager", 32)
    assert rate("lazy", 32) < eager             # the reserved region + C cost cache room
    assert rate("lazy", 32 + 12) >= 4 * eager > 0  # region beside the same 32 blocks
