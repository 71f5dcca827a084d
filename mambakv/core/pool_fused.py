"""One retirement and one allocation in one call: ``free_blocks(freed)`` then
``get_new_blocks(num_new)``, for a table that frees the block it grows into (a Mamba prefill
chunk frees its old running state, then takes one block).

When exactly one unhashed block reaches ref count 0 and one block is wanted, the free would put
it at the head of the queue and the allocation would pop it right back: the block simply stays
out of the queue with ref count 1 (same block, same queue, same counts). Every other case, and
any pool whose ``free_blocks`` / ``_requeue`` / ``get_new_blocks`` is overridden (a subclass
that notes requeued blocks, a teeth test's planted rule), makes the two calls."""

from __future__ import annotations

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool

__all__ = ["free_then_get"]

_FREE = BlockPool.free_blocks
_REQUEUE = BlockPool._requeue
_GET = BlockPool.get_new_blocks


def free_then_get(pool: BlockPool, freed: list[KVCacheBlock], num_new: int) -> list[KVCacheBlock] | None:
    """``pool.free_blocks(freed)`` (if any), then ``pool.get_new_blocks(num_new)``, or None
    (the free done, nothing taken) when fewer than `num_new` blocks are free after it.

    Raises: as ``free_blocks`` (nothing changed) and ``get_new_blocks``."""
    if len(freed) == 1 and num_new == 1:
        b = freed[0]
        cls = type(pool)
        if (b.ref_cnt == 1 and b.block_hash is None and b.pool_id == pool.pool_id and not b.is_null
                and cls.free_blocks is _FREE and cls._requeue is _REQUEUE and cls.get_new_blocks is _GET):
            return freed  # freed to the head, popped right back: ref count 1, out of the queue
    if freed:
        pool.free_blocks(freed)
    if num_new > pool.free_block_queue.num_free_blocks:
        return None
    return pool.get_new_blocks(num_new)
