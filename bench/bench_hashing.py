"""Hashing benchmarks: a 480,000-token prompt at hash block 16 and 544 (DESIGN.md section 9).

Each round builds a fresh ``Request`` and reads ``block_hashes``: the list case includes the
one conversion of the Python list to the int32 buffer. Targets on a 2-core machine: int32 array
at block 16 <= 9 ms, Python list at block 16 <= 20 ms (vLLM's sha256-over-pickle: ~50 ms).

Run: ``pytest bench/bench_hashing.py --benchmark-only``
"""

from __future__ import annotations

import numpy as np
import pytest

from mambakv import Request

NUM_TOKENS = 480_000


@pytest.fixture(scope="module")
def token_array() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 151_936, size=NUM_TOKENS, dtype=np.int32)  # a Qwen-sized vocabulary


@pytest.mark.parametrize("hash_block_size", [16, 544])
@pytest.mark.parametrize("source", ["int32_array", "list"])
def test_hash_480k(benchmark, token_array, source, hash_block_size):
    prompt = token_array if source == "int32_array" else token_array.tolist()

    def run() -> list[bytes]:
        return Request("r", prompt, hash_block_size=hash_block_size).block_hashes

    hashes = benchmark.pedantic(run, rounds=20, warmup_rounds=2, iterations=1)
    assert len(hashes) == NUM_TOKENS // hash_block_size
    benchmark.extra_info["blocks"] = len(hashes)
    benchmark.extra_info["ns_per_token"] = benchmark.stats.stats.mean * 1e9 / NUM_TOKENS
