"""BlockPool's checks: the refusals of bad input off its hot paths, and its invariants.

The pool's entry points do the cheap test inline (one identity pass, one compare per block) and
call here only to name the culprit and raise, or to undo a half-done free first::

    free_blocks([b3, b5, b3])   len(set) != len   -> first_duplicate_id -> DoubleFreeError(3)
    free_blocks([b3, b5])       b5 at ref 0        -> undo_free: b3 back to its ref count, raise
    evict_blocks([2, -1])                          -> checked_block_ids: InvalidBlockError(-1)

:func:`check_pool` is ``BlockPool.check_invariants``; the map's own part is
``PrefixMap.check_invariants``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, NoReturn

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import DoubleFreeError, InvalidBlockError

if TYPE_CHECKING:
    from mambakv.core.block_pool import BlockPool

__all__ = ["check_pool", "checked_block_ids", "first_duplicate_id", "keeps_calls", "record_own_calls", "undo_free"]

#: base class -> its own versions of the calls a one-pass form stands in for, taken at import
_OWN_CALLS: dict[type, dict[str, object]] = {}


def record_own_calls(base: type, names: Iterable[str]) -> None:
    """Keep `base`'s own versions of `names` (called once, right after the class is defined),
    so that ``keeps_calls`` also sees a rule planted on `base` itself (the teeth tests'
    ``monkeypatch.setattr(BlockPool, ...)`` / ``(MambaManager, ...)``)."""
    _OWN_CALLS[base] = {n: getattr(base, n) for n in names}


def keeps_calls(cls: type, base: type, names: Iterable[str]) -> bool:
    """True when `cls` keeps `base`'s own version of every method in `names` (as `base` defined
    them, when ``record_own_calls`` kept them): a subclass that changes one, or a rule planted
    on `base` itself (a teeth test's, an engine's own pool or policy), opts out of the one-pass
    forms that stand in for them (``BlockPool.fused_calls``, a manager's ``chunks``)."""
    own = _OWN_CALLS.get(base)
    if own is None:
        return all(getattr(cls, n) is getattr(base, n) for n in names)
    return all(getattr(cls, n) is own[n] for n in names)


def first_duplicate_id(blocks: Iterable[KVCacheBlock]) -> int:
    """The id of the first non-null block listed twice in `blocks` (there must be one)."""
    ids = [b.block_id for b in blocks if not b.is_null]
    return next(i for i in ids if ids.count(i) > 1)


def undo_free(blocks: list[KVCacheBlock], bad: KVCacheBlock, pool_id: int) -> NoReturn:
    """`bad` is at ref count 0 or another pool's: restore the blocks of `blocks` before it
    (already decremented by ``free_blocks``), then raise InvalidBlockError (another pool) or
    DoubleFreeError."""
    for block in blocks[: blocks.index(bad)]:
        block.ref_cnt += 1
    if bad.pool_id != pool_id:
        raise InvalidBlockError(f"block {bad.block_id} belongs to another pool")
    raise DoubleFreeError(f"block {bad.block_id} freed at ref count {bad.ref_cnt}")


def checked_block_ids(block_ids: Iterable[int], num_blocks: int) -> list[int]:
    """`block_ids` as ints, each in ``0 .. num_blocks - 1`` (ints and numpy integers; not
    floats, and no negative id that would index from the end).

    Raises:
        InvalidBlockError: a non-integer or out-of-range id (the first one)."""
    ids = []
    for block_id in block_ids:
        try:
            i = operator.index(block_id)
        except TypeError:
            raise InvalidBlockError(f"block id {block_id!r} is not an integer") from None
        if not 0 <= i < num_blocks:
            raise InvalidBlockError(f"block id {block_id!r} outside 0..{num_blocks - 1}")
        ids.append(i)
    return ids


def check_pool(pool: BlockPool) -> None:
    """The assertions of ``BlockPool.check_invariants`` (listed there), on `pool`."""
    q = pool.free_block_queue
    q.check_invariants()
    null = pool.null_block
    assert null.block_id == 0 and null.is_null and null.block_hash is None
    assert null.prev_free_block is None and null.next_free_block is None, "null block queued"
    assert null.ref_cnt == 0, f"null block ref count {null.ref_cnt}"
    queued = {b.block_id for b in q.get_all_free_blocks()}
    assert 0 not in queued
    seen_hashed: KVCacheBlock | None = None  # unhashed free blocks first (get_new_unhashed_block relies on it)
    for b in q.get_all_free_blocks():
        if b.block_hash is not None:
            seen_hashed = seen_hashed or b
        else:
            assert seen_hashed is None, (f"free queue: unhashed block {b.block_id} behind cached block "
                                         f"{seen_hashed.block_id}")
    hashed = 0
    for b in pool.blocks[1:]:
        assert not b.is_null
        assert b.ref_cnt >= 0
        assert (b.block_id in queued) == (b.ref_cnt == 0), f"block {b.block_id} ref {b.ref_cnt} vs queue"
        if b.block_hash is not None:
            hashed += 1
    pool.prefix_map.check_invariants(hashed)
