"""SingleTypeKVCacheManager: the block tables of one KV-cache group, and the contract every
group kind keeps.

One manager per group; all managers of a layout share its pools. A manager keeps, per request,
one small slotted :class:`BlockTable` (table, cached-block cursor, retirement watermark); ``free``
drops that object, so no per-request bookkeeping can be forgotten. The coordinator's
per-request state holds the same table objects, so its hot path never looks a request up twice.

Every step flows one way through a manager (the coordinator drives it; a manager also works
alone, through the vLLM-named calls in brackets)::

    check    raises a typed error, nothing changed          e.g. drafts > scratch blocks
    count    count_columns     [get_num_blocks_to_allocate]  an upper bound, pure
    commit   add_hits, allocate_columns                      take blocks, record the step
             [add_computed_blocks, allocate_new_blocks]
    publish  cache_blocks                                    full / settled blocks -> prefix cache
    retire   dead_slots, then retire_slots and settle        publish first, then retire
             [remove_skipped_blocks]
    free     check_free, then free                           the table goes back to the pool

The *columns* calls serve a policy shared by several groups with one spec (Mamba groups: see
:meth:`mambakv.groups.mamba.MambaManager.share_policy`): one list per group the policy drives.
Attention policies drive one column, their own.

Also here: the table types and the block keys every group reads (``group_block_hashes``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.engine_request import EngineRequest
from mambakv.core.errors import (
    DoubleFreeError,
    HashBlockSizeMismatchError,
    InvalidRequestError,
    InvalidTokenCountError,
)
from mambakv.core.events import stored_event_fields
from mambakv.core.spec import KVCacheSpec
from mambakv.groups.kinds import GroupKind
from mambakv.plans import TableView

__all__ = ["NEVER", "BlockHashView", "BlockTable", "SingleTypeKVCacheManager", "TableMapping", "cdiv",
           "group_block_hashes", "num_evictable"]

#: "never": a token count no request reaches (the quiet thresholds and next events use it)
NEVER = 1 << 62


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(a // -b)


# ---------------------------------------------------------------------- block keys
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


def group_block_hashes(request: EngineRequest, block_size: int) -> Sequence[bytes]:
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


def num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
    """Hit blocks that sit in the free queue (ref count 0): touching them uses free capacity."""
    return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)


# ---------------------------------------------------------------------- tables
class BlockTable:
    """One request's table in one group.

    Attributes:
        blocks: the block table; entry i covers tokens ``[i*bs, (i+1)*bs)``.
        num_cached_blocks: entries below this were published (or are hits / nulls).
        retired_below: the retirement watermark: every entry below it is the null block and
            is never scanned again.
    """

    __slots__ = ("blocks", "num_cached_blocks", "retired_below")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached_blocks = 0
        self.retired_below = 0


class TableMapping(Mapping[str, list[KVCacheBlock]]):
    """``req_to_blocks``: a read-only mapping request id -> block table, over the per-request
    objects (no second dict to keep in sync)."""

    __slots__ = ("_tables",)

    def __init__(self, tables: Mapping[str, BlockTable]) -> None:
        self._tables = tables

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        return self._tables[request_id].blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)


# ---------------------------------------------------------------------- the contract
class SingleTypeKVCacheManager(ABC):
    """Block tables of one KV-cache group, and the contract of a group kind.

    Args:
        kv_cache_spec: the group's spec (its ``block_size`` is the table granularity).
        block_pool: the pool the group takes blocks from.
        enable_caching: publish full blocks to, and look hits up in, the prefix cache.
        kv_cache_group_id: the group's index (keys of the pool's prefix-cache map).

    A kind sets the class attributes below and implements ``_find_hit``; it overrides a step
    only where its rule differs (Mamba overrides most of them). Every method that changes state
    raises before it changes anything.
    """

    #: the group kind (dispatch by enum, never by class name)
    kind: ClassVar[GroupKind]
    #: True when full blocks are published at allocation (attention: KV is written before it
    #: is read). Mamba states are published by ``cache_blocks`` with *processed* tokens.
    publishes_at_allocation: ClassVar[bool] = True
    #: False when nothing is ever retired (full attention)
    retires: bool = True
    #: trailing processed tokens a request still needs (the rest are skipped): the window
    #: minus one for sliding window, 1 for a Mamba state, all of them for full attention
    num_kept_tokens: int = NEVER
    #: a manager that shares another group's policy (identical spec) is driven by that
    #: group's manager; the coordinator never calls it directly
    is_follower = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching and block_pool.enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.null_block = block_pool.null_block
        self._tables: dict[str, BlockTable] = {}
        self.req_to_blocks: Mapping[str, list[KVCacheBlock]] = TableMapping(self._tables)
        #: the groups whose tables this manager drives: its own (plus a shared policy's others)
        self.column_ids: tuple[int, ...] = (kv_cache_group_id,)

    # ------------------------------------------------------------------ tables
    def table(self, request_id: str) -> BlockTable:
        """The request's table, created empty on first use (the coordinator keeps it)."""
        t = self._tables.get(request_id)
        if t is None:
            t = self._tables[request_id] = BlockTable()
        return t

    def get_table(self, request_id: str) -> BlockTable | None:
        """The request's table, or None (read-only use: do not mutate it)."""
        return self._tables.get(request_id)

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def describe(self, request_id: str) -> TableView | None:
        """A read-only snapshot of the request's table (None for an unknown request)."""
        t = self._tables.get(request_id)
        if t is None:
            return None
        return TableView(self.kv_cache_group_id, tuple(b.block_id for b in t.blocks), t.num_cached_blocks,
                         t.retired_below)

    # ------------------------------------------------------------------ the coordinator's thresholds
    def thresholds(self, table: BlockTable) -> tuple[int, int]:
        """``(covered, quiet)`` tokens of `table`: a running step up to `covered` tokens
        (lookahead included) needs no new block; one without drafts up to `quiet` main tokens
        has no effect on this group but counting (no block, no publication, nothing to
        record). A table publishes its next block once it is full, so `quiet` stops one token
        short of that. Pure."""
        covered = len(table.blocks) * self.block_size
        if not self.enable_caching:
            return covered, covered
        quiet = (table.num_cached_blocks + 1) * self.block_size - 1
        return covered, quiet if quiet < covered else covered

    def quiet_tokens(self, table: BlockTable) -> int:
        """The `quiet` half of ``thresholds``."""
        return self.thresholds(table)[1]

    def next_event(self, table: BlockTable) -> int:
        """The smallest processed-token count at which ``cache_blocks`` + retirement would
        change `table`: the next block to publish (kinds that publish at allocation), or the
        next slot to retire (``(watermark + 1) * bs + num_kept_tokens``); ``NEVER`` when
        nothing ever will. Below it, the coordinator's ``retire`` skips this group. Pure."""
        bs = self.block_size
        nxt = (table.num_cached_blocks + 1) * bs if self.enable_caching and self.publishes_at_allocation else NEVER
        if self.retires:
            # (n - kept) // bs > watermark  <=>  n >= (watermark + 1) * bs + kept
            retire = (table.retired_below + 1) * bs + self.num_kept_tokens
            if retire < nxt:
                nxt = retire
        return nxt

    def num_covered_tokens(self, request_id: str) -> int:
        """Tokens (lookahead included) the request's table covers without a new block:
        ``get_num_blocks_to_allocate`` is 0 for any running step up to this many."""
        t = self._tables.get(request_id)
        return 0 if t is None else len(t.blocks) * self.block_size

    # ------------------------------------------------------------------ count
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = (),
                                   num_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """Upper bound of the free blocks that ``add_computed_blocks(new_computed_blocks)`` +
        ``allocate_new_blocks(num_tokens, num_lookahead_tokens)`` will consume: new blocks plus
        hit blocks still in the free queue (touching one takes it out). Pure."""
        t = self._tables.get(request_id)
        held = len(t.blocks) if t is not None else 0
        missing = -((num_tokens + num_lookahead_tokens) // -self.block_size) - held
        if new_computed_blocks:
            return max(0, missing - len(new_computed_blocks)) + num_evictable(new_computed_blocks)
        return missing if missing > 0 else 0

    def count_columns(self, request_id: str, num_tokens: int, hits: Sequence[Sequence[KVCacheBlock]],
                      num_computed_tokens: int, num_lookahead_tokens: int) -> int:
        """``get_num_blocks_to_allocate`` over every column the manager drives (`hits`: one
        list per column). Pure."""
        return self.get_num_blocks_to_allocate(request_id, num_tokens, hits[0], num_computed_tokens,
                                               num_lookahead_tokens)

    # ------------------------------------------------------------------ commit
    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """A new request's prefix hit: touch the hit blocks and start its table with them.

        Raises (nothing changed):
            InvalidRequestError: the request already holds blocks (hits are for new requests).
            InvalidBlockError: a real block listed twice (from ``BlockPool.touch``).
        """
        self.add_hits(request_id, (new_computed_blocks,))

    def add_hits(self, request_id: str, hits: Sequence[Sequence[KVCacheBlock]]) -> None:
        """``add_computed_blocks`` over every column (`hits`: one list per column).

        Raises: as ``add_computed_blocks``."""
        hit = hits[0]
        if not hit:
            return
        t = self._tables.get(request_id)
        if t is not None and t.blocks:
            raise InvalidRequestError(f"request {request_id!r} already holds blocks; hits are for new requests")
        self.block_pool.touch(hit)
        t = self.table(request_id)
        t.blocks.extend(hit)
        t.num_cached_blocks = len(t.blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens + num_lookahead_tokens`` tokens; return the new
        blocks (empty if it already does). `num_draft_tokens` (unverified drafts among the
        tokens) matters to Mamba groups only.

        Raises (nothing changed):
            OutOfBlocksError: the pool is short (count first, as the coordinator does).
        """
        return self.allocate_columns(request_id, num_tokens, num_lookahead_tokens, num_draft_tokens)[0]

    def allocate_columns(self, request_id: str, num_tokens: int, num_lookahead_tokens: int,
                         num_draft_tokens: int, *, decode: bool = False,
                         num_computed_tokens: int | None = None) -> list[list[KVCacheBlock]]:
        """``allocate_new_blocks`` over every column: the new blocks of each. `decode` (the
        prompt was computed before the step) and `num_computed_tokens` (tokens computed before
        it) matter to Mamba groups only.

        Raises: as ``allocate_new_blocks``."""
        t = self._tables.get(request_id) or self.table(request_id)
        n = -((num_tokens + num_lookahead_tokens) // -self.block_size) - len(t.blocks)
        if n <= 0:
            return [[]]
        new = self.block_pool.get_new_blocks(n)
        t.blocks += new
        return [new]

    # ------------------------------------------------------------------ publish
    def cache_blocks(self, request: EngineRequest, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first `num_tokens` tokens
        (which must be real tokens, never unverified drafts). Nulls are skipped.

        Raises:
            HashBlockSizeMismatchError: the request hashes with a block size that does not
                divide this group's.
        """
        t = self._tables.get(request.request_id)
        if t is None or not self.enable_caching:
            return
        bs = self.block_size
        start = t.num_cached_blocks
        num_full = num_tokens // bs
        if num_full <= start:
            return  # the common decode step: no block became full
        keys = request.block_hashes if request.hash_block_size == bs else group_block_hashes(request, bs)
        num_full = min(num_full, len(t.blocks), len(keys))
        if num_full <= start:
            return
        pool = self.block_pool
        if pool.enable_kv_cache_events:
            pool.cache_full_blocks(t.blocks[start:num_full], keys[start:num_full], self.kv_cache_group_id,
                                   **stored_event_fields(request, keys, start, num_full, bs))
        else:
            pool.cache_full_blocks(t.blocks[start:num_full], keys[start:num_full], self.kv_cache_group_id)
        t.num_cached_blocks = num_full

    # ------------------------------------------------------------------ retire
    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Retire: replace blocks ``[0, skipped // block_size)`` with the null block and free
        them (deepest first). Idempotent; a request holding no blocks is a no-op.

        Raises (nothing changed):
            InvalidTokenCountError: `num_processed_tokens` is negative.
            DoubleFreeError: a retired block is already free (from ``BlockPool.free_blocks``).
        """
        if num_processed_tokens < 0:
            raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
        t = self._tables.get(request_id)
        if t is None:
            return
        num_slots = self.dead_slots(t, num_processed_tokens)
        if num_slots > t.retired_below:
            self.retire_slots(t, num_slots)
        self.settle(t, num_processed_tokens)

    def dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int:
        """Leading slots no longer needed once `num_processed_tokens` are processed
        (``(n - num_kept_tokens) // block_size``; 0 when the group never retires), raising what
        retiring them would raise. Pure: the coordinator checks every group this way before any
        publishes or retires."""
        if not self.retires:
            return 0
        return (num_processed_tokens - self.num_kept_tokens) // self.block_size

    def retire_slots(self, table: BlockTable, num_slots: int) -> None:
        """Retire slots ``[watermark, num_slots)``: free their real blocks deepest first,
        skipping null gaps, then null the slots and move the watermark up. All or nothing (the
        free raises before it changes anything); amortised O(new blocks), no slot is scanned
        twice::

            before  [old, null, committed, in_flight]   watermark 0, num_slots 3
            frees   [committed, old]
            after   [null, null, null, in_flight]       watermark 3

        The documented override point of retirement: the fuzzer's teeth plant vLLM's pre-fix
        walk (stop at the first null, no watermark) here, through a subclass or an instance."""
        blocks, null = table.blocks, self.null_block
        stop = min(num_slots, len(blocks))
        low = table.retired_below
        if stop <= low:
            return
        freed = [blocks[i] for i in range(stop - 1, low - 1, -1) if blocks[i] is not null]
        if freed:
            self.block_pool.free_blocks(freed)
        blocks[low:stop] = [null] * (stop - low)
        table.retired_below = stop

    def settle(self, table: BlockTable, num_processed_tokens: int) -> None:
        """Forget what `num_processed_tokens` settled, after ``retire_slots`` (nothing for the
        attention kinds)."""
        return None

    # ------------------------------------------------------------------ free
    def check_free(self, request_id: str) -> None:
        """Raise DoubleFreeError (nothing changed) if ``free(request_id)`` would fail: lets the
        coordinator free every group or none."""
        t = self._tables.get(request_id)
        if t is not None:
            for b in t.blocks[t.retired_below:]:
                if b.ref_cnt <= 0 and not b.is_null:
                    raise DoubleFreeError(f"block {b.block_id} of request {request_id!r} is already free")

    def free(self, request_id: str) -> None:
        """Drop the request: free its table tail-first (deepest blocks reach the eviction end
        of the LRU first) and every piece of its bookkeeping. Unknown ids are a no-op.

        Raises (nothing changed):
            DoubleFreeError: a block of the table is already free.
        """
        t = self._tables.get(request_id)
        if t is not None:
            tail = t.blocks[t.retired_below:]  # below the watermark every slot is null
            tail.reverse()
            self.block_pool.free_blocks(tail)
            del self._tables[request_id]

    # ------------------------------------------------------------------ prefix hits
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               use_eagle: bool = False) -> tuple[list[KVCacheBlock], ...]:
        """The longest prefix hit of at most `max_length` tokens whose length is a multiple of
        `alignment_tokens` (and of the block size), valid in every group of `kv_cache_group_ids`.

        `block_hashes` are keys at this spec's block size. Returns one list per group; the hit
        length is ``len(list) * block_size``; leading entries may be the null block. With
        `use_eagle`, the hit is recomputed once at the next aligned length below it (the last
        hit position must be recomputed for the drafter). An alignment that is not a multiple
        of the block size is raised to the least common multiple of the two (blocks of 4,
        alignment 2: hits end on multiples of 4). Pure.

        Raises:
            InvalidTokenCountError: `alignment_tokens` is not a positive int.
        """
        if type(alignment_tokens) is not int or alignment_tokens < 1:
            raise InvalidTokenCountError(f"alignment_tokens must be a positive int, got {alignment_tokens!r}")
        align = math.lcm(alignment_tokens, kv_cache_spec.block_size)
        hit = cls._find_hit(block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, align)
        if use_eagle and hit[0]:
            length = len(hit[0]) * kv_cache_spec.block_size
            back = (length - 1) // align * align
            hit = cls._find_hit(block_hashes, back, kv_cache_group_ids, block_pool, kv_cache_spec, align)
        return hit

    @classmethod
    @abstractmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The hit without EAGLE back-off (see ``find_longest_cache_hit``); `alignment_tokens`
        is a multiple of the block size here."""

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Assert per-request bookkeeping: the watermark within the table and every entry
        below it null, held blocks at ref count >= 1, the cached cursor within the table."""
        null = self.null_block
        for rid, t in self._tables.items():
            blocks = t.blocks
            assert 0 <= t.retired_below <= len(blocks), f"{rid}: watermark {t.retired_below} outside the table"
            for i in range(t.retired_below):
                assert blocks[i] is null, f"{rid}: slot {i} below watermark is not null"
            for b in blocks:
                assert b is null or b.ref_cnt >= 1, f"{rid}: held block {b.block_id} at ref 0"
            assert 0 <= t.num_cached_blocks <= len(blocks), f"{rid}: cached cursor {t.num_cached_blocks} outside"
