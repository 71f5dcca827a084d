"""Multi-turn reuse under the decode-checkpoint policies (issues 10, 16), small sizes: 12
conversations x 3 turns, max_num_seqs 4, 3 drafts (seeded acceptance 0.7), block 64, async
lag 1, one Mamba group (mambakv/sim/reuse.py; the full sizes are bench/bench_lazy_reuse.py and
docs/replay.md). Turn 2-3 hit rates measured:

    blocks   every   latest  latest-evict  none
    32       0.111   0.360   0.000         0.323
    40       0.515   0.614   0.498         0.557
    48       0.686   0.700   0.839         0.629
    1024     0.708   0.839   0.839         0.629

* unconstrained: latest == latest-evict > every > none: every publishes a decode boundary
  only when a verify lands exactly on it, latest publishes each settled crossing, so turn
  t+1 resumes nearer its end; none publishes prefill states only.
* constrained: latest >= every (it never pins more, and without a free block it recycles
  its own superseded checkpoint); evicting for checkpoints costs cached states where the
  pool is tight (32, 40) and pays where it is not (48).
* the 0.x names are aliases: lazy == latest, eager == every.
"""

from __future__ import annotations

from mambakv.sim.reuse import run_reuse

SMALL = dict(conversations=12, max_num_seqs=4)


def rate(policy: str, num_blocks: int) -> float:
    r = run_reuse(policy, num_blocks=num_blocks, check_invariants=True, **SMALL)
    assert r["requests"] == 36 and r["blocks_returned"] and r["reserved_blocks"] == 0
    return r["hit_rate_later_turns"]


def test_unconstrained_latest_beats_every():
    every, latest, evict, none = (rate(p, 1024) for p in ("every", "latest", "latest-evict", "none"))
    assert latest == evict > every > none > 0


def test_constrained_pool_latest_never_below_every():
    for blocks in (32, 40, 48):
        assert rate("latest", blocks) >= rate("every", blocks)
    assert rate("latest-evict", 32) < rate("latest", 32)


def test_aliases():
    assert rate("lazy", 40) == rate("latest", 40) and rate("eager", 40) == rate("every", 40)
