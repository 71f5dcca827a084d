"""Pairs of pool calls that a prefill chunk makes back to back, in one pass each, with the same
result as the two calls (blocks, ref counts, queue order, prefix-cache map, eviction count):

=====================  =================================================================
``free_then_get``      ``free_blocks(freed)`` then ``get_new_blocks(num_new)``: a Mamba
                       chunk of a manager used alone frees its old running state, then
                       takes one block
``get_then_cache``     ``get_new_blocks(n)`` and ``cache_full_blocks`` of the first of
                       them: an attention table's chunk of full blocks (hashes new to
                       the group only; else None: make the two calls)
``cache_then_free``    ``cache_state_blocks(states, ...)`` then ``free_blocks(freed)``: a
                       Mamba retire publishes the boundary state, frees the older one
=====================  =================================================================

Each one takes the two calls whenever anything is unusual: KV events on (their order is the
two calls'), a block that is not plainly fresh / held, or a pool class that overrides one of
the calls (a subclass that notes requeued blocks, a teeth test's planted rule).

``free_then_get``:
When exactly one unhashed block reaches ref count 0 and one block is wanted, the free would put
it at the head of the queue and the allocation would pop it right back: the block simply stays
out of the queue with ref count 1 (same block, same queue, same counts). Every other case, and
any pool whose ``free_blocks`` / ``_requeue`` / ``get_new_blocks`` is overridden (a subclass
that notes requeued blocks, a teeth test's planted rule), makes the two calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.prefix_map import map_state

__all__ = ["cache_then_free", "free_then_get", "get_then_cache"]


def free_then_get(pool: BlockPool, freed: list[KVCacheBlock], num_new: int) -> list[KVCacheBlock] | None:
    """``pool.free_blocks(freed)`` (if any), then ``pool.get_new_blocks(num_new)``, or None
    (the free done, nothing taken) when fewer than `num_new` blocks are free after it.

    Raises: as ``free_blocks`` (nothing changed) and ``get_new_blocks``."""
    if len(freed) == 1 and num_new == 1:
        b = freed[0]
        if b.ref_cnt == 1 and b.block_hash is None and b.pool_id == pool.pool_id and not b.is_null and pool.fused_calls:
            return freed  # freed to the head, popped right back: ref count 1, out of the queue
    if freed:
        pool.free_blocks(freed)
    if num_new > pool.free_block_queue.num_free_blocks:
        return None
    return pool.get_new_blocks(num_new)


def get_then_cache(pool: BlockPool, num_blocks: int, block_hashes: Sequence[bytes],
                   group_id: int) -> list[KVCacheBlock] | None:
    """``new = pool.get_new_blocks(num_blocks)`` and ``pool.cache_full_blocks(new[:k],
    block_hashes, group_id)`` (``0 < k = len(block_hashes) <= num_blocks``) in one walk from the
    queue head: each block is unlinked, gets ref count 1, loses the hash it still carried (an
    eviction) and, for the first k, its new hash; the group's map gains them in one update.
    Only for hashes new to the group (a chain never repeats one): then no eviction touches
    them, so the result is that of the two calls, whenever the second runs in the step (the
    map's key order included). Otherwise it returns None and changes nothing: make the two
    calls (the second once every group's blocks are taken, as the general path does).

    Raises: as ``get_new_blocks`` (nothing changed)."""
    num_hashed = len(block_hashes)
    # (caching on, no events, BlockPool's own calls: the plain case of the two calls)
    if not (pool.fused_calls and pool.enable_caching and not pool.enable_kv_cache_events) or num_blocks > pool.free_block_queue.num_free_blocks or not 0 < num_hashed <= num_blocks:
        return None
    pm = pool.prefix_map
    m = pm.maps.get(group_id)
    if m is not None and not m.keys().isdisjoint(block_hashes):
        return None
    if m is None:
        m = pm.maps[group_id] = {}
    q = pool.free_block_queue
    head = q.head
    new = []
    walk: Any = head.next_free_block  # a real block for each of the num_blocks (counted above)
    for block_hash in block_hashes:  # the first k: taken and published
        nxt = walk.next_free_block
        walk.prev_free_block = walk.next_free_block = None
        walk.ref_cnt = 1
        if walk.block_hash is not None:
            pm.remove(walk)
        walk.block_hash = block_hash
        walk.cache_group_id = group_id
        new.append(walk)
        walk = nxt
    head.next_free_block = walk
    walk.prev_free_block = head
    q.num_free_blocks -= num_hashed
    if num_blocks > num_hashed:  # the rest: taken only (evictions still before the map update)
        new += pool.get_new_blocks(num_blocks - num_hashed)
    m.update(zip(block_hashes, new))
    return new


def cache_then_free(pool: BlockPool, states: Sequence[KVCacheBlock], block_hash: bytes | None,
                    group_ids: Sequence[int], freed: list[KVCacheBlock]) -> None:
    """``pool.cache_state_blocks(states, block_hash, group_ids)`` (skipped when `block_hash` is
    None), then ``pool.free_blocks(freed)``, in one pass when every state is a held block
    without a hash and every freed block a distinct held block of this pool (what a prefill
    chunk's retire has); otherwise the two calls, which raise as documented there.

    Raises: as the two calls."""
    # (Both lists come from the caller's own tables, whose blocks are this pool's: no pool check.)
    plain = (pool.fused_calls and pool.enable_caching and not pool.enable_kv_cache_events
             and (len(freed) < 2 or len(set(freed)) == len(freed)))
    if plain:
        for b in freed:
            if b.ref_cnt < 1:  # an earlier misuse freed it: the two calls raise DoubleFreeError
                plain = False
        if block_hash is not None:
            for b in states:
                if b.block_hash is not None or b.ref_cnt < 1 or b.is_null:
                    plain = False
    if not plain:
        if block_hash is not None:
            pool.cache_state_blocks(states, block_hash, group_ids)
        if freed:
            pool.free_blocks(freed)
        return
    if block_hash is not None:
        map_state(pool.prefix_map.maps, states, block_hash, group_ids)
    q = pool.free_block_queue
    tail = q.tail
    last = tail.prev_free_block
    unhashed: list[KVCacheBlock] = []
    for block in freed:  # free_blocks' requeue, inlined: hashed to the tail, unhashed (rare) to the head, in order
        ref_cnt = block.ref_cnt = block.ref_cnt - 1
        if ref_cnt:
            continue
        if block.block_hash is None:
            unhashed.append(block)
            continue
        last.next_free_block = block  # type: ignore[union-attr]
        block.prev_free_block = last
        last = block
        q.num_free_blocks += 1
    last.next_free_block = tail  # type: ignore[union-attr]
    tail.prev_free_block = last
    if unhashed:
        q.prepend_n(unhashed, checked=False)
