"""Multi-turn state reuse under speculative decoding, eager vs lazy vs lazy-evict (issue 10).

48 conversations x 3 turns (each turn's prompt = previous prompt + its output + a new message,
seeded lengths), max_num_seqs 16, 3 draft tokens (seeded acceptance 0.7), block 64, async lag 1,
one Mamba group (mambakv/sim/reuse.py). Turn 2-3 hit rate = sum(hit) / sum(prompt) over turns 2-3.

Pools: 4096 blocks (unconstrained); 120 blocks (16 running requests pin 64..96 of them under
eager); and lazy with 120 + 48 blocks (the same 120 for states, the 16 x 3 scratch region beside
them) to show what the region costs. Numbers: docs/replay.md.

Run: ``pytest bench/bench_lazy_reuse.py --benchmark-only -s``
"""

from __future__ import annotations

from mambakv.sim.reuse import run_reuse

RUNS = [("eager", 4096), ("lazy", 4096), ("lazy-evict", 4096),
        ("eager", 120), ("lazy", 120), ("lazy-evict", 120), ("lazy", 168), ("lazy-evict", 168)]


def test_lazy_reuse(benchmark):
    out = {}

    def run():
        for policy, blocks in RUNS:
            out[(policy, blocks)] = run_reuse(policy, num_blocks=blocks)

    benchmark.pedantic(run, rounds=1, iterations=1)
    for (policy, blocks), r in out.items():
        print(f"{policy:10s} {blocks:5d} blocks (reserved {r['reserved_blocks']:2d}): turn 2-3 hit rate "
              f"{r['hit_rate_later_turns']:.4f}  evictions {r['evictions']}")
        assert r["blocks_returned"] and r["requests"] == 144
        benchmark.extra_info[f"{policy}@{blocks}"] = round(r["hit_rate_later_turns"], 4)
    rate = {k: r["hit_rate_later_turns"] for k, r in out.items()}
    assert rate[("lazy", 4096)] == rate[("lazy-evict", 4096)] >= rate[("eager", 4096)]
    assert rate[("lazy", 168)] >= 4 * rate[("eager", 120)]
