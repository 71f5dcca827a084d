"""Building a pool: time and memory against its size (issue 31, item 2).

Blocks are made on first use, so a unified ``BlockPool`` of any size builds in microseconds
and a decoupled ``SuperblockArena`` in about 0.1 us per superblock (its per-superblock lists);
both pay about 1 us and 136 B per block when a block is first used.

Run: ``pytest bench/bench_pool_build.py --benchmark-only`` for the timed rows, or
``python bench/bench_pool_build.py`` for the table of docs/benchmarks.md ("Building a pool").
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from mambakv import BlockPool
from mambakv.core.arena import SuperblockArena, SuperblockGeometry

SIZES = (10**5, 10**6, 10**7)


def build_unified(n: int) -> BlockPool:
    return BlockPool(n)


def build_decoupled(n: int) -> SuperblockArena:  # n superblocks of 4 pages (Qwen3-Next's k at 64-token pages is 9)
    return SuperblockArena(SuperblockGeometry(n, 4, 1024, 3000))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", ["unified", "decoupled"])
def test_build(benchmark, layout: str, n: int) -> None:
    build = build_unified if layout == "unified" else build_decoupled
    benchmark.pedantic(build, args=(n,), rounds=3, iterations=1)
    benchmark.extra_info["ns_per_block"] = benchmark.stats.stats.min * 1e9 / n


def table() -> None:
    """One row per layout and size: build time (untraced), memory per unit (a second, traced
    build), and the first 1,000 blocks taken (they are made then; the first collection of the
    young per-block lists by Python's cyclic GC falls in it too)."""
    print(f"{'layout':<10} {'size':>12} {'unit':<11} {'build ms':>9} {'ns/unit':>8} {'B/unit':>7} {'first 1000 ms':>14}")
    for layout, build in (("unified", build_unified), ("decoupled", build_decoupled)):
        for n in SIZES:
            t0 = time.perf_counter()
            pool = build(n)
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            if isinstance(pool, BlockPool):
                pool.get_new_blocks(1000)
            else:
                pool.make_room(1000, 0)
                pool.pages.get_new_blocks(1000)
            first = time.perf_counter() - t0
            del pool
            tracemalloc.start()
            pool = build(n)
            mem, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del pool
            unit = "block" if layout == "unified" else "superblock"
            print(f"{layout:<10} {n:>12,} {unit:<11} {dt * 1e3:>9.1f} {dt * 1e9 / n:>8.1f} {mem / n:>7.1f} "
                  f"{first * 1e3:>14.2f}")


if __name__ == "__main__":
    table()
