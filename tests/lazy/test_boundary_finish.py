"""The boundary-finish grid (issues 10, 16): its reference run and accept script, shared by
test_boundary_finish_latest.py (the tests; the 0.x ALIGN_LAZY expectations left with it).


Block 64, 3 drafts, use_eagle off, async lag 1 (lazy_engine.py), a 500-token prompt: the
prefill chunks end at 448 (the stop (500 - 1) // 64 * 64, published) and 500; decode
boundaries 512, ..., 832. Every verify accepts 0 drafts (one token per step) except: for N in
830..833 the final step starts at 829 and accepts N - 830; for N = 834 the step 829 -> 830 is
followed by a final step 830 -> 834. The request stops at exactly N tokens. From the N
tokens a 32-token continuation runs twice: on the cache, then after reset_prefix_cache; both
must equal the from-scratch greedy run (and each other); the first one's hit is the
checkpoint it was served from.

"""

from __future__ import annotations

import torch

from mambakv.groups.base import group_block_hashes
from tests.lazy.lazy_engine import LazyEngine
from tests.ref_layer import RefModel, V, reference, states_equal

BS, K, PROMPT = 64, 3, 500
MODEL = RefModel(num_layers=2, seed=0)
FINISHES = [830, 831, 832, 833, 834, 848, 864]


def _truth() -> tuple[list[int], list]:
    g = torch.Generator().manual_seed(10)
    prompt = [int(x) for x in torch.randint(V, (PROMPT,), generator=g)]
    outs, traj = reference(MODEL, prompt, 864 + 32 + 2 * K + 4 - PROMPT)
    return prompt + outs, traj


TRUTH, TRAJ = _truth()


def script(n: int):
    """Drafts accepted by the step starting at `start` (see the module docstring)."""
    def accept(start: int) -> int:
        if n <= 833 and start == 829:
            return n - 830
        if n == 834 and start == 830:
            return 3
        return 0
    return accept


def published_positions(engine: LazyEngine, seq) -> list[int]:
    """Boundaries published under `seq`'s keys; each one's state must be the true state."""
    out = []
    for slot, key in enumerate(group_block_hashes(seq.req, BS)):
        cached = engine.coord.block_pool.get_cached_block(key, [engine.gid])
        if cached is not None:
            pos, b = (slot + 1) * BS, cached[0].block_id
            got = [(engine.pool.conv_state(i)[b], engine.pool.ssm_state(i)[b]) for i in range(2)]
            assert states_equal(got, TRAJ[pos]), f"published state at {pos} is not the true one"
            out.append(pos)
    return out
