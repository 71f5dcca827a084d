"""Shared-prefix junctions: a prefill chunk ends where an attention hit outruns the Mamba hit,
so the state there is published and the next request sharing that prefix hits it.

Scenario (block 16, full attention + one align-mode Mamba group, one request at a time)::

    A = S + a,  B = S + b,  C = S + c      S: 16 shared tokens; a, b, c: 24 distinct tokens each

A (40 tokens): stop T = 39 // 16 * 16 = 32 -> chunks [0,32) [32,40): one state, at 32.
B: attention hits block 0 (16 tokens, S), but A's only state is at 32 (key of S + a[:16]):
   the hybrid hit is 0 and the junction 16. Chunks [0,16) [16,32) [32,40): states at 16, 32.
C: hits B's state at 16 -> 16 cached tokens. Without the junction stop B would publish
   nothing at 16 and C would hit 0.
"""

from __future__ import annotations

import numpy as np

from mambakv import FullAttentionSpec, KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, Request
from mambakv.sim import RequestSpec, Scheduler
from tests.helpers import mamba_spec

BS = 16


def hybrid(num_blocks: int = 64, *, enable_caching: bool = True) -> KVCacheCoordinator:
    cfg = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["attn"], FullAttentionSpec(BS, 1, 8, "float16")),
                                     KVCacheGroupSpec(["mamba"], mamba_spec(BS))])
    return KVCacheCoordinator(cfg, max_model_len=4096, enable_caching=enable_caching)


SHARED = np.arange(1, 17, dtype=np.int32)  # 16 tokens


def prompt(tail_start: int) -> np.ndarray:
    return np.concatenate([SHARED, np.arange(tail_start, tail_start + 24, dtype=np.int32)])


def specs() -> list[RequestSpec]:
    def make(start: int) -> RequestSpec:
        toks = prompt(start)
        return RequestSpec(f"r{start}", start / 100, 40, 1, lambda: toks)

    return [make(100), make(200), make(300)]  # A, B, C


def test_shared_prefix_length_sees_attention_beyond_mamba_hit():
    coord = hybrid()
    Scheduler(coord).run(specs()[:1], one_at_a_time=True)  # A: state at 32 only
    b = Request("B", prompt(200))
    _, hit = coord.get_computed_blocks(b)
    assert hit == 0  # Mamba has no state at 16
    assert coord.get_shared_prefix_length(b) == 16  # attention caches S = block 0
    a_again = Request("A2", prompt(100))
    # cap (40 - 1) // 16 * 16 = 32: attention caches blocks 0, 1 -> 32, and so does Mamba
    assert coord.get_shared_prefix_length(a_again) == 32 == coord.get_computed_blocks(a_again)[1]
    coord.check_invariants()


def test_junction_stop_publishes_the_shared_state():
    coord = hybrid()
    m = Scheduler(coord, check_invariants=True).run(specs(), one_at_a_time=True)
    assert m.finished == 3
    assert m.cached_tokens == 16  # A 0 + B 0 + C 16
    # steps: A 2 ([0,32) [32,40)), B 3 ([0,16) [16,32) [32,40)), C 2 ([16,32) [32,40))
    assert m.steps == 7
    pool = coord.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_prefill_chunk_ends_at_junction_only_inside_the_chunk():
    sched = Scheduler(hybrid(), max_num_batched_tokens=32)
    assert sched.prefill_chunk(0, 40, 32, 16) == 16       # 0 < 16 < 32: stop there
    assert sched.prefill_chunk(0, 100, 32, 48) == 32      # junction beyond this chunk: unchanged
    assert sched.prefill_chunk(32, 100, 32, 48) == 16     # next chunk [32,64) ends at 48
    assert sched.prefill_chunk(48, 100, 32, 48) == 32     # at the junction: nothing to do
    assert sched.prefill_chunk(0, 40, 32, 0) == 32        # no junction: T = 32


def test_no_junction_without_caching_or_without_attention():
    coord = hybrid(enable_caching=False)
    Scheduler(coord).run(specs()[:1], one_at_a_time=True)
    assert coord.get_shared_prefix_length(Request("B", prompt(200))) == 0
    mamba_only = KVCacheCoordinator(KVCacheConfig(32, [KVCacheGroupSpec(["m"], mamba_spec(BS))]), max_model_len=4096)
    Scheduler(mamba_only).run(specs()[:1], one_at_a_time=True)
    assert mamba_only.get_shared_prefix_length(Request("A2", prompt(100))) == 0
