"""Helpers shared by the coordinator and publication tests: configs, a step driver and a
snapshot of every piece of pool / table state (to prove that a failed call changed nothing)."""

from __future__ import annotations

from mambakv import FullAttentionSpec, KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, Request, SlidingWindowSpec
from tests.helpers import mamba_spec


def fa_spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 8, "float16")


def sw_spec(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 1, 8, "float16", sliding_window=window)


def coordinator(num_blocks: int, *specs, max_model_len: int = 4096, **kw) -> KVCacheCoordinator:
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    return KVCacheCoordinator(KVCacheConfig(num_blocks, groups), max_model_len=max_model_len, **kw)


def mamba_coordinator(block_size: int, num_blocks: int = 32, nspec: int = 0, **kw) -> KVCacheCoordinator:
    return coordinator(num_blocks, mamba_spec(block_size, nspec), **kw)


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def step(coord: KVCacheCoordinator, req: Request, num_new: int, **kw):
    """allocate + advance the computed count (what the engine does after scheduling)."""
    out = coord.allocate(req, num_new, **kw)
    assert out is not None
    req.num_computed_tokens += num_new + kw.get("num_new_computed_tokens", 0)
    coord.check_invariants()
    return out


def prefill(coord: KVCacheCoordinator, req: Request, chunk_ends, *, retire: bool = True) -> None:
    """Prefill in chunks ending at `chunk_ends`, retiring to the computed tokens before each
    later chunk and after the last (synchronous scheduling)."""
    for end in chunk_ends:
        if retire and req.num_computed_tokens:
            coord.retire(req.request_id, req.num_computed_tokens)
        step(coord, req, end - req.num_computed_tokens)
    if retire:
        coord.retire(req.request_id, req.num_computed_tokens)
    coord.take_copy_plan(), coord.take_zero_plan()
    coord.check_invariants()


def free_queue_ids(coord: KVCacheCoordinator) -> list[int]:
    return [b.block_id for b in coord.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(coord: KVCacheCoordinator, request_ids=()) -> tuple:
    """Free queue order, every block's (ref count, hash, group), the prefix-cache map and the
    tables of `request_ids`."""
    pool = coord.block_pool
    blocks = [(b.ref_cnt, b.block_hash, b.cache_group_id) for b in pool.blocks]
    cache = {gid: {h: (e.block_id if not isinstance(e, dict) else tuple(sorted(e))) for h, e in m.items()}
             for gid, m in pool.cached_block_hash_to_block.items()}
    tables = {rid: coord.get_block_ids(rid) for rid in request_ids}
    return pool.get_num_free_blocks(), free_queue_ids(coord), blocks, cache, tables
