"""BlockPool benchmark: ``get_new_blocks(1000)`` then ``free_blocks`` of them, per block.

Target on a 2-core machine: <= 0.15 us per block for the pair (DESIGN.md section 9 puts
pure-Python bulk pop/append of 1000 blocks at about 0.06 us per block).

Run: ``pytest bench/bench_block_pool.py --benchmark-only``
"""

from __future__ import annotations

import pytest

from mambakv import BlockPool

N = 1000


@pytest.mark.parametrize("hashed", [False, True], ids=["unhashed", "hashed"])
def test_get_new_and_free_1000(benchmark, hashed):
    pool = BlockPool(2 * N + 1)
    if hashed:  # every free block carries a hash: each allocation also evicts it from the map
        blocks = pool.get_new_blocks(2 * N)
        pool.cache_full_blocks(blocks, [i.to_bytes(16, "little") for i in range(2 * N)], 0)
        pool.free_blocks(blocks)

    def run() -> None:
        blocks = pool.get_new_blocks(N)
        pool.free_blocks(blocks)

    benchmark.pedantic(run, rounds=200, warmup_rounds=5, iterations=1)
    pool.check_invariants()
    benchmark.extra_info["us_per_block"] = benchmark.stats.stats.mean * 1e6 / N
