"""Checkpoint at the replay boundary (vLLM #50409), end to end through the reference scheduler.

vLLM #50409: a prompt of P tokens that fits in one step was prefilled in one chunk, leaving a
Mamba state only at P. A repeat of the prompt looks up at most P - 1 tokens (the last token is
recomputed for its logits), so that state is never a hit: a 32-token prompt repeated hit 0.
The rule, in the reference scheduler's chunk split (``Scheduler.prefill_chunk``, documented for
engines in docs/engine-integration.md): prefill stops once at ``T = (P - 1) // B * B``, the
last block boundary strictly before the prompt end, leaving a state there. vLLM's split stops
at ``P - P % B`` instead (``stop_before_last_token=False``), which is the same when P is not a
multiple of B (31, 33) and misses the hit when it is (32, 48).
"""

from __future__ import annotations

import numpy as np
import pytest

from mambakv.sim import RequestSpec, Scheduler

from .util import coordinator, fa, mamba

B = 16


def run_twice(num_prompt: int, stop_before_last_token: bool) -> tuple[list[int], int]:
    """Full attention + align Mamba (B = 16), a 64-token budget (the prompt fits in one step):
    run the prompt, then the same prompt again, one at a time. Returns the first run's chunks
    and the second run's hit."""
    coord = coordinator(64, fa(B), mamba(B))
    sched = Scheduler(coord, max_num_batched_tokens=64, stop_before_last_token=stop_before_last_token)
    prompt = np.arange(100, 100 + num_prompt, dtype=np.int32)
    chunks = []
    c = 0
    while c < num_prompt:  # the split the scheduler will use for the first run
        n = sched.prefill_chunk(c, num_prompt, 64)
        chunks.append(n)
        c += n
    sched.run([RequestSpec("first", 0.0, num_prompt, 1, lambda: prompt.copy())], one_at_a_time=True)
    assert sched.metrics.cached_tokens == 0
    sched.run([RequestSpec("again", 0.0, num_prompt, 1, lambda: prompt.copy())], one_at_a_time=True)
    coord.check_invariants()
    assert coord.block_pool.get_num_free_blocks() == 63  # both finished, every block back
    return chunks, sched.metrics.cached_tokens


@pytest.mark.parametrize("num_prompt, chunks, hit", [
    (32, [16, 16], 16),   # T = 31 // 16 * 16 = 16: a state at 16; the repeat caps at 31 -> 16
    (48, [32, 16], 32),   # T = 47 // 16 * 16 = 32: one chunk of 32 (interior boundary 16 null)
    (31, [16, 15], 16),   # T = 30 // 16 * 16 = 16; cap 30 -> 16
    (33, [32, 1], 32),    # T = 32 // 16 * 16 = 32; cap 32 -> 32
])
def test_stop_before_last_token(num_prompt, chunks, hit):
    assert run_twice(num_prompt, True) == (chunks, hit)


@pytest.mark.parametrize("num_prompt, chunks, hit", [
    (32, [32], 0),        # P - P % B = 32: the only state is at 32, never looked up (cap 31)
    (48, [48], 0),
    (31, [16, 15], 16),   # 31 - 15 = 16: same as the rule
    (33, [32, 1], 32),    # 33 - 1 = 32: same as the rule
])
def test_vllm_split_misses_the_boundary(num_prompt, chunks, hit):
    assert run_twice(num_prompt, False) == (chunks, hit)
