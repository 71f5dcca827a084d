"""Per-request tables and block keys of one group: ``BlockTable`` (the slotted per-request
object), the read-only ``req_to_blocks`` view over the tables, and a group's block keys taken
from a request's finer hash blocks without re-hashing (``group_block_hashes``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import HashBlockSizeMismatchError
from mambakv.core.request import Request

__all__ = ["NEVER", "BlockHashView", "BlockTable", "RequestBlocks", "TableMapping", "cdiv", "group_block_hashes",
           "num_evictable", "real_slots"]

#: "never": a token count no request reaches (the quiet thresholds use it)
NEVER = 1 << 62


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(a // -b)


class BlockHashView(Sequence[bytes]):
    """Keys of a group's blocks from a request's finer hash blocks, without copying.

    ``view[i]`` is the fine digest that ends block i: a chained digest covers its whole prefix,
    so it keys the coarse block without re-hashing a token::

        fine:   h0 h1 h2 h3 | h4 h5 h6 h7 | h8 ..      ratio 4
        coarse:          h3 |          h7 |
    """

    __slots__ = ("_fine", "_ratio")

    def __init__(self, fine: Sequence[bytes], ratio: int) -> None:
        self._fine = fine
        self._ratio = ratio

    def __len__(self) -> int:
        return len(self._fine) // self._ratio

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self._fine[(i + 1) * self._ratio - 1]


def group_block_hashes(request: Request, block_size: int) -> Sequence[bytes]:
    """The request's block keys at `block_size` granularity. A request without a hash block
    size adopts `block_size`.

    Raises:
        HashBlockSizeMismatchError: `block_size` is not a multiple of the request's hash block size.
    """
    hbs = request.hash_block_size
    if hbs is None:
        request.set_hash_block_size(block_size)
        hbs = block_size
    if block_size % hbs:
        raise HashBlockSizeMismatchError(
            f"block size {block_size} is not a multiple of request {request.request_id!r}'s "
            f"hash block size {hbs}"
        )
    fine = request.block_hashes
    return fine if hbs == block_size else BlockHashView(fine, block_size // hbs)


class BlockTable:
    """One request's table in one group.

    Attributes:
        blocks: the block table; entry i covers tokens ``[i*bs, (i+1)*bs)``.
        num_cached_blocks: entries below this were published (or are hits/nulls).
        retired_below: the retirement watermark: every entry below it is the null block and
            is never scanned again.
    """

    __slots__ = ("blocks", "num_cached_blocks", "retired_below")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached_blocks = 0
        self.retired_below = 0


#: the 0.1 name of :class:`BlockTable`
RequestBlocks = BlockTable


class TableMapping(Mapping[str, list[KVCacheBlock]]):
    """``req_to_blocks``: a read-only mapping request id -> block table, over the per-request
    objects (no second dict to keep in sync)."""

    __slots__ = ("_tables",)

    def __init__(self, tables: dict[str, BlockTable]) -> None:
        self._tables = tables

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        return self._tables[request_id].blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)


def num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
    """Hit blocks that sit in the free queue (ref count 0): touching them uses free capacity."""
    return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)


_num_evictable = num_evictable  # the 0.1 name


def real_slots(blocks: list[KVCacheBlock], low: int, stop: int, null: KVCacheBlock) -> list[int]:
    """The slots in ``[low, stop)`` of `blocks` that hold a real (non-null) block, deepest
    first. A Mamba table's span below the running slot is mostly null gaps: a prefill chunk's
    retire finds one real slot (the previous boundary state, at the old watermark), which a
    count in C confirms without a scan in Python (blocks compare by identity)."""
    span = blocks[low:stop]
    num_null = span.count(null)
    if num_null == len(span):
        return []
    if num_null == len(span) - 1 and span[0] is not null:
        return [low]
    return [i for i in range(stop - 1, low - 1, -1) if blocks[i] is not null]
