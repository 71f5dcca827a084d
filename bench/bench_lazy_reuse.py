"""Multi-turn state reuse under speculative decoding: decode-checkpoint policies (issues 10, 16).

48 conversations x 3 turns (each turn's prompt = previous prompt + its output + a new message,
seeded lengths), max_num_seqs 16, 3 draft tokens (seeded acceptance 0.7), block 64, async lag 1,
one Mamba group (mambakv/sim/reuse.py). Turn 2-3 hit rate = sum(hit) / sum(prompt) over turns 2-3.

Pools: the equal-memory table of docs/replay.md (every policy over the same blocks; nothing is
reserved). Issue 16's requirement: latest >= every from 168 blocks up (measured: from 120 up).

Run: ``pytest bench/bench_lazy_reuse.py --benchmark-only -s``
"""

from __future__ import annotations

from mambakv.sim.reuse import run_reuse

SIZES = (100, 120, 140, 168, 200, 260, 400, 4096)
POLICIES = ("every", "latest", "latest-evict", "none")


def test_lazy_reuse(benchmark):
    out = {}

    def run():
        for policy in POLICIES:
            for blocks in SIZES:
                out[(policy, blocks)] = run_reuse(policy, num_blocks=blocks)

    benchmark.pedantic(run, rounds=1, iterations=1)
    for (policy, blocks), r in out.items():
        print(f"{policy:12s} {blocks:5d} blocks: turn 2-3 hit rate {r['hit_rate_later_turns']:.4f}  "
              f"evictions {r['evictions']}")
        assert r["blocks_returned"] and r["requests"] == 144
        benchmark.extra_info[f"{policy}@{blocks}"] = round(r["hit_rate_later_turns"], 4)
    rate = {k: r["hit_rate_later_turns"] for k, r in out.items()}
    assert all(rate[("latest", b)] >= rate[("every", b)] for b in SIZES if b >= 168)
    assert rate[("latest", 4096)] == rate[("latest-evict", 4096)] > rate[("every", 4096)]
