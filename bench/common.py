"""Workloads shared by the benchmarks and bench/compare.py (the same loops vLLM's peer scripts run).

Every timing is reported beside ``py_ref_ms``: the fixed pure-Python loop of
../shared/peer/vllm_hybrid_bench.py, so runs on a drifting machine compare as ratios.
"""

from __future__ import annotations

import random
import time
from collections import deque

import numpy as np

from mambakv import BlockPool, KVCacheConfig, KVCacheCoordinator, MambaManager, MambaSpec, Request
from mambakv.models import build_kv_cache_config, load_model

GIB = 1 << 30
VOCAB = 151_936  # Qwen3 vocabulary
PROMPT_480K = 480_031
BUDGET = 8192


def py_ref_ms(repeat: int = 5) -> float:
    """Best-of-`repeat` ms of the peer's reference loop (dict/list traffic)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        d: dict[int, int] = {}
        lst: list[int] = []
        for i in range(200_000):
            d[i & 4095] = i
            lst.append(i)
            if len(lst) > 64:
                lst.pop()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


# ---------------------------------------------------------------- manager-level 480k replay
def manager_replay_480k(block_size: int, in_flight: int, nspec: int = 5, total: int = PROMPT_480K,
                        budget: int = BUDGET, fused: bool = True) -> tuple[int, int, float]:
    """vLLM's vllm_replay.py loop on our MambaManager: chunks of `budget` rounded down to the
    block size, up to the last full chunk; before each allocation retire to
    ``max(0, computed - in_flight * chunk)``. `fused`: one ``schedule_step`` per request-step
    (retire + count + allocate), else the three calls as vLLM's loop makes them. Returns (peak
    held blocks, steps, seconds)."""
    spec = MambaSpec(block_size, ((1, 1),), ("float32",), mode="align", num_speculative_blocks=nspec)
    pool = BlockPool(1000)
    for _ in pool.blocks:  # every block made before the loop, as vLLM's pool (see warm)
        pass
    m = MambaManager(spec, pool)
    free0 = pool.get_num_free_blocks()
    chunk = budget // block_size * block_size
    peak = steps = 0
    t0 = time.perf_counter()
    for target in range(chunk, total + 1, chunk):
        computed = target - chunk
        if fused:
            m.schedule_step("r", target, max(0, computed - in_flight * chunk))
        else:
            m.remove_skipped_blocks("r", max(0, computed - in_flight * chunk))
            m.get_num_blocks_to_allocate("r", target, (), computed)
            m.allocate_new_blocks("r", target)
        m.take_copy_plan()
        steps += 1
        held = free0 - pool.get_num_free_blocks()
        if held > peak:
            peak = held
    dt = time.perf_counter() - t0
    m.free("r")
    assert pool.get_num_free_blocks() == free0, "leak"
    return peak, steps, dt


# ---------------------------------------------------------------- Qwen3-Next-shaped coordinator
def qwen3_next_config(nspec: int = 5, memory_gib: float = 60.0, num_blocks: int | None = None) -> KVCacheConfig:
    """The packaged Qwen3-Next-80B-A3B layout: 1 full-attention + 3 GDN groups of 12 layers,
    block 544 (bf16 states), `memory_gib` of cache (or exactly `num_blocks`)."""
    cfg = build_kv_cache_config(load_model("qwen3-next-80b-a3b"), int(memory_gib * GIB), num_speculative_blocks=nspec)
    return cfg if num_blocks is None else KVCacheConfig(num_blocks, cfg.kv_cache_groups)


def random_prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def warm(coord: KVCacheCoordinator) -> None:
    """Make every block of `coord`'s pools now (a pool makes a block on its first use,
    ``BlockPool.blocks``), so a timed loop measures steady-state steps, as vLLM's peer scripts
    do with the blocks their pool built eagerly before the loop."""
    for pool in coord.pools:
        for _ in pool.blocks:
            pass


def hybrid_prefill(coord: KVCacheCoordinator, prompt, in_flight: int, budget: int = BUDGET, *,
                   retire_in_allocate: bool = False) -> dict:
    """One prefill through the coordinator as an engine drives it: chunks aligned to the
    block size, retire with processed tokens lagging by `in_flight` steps (``retire`` then
    ``allocate``, or with `retire_in_allocate` one ``allocate(..., num_processed_tokens=)``).
    Hashing (building the Request and its block hashes) is timed apart from the scheduling calls.
    The pools are warmed first (``warm``): vLLM builds every block up front, outside its loop."""
    warm(coord)
    t0 = time.perf_counter()
    req = Request("prefill", prompt)
    req.set_hash_block_size(coord.hash_block_size)
    _ = req.block_hashes
    hash_s = time.perf_counter() - t0
    bs = coord.alignment_tokens
    pending: deque[int] = deque()  # computed counts of steps in flight
    processed = steps = 0
    mamba_peak = 0
    sched_s = 0.0
    mamba = coord.mamba_managers
    P = req.num_tokens
    while req.num_computed_tokens < P:
        while len(pending) > in_flight:
            processed = pending.popleft()
        t0 = time.perf_counter()
        coord.new_step()
        if processed and not retire_in_allocate:
            coord.retire("prefill", processed)
        computed = req.num_computed_tokens
        n = min(budget, P - computed)
        if computed + n < P:
            n = n // bs * bs
        last_boundary = (P - 1) // bs * bs  # stop once there, so a repeat of the prompt can hit
        if computed < last_boundary < computed + n:
            n = last_boundary - computed
        if steps == 0:
            blocks, hit = coord.get_computed_blocks(req)
            out = coord.allocate(req, n - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks, num_draft_tokens=0)
        elif retire_in_allocate:
            out = coord.allocate(req, n, num_draft_tokens=0, num_processed_tokens=processed)
        else:
            out = coord.allocate(req, n, num_draft_tokens=0)
        coord.take_copy_plan()
        coord.take_zero_plan()
        sched_s += time.perf_counter() - t0
        assert out is not None, "pool too small"
        req.num_computed_tokens += n
        pending.append(req.num_computed_tokens)
        steps += 1
        mamba_peak = max(mamba_peak, max(m.num_held_blocks("prefill") for m in mamba))
    coord.free("prefill")
    return {"steps": steps, "sched_s": sched_s, "hash_s": hash_s, "mamba_peak": mamba_peak}


def decode_setup(num_reqs: int, prompt_len: int = 2000, steps: int = 200, nspec: int = 5,
                 seed: int = 0) -> tuple[KVCacheCoordinator, list[Request]]:
    """`num_reqs` running requests with `prompt_len`-token prompts already prefilled."""
    per_req = -(-(prompt_len + steps + 1) // 544) + 3 * (3 + nspec)
    coord = KVCacheCoordinator(qwen3_next_config(nspec, num_blocks=num_reqs * per_req + 64), max_model_len=1 << 20)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num_reqs):
        req = Request(f"d{i}", rng.integers(0, VOCAB, prompt_len, dtype=np.int32))
        blocks, hit = coord.get_computed_blocks(req)
        assert coord.allocate(req, prompt_len - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                              num_draft_tokens=0)
        req.num_computed_tokens = prompt_len
        coord.retire(req.request_id, prompt_len)
        req.append_output_token_ids(int(rng.integers(VOCAB)))
        reqs.append(req)
    coord.take_copy_plan()
    coord.take_zero_plan()
    return coord, reqs


def decode_steps(coord: KVCacheCoordinator, reqs: list[Request], steps: int = 200) -> tuple[float, float]:
    """`steps` synchronous decode steps of every request; returns (allocate seconds, allocate +
    retire seconds). Appending the sampled token (the engine's work) is not timed."""
    alloc_s = total_s = 0.0
    allocate, retire = coord.allocate, coord.retire
    perf = time.perf_counter
    for _ in range(steps):
        coord.new_step()
        t0 = perf()
        for req in reqs:
            allocate(req, 1, num_draft_tokens=0)
        t1 = perf()
        for req in reqs:
            req.num_computed_tokens += 1
            req.append_output_token_ids(7)
        t2 = perf()
        for req in reqs:
            retire(req.request_id, req.num_computed_tokens)
        t3 = perf()
        coord.take_copy_plan()
        alloc_s += t1 - t0
        total_s += (t1 - t0) + (t3 - t2)
    return alloc_s, total_s
