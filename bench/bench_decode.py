"""Decode: 256 and 1024 running requests (2000-token prompts prefilled), 200 steps.

Reported per request-step: ``allocate`` alone and ``allocate + retire`` (vLLM's
``allocate_slots`` retires inside it, so the second figure is the one to compare; target
<= 0.2 of vLLM's 35-45 us). Most decode steps need no new block; that path should cost next to
nothing.

Run: ``pytest bench/bench_decode.py --benchmark-only``
"""

from __future__ import annotations

import pytest
from common import decode_setup, decode_steps, py_ref_ms

STEPS = 200


@pytest.mark.parametrize("num_reqs", [256, 1024])
def test_decode(benchmark, num_reqs):
    out = []

    def setup():
        return decode_setup(num_reqs, steps=STEPS), {}

    def run(coord, reqs):
        out.append(decode_steps(coord, reqs, STEPS))
        coord.check_invariants()

    benchmark.pedantic(run, setup=setup, rounds=3)
    n = num_reqs * STEPS
    alloc = min(a for a, _ in out)
    total = min(t for _, t in out)
    benchmark.extra_info.update(alloc_us_per_req_step=alloc / n * 1e6, alloc_retire_us_per_req_step=total / n * 1e6,
                                py_ref_ms=py_ref_ms())
