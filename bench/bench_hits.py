"""Prefix-hit lookup benchmarks: a cold sliding-window lookup must be linear in the prompt.

A cold prompt (nothing cached) of 60k .. 480k tokens, block 16, window 4096, alignment 16: the
lookup scans right to left, each block looked up once, and finds nothing. Before the scan was
linear it rebuilt the run list for every aligned end: 1.9 s at 480k tokens (against about
7.6 ms for one scan). ``extra_info["ns_per_block"]`` should stay flat across the sizes.

Run: ``pytest bench/bench_hits.py --benchmark-only``
"""

from __future__ import annotations

import pytest

from mambakv import BlockPool, SlidingWindowManager, SlidingWindowSpec

BLOCK = 16


@pytest.mark.parametrize("num_tokens", [60_000, 120_000, 240_000, 480_000])
def test_cold_sliding_window_lookup_is_linear(benchmark, num_tokens):
    pool = BlockPool(64)
    spec = SlidingWindowSpec(BLOCK, 1, 8, "bfloat16", sliding_window=4096)
    keys = [i.to_bytes(16, "little") for i in range(num_tokens // BLOCK)]

    def run() -> tuple:
        return SlidingWindowManager.find_longest_cache_hit(keys, num_tokens, [0], pool, spec, BLOCK)

    (hit,) = benchmark.pedantic(run, rounds=10, warmup_rounds=1, iterations=1)
    assert hit == []
    benchmark.extra_info["ns_per_block"] = benchmark.stats.stats.mean * 1e9 / len(keys)
