"""Multi-turn state reuse under speculative decoding: decode-checkpoint policies (issues 10, 16).

Workload: ``conversations`` chats of ``turns`` turns; turn t+1's prompt = turn t's prompt + its
output + a new message (seeded lengths); closed loop: a turn is submitted when the previous one
finishes. One Mamba group (align, block 64), no attention group, so a hit is
exactly a cached state. ``max_num_seqs`` requests run at once with ``nspec`` draft tokens per
decode step (seeded acceptance) and an async lag of one step.

Reported: the turn 2..T hit rate ``sum(hit tokens) / sum(prompt tokens)`` over turns >= 2.

Policies (``mambakv.sim.runner.MAMBA_POLICIES``): ``every`` (eager align), ``latest`` (spares
only from blocks free without eviction), ``latest-evict`` (spares may evict), ``none``; the
0.x names ``eager`` / ``lazy`` / ``lazy-evict`` are aliases.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.spec import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from mambakv.sim.runner import MAMBA_POLICIES
from mambakv.sim.scheduler import Scheduler
from mambakv.sim.sim_request import SimRequest
from mambakv.sim.workloads import DEFAULT_VOCAB, RequestSpec, fixed_prompt

__all__ = ["reuse_conversations", "run_reuse"]

#: a small state (the pool is counted in blocks; the state size does not matter here)
_SHAPES, _DTYPES = ((3, 64), (8, 16)), ("bfloat16", "float32")


def reuse_conversations(num_conversations: int = 48, turns: int = 3, *, seed: int = 0,
                        first: tuple[int, int] = (256, 768), message: tuple[int, int] = (32, 256),
                        output: tuple[int, int] = (96, 320), vocab: int = DEFAULT_VOCAB) -> list[list[RequestSpec]]:
    """Per conversation, its turns (lengths uniform in the given ranges, tokens seeded)."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    out = []
    for c in range(num_conversations):
        history = nprng.integers(0, vocab, rng.randint(*first), dtype=np.int32)
        chat = []
        for t in range(turns):
            prompt = history if t == 0 else np.concatenate([history, nprng.integers(0, vocab, rng.randint(*message),
                                                                                  dtype=np.int32)])
            reply = nprng.integers(0, vocab, rng.randint(*output), dtype=np.int32)
            chat.append(RequestSpec(f"conv-{c}-{t}", float(c), int(prompt.size), int(reply.size),
                                    fixed_prompt(prompt), reply))
            history = np.concatenate([prompt, reply])
        out.append(chat)
    return out


def run_reuse(policy: str, *, num_blocks: int, conversations: int = 48, turns: int = 3, max_num_seqs: int = 16,
              num_speculative_tokens: int = 3, block_size: int = 64, acceptance_rate: float = 0.7, lag: int = 1,
              seed: int = 0, check_invariants: bool = False, **workload: Any) -> dict[str, Any]:
    """Run the workload under `policy` on a pool of `num_blocks` blocks. Returns the turn >= 2 hit rate and
    counters."""
    decode_checkpoints, evict = MAMBA_POLICIES[policy]
    spec = MambaSpec(block_size, _SHAPES, _DTYPES, mode="align", num_speculative_blocks=num_speculative_tokens,
                     decode_checkpoints=decode_checkpoints)
    coord = KVCacheCoordinator(KVCacheConfig(num_blocks, [KVCacheGroupSpec(["mamba"], spec)]), max_model_len=1 << 16,
                               max_num_seqs=max_num_seqs)
    for m in coord.mamba_managers:
        m.spare_may_evict = evict
    chats = reuse_conversations(conversations, turns, seed=seed, **workload)
    following = {chat[t].request_id: chat[t + 1] for chat in chats for t in range(turns - 1)}
    done: list[SimRequest] = []

    def on_finish(sreq: SimRequest) -> None:
        done.append(sreq)
        nxt = following.get(sreq.spec.request_id)
        if nxt is not None:
            sched.waiting.append(SimRequest(nxt))
            sched.metrics.requests += 1

    sched = Scheduler(coord, max_num_seqs=max_num_seqs, num_speculative_tokens=num_speculative_tokens,
                      acceptance_rate=acceptance_rate, lag=lag, seed=seed, on_finish=on_finish,
                      check_invariants=check_invariants)
    metrics = sched.run([chat[0] for chat in chats])
    later = [s for s in done if not s.spec.request_id.endswith("-0")]
    prompt = sum(s.spec.num_prompt_tokens for s in later)
    hits = sum(s.hit for s in later)
    pool = coord.block_pool
    return {"policy": policy, "num_blocks": num_blocks, "reserved_blocks": pool.num_reserved_blocks,
            "requests": len(done), "later_turns": len(later), "later_prompt_tokens": prompt,
            "later_hit_tokens": hits, "hit_rate_later_turns": hits / prompt if prompt else 0.0,
            "evictions": pool.num_evictions, "preemptions": metrics.preemptions,
            "blocks_returned": pool.get_num_free_blocks() == pool.num_blocks - 1 - pool.num_reserved_blocks}
