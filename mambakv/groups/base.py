"""SingleTypeKVCacheManager: the block tables of one KV-cache group, and the group-policy contract.

One manager per group; all managers share one BlockPool. A manager keeps, per request, one
small slotted :class:`BlockTable` (table, cached-block cursor, retirement watermark); ``free``
drops that object, so no per-request bookkeeping can be forgotten. The coordinator's
per-request state holds the same table objects (one per group), so its hot path never looks a
request up twice.

Every step flows one way through a manager (the coordinator drives it)::

    check   (raises a typed error, nothing changed)      e.g. drafts > scratch blocks
    count   get_num_blocks_to_allocate                    an upper bound, pure
    commit  add_computed_blocks, allocate_new_blocks      take blocks, record the step
    publish cache_blocks                                  full / settled blocks -> prefix cache
    on processed: cache_blocks, remove_skipped_blocks     publish, then retire
    free                                                  the table goes back to the pool

The release half (on processed, free) is :class:`~mambakv.groups.release.ReleaseMixin`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidRequestError
from mambakv.core.events import stored_event_fields
from mambakv.core.pool_checks import record_own_calls
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheSpec
from mambakv.groups.chunks import ChunkMixin, chunks_fusable
from mambakv.groups.kinds import GroupKind
from mambakv.groups.release import ReleaseMixin
from mambakv.groups.tables import (  # re-exported: base.py is the 0.1 home of these names
    NEVER,
    BlockHashView,
    BlockTable,
    RequestBlocks,
    TableMapping,
    _num_evictable,
    cdiv,
    group_block_hashes,
    num_evictable,
)
from mambakv.plans import TableView

__all__ = ["NEVER", "BlockHashView", "BlockTable", "RequestBlocks", "SingleTypeKVCacheManager", "TableMapping",
           "_num_evictable", "cdiv", "group_block_hashes", "num_evictable"]


#: the general path's steps that the chunk path stands in for: a subclass changing one opts out
_CHUNK_STEPS = ("get_num_blocks_to_allocate", "count_columns", "allocate_new_blocks", "allocate_columns",
                "dead_slots", "settle", "thresholds", "cache_blocks")  # (get_then_cache publishes without cache_blocks)


class SingleTypeKVCacheManager(ReleaseMixin, ChunkMixin, ABC):
    """Block tables of one KV-cache group.

    Args:
        kv_cache_spec: the group's spec (its ``block_size`` is the table granularity).
        block_pool: the pool shared by every group.
        enable_caching: publish full blocks to, and look hits up in, the prefix cache.
        kv_cache_group_id: the group's index (keys of the pool's prefix-cache map).
    """

    #: the group kind (dispatch by enum, never by class name)
    kind: ClassVar[GroupKind]
    #: True when full blocks are published at allocation (attention: KV is written before it
    #: is read). Mamba states are published by ``cache_blocks`` with *processed* tokens.
    publishes_at_allocation: ClassVar[bool] = True
    #: False when nothing is ever retired (full attention): the coordinator skips the call.
    retires: bool = True
    table_class: ClassVar[type[BlockTable]] = BlockTable
    #: Trailing processed tokens a request still needs (the rest are skipped): the window
    #: minus one for sliding window, 1 for a Mamba state, all of them for full attention.
    num_kept_tokens: int = NEVER

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
        #: the coordinator's fused prefill chunk applies (mambakv.groups.chunks)
        self.chunks = chunks_fusable(self, SingleTypeKVCacheManager, _CHUNK_STEPS)

    # ------------------------------------------------------------------ tables
    def table(self, request_id: str) -> BlockTable:
        """The request's table, created empty on first use (the coordinator keeps it)."""
        t = self._tables.get(request_id)
        if t is None:
            t = self._tables[request_id] = self.table_class()
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

    def thresholds(self, table: BlockTable) -> tuple[int, int]:
        """``(covered, quiet)`` tokens of `table`: a running step up to `covered` tokens
        (lookahead included) needs no new block (``num_covered_tokens``); one without drafts up
        to `quiet` main tokens has no effect on this group but counting (no block, no
        publication, nothing to record). A table publishes its next block once it is full, so
        `quiet` stops one token short of that."""
        covered = len(table.blocks) * self.block_size
        if not self.enable_caching:
            return covered, covered
        quiet = (table.num_cached_blocks + 1) * self.block_size - 1
        return covered, quiet if quiet < covered else covered

    def quiet_tokens(self, table: BlockTable) -> int:
        """The `quiet` half of ``thresholds``."""
        return self.thresholds(table)[1]

    # ------------------------------------------------------------------ policy over columns
    #: a manager that shares another group's policy (identical spec) is driven by that
    #: group's manager ("the leader"); the coordinator never calls it directly
    is_follower = False

    @property
    def column_ids(self) -> tuple[int, ...]:
        """The groups whose tables this manager drives: its own (plus its followers')."""
        return (self.kv_cache_group_id,)

    def count_columns(self, request_id: str, num_tokens: int, hits: Sequence[Sequence[KVCacheBlock]],
                      num_computed_tokens: int, num_lookahead_tokens: int) -> int:
        """``get_num_blocks_to_allocate`` over every column (`hits`: one list per column)."""
        return self.get_num_blocks_to_allocate(request_id, num_tokens, hits[0], num_computed_tokens,
                                               num_lookahead_tokens)

    def add_hits(self, request_id: str, hits: Sequence[Sequence[KVCacheBlock]]) -> None:
        """``add_computed_blocks`` over every column."""
        if hits[0]:
            self.add_computed_blocks(request_id, hits[0])

    def allocate_columns(self, request_id: str, num_tokens: int, num_lookahead_tokens: int,
                         num_draft_tokens: int, *, decode: bool = False,
                         num_computed_tokens: int | None = None) -> list[list[KVCacheBlock]]:
        """``allocate_new_blocks`` over every column: the new blocks of each. `decode` (the
        prompt was computed before the step) and `num_computed_tokens` matter to Mamba
        groups only."""
        return [self.allocate_new_blocks(request_id, num_tokens, num_lookahead_tokens,
                                         num_draft_tokens=num_draft_tokens)]

    # ------------------------------------------------------------------ count
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = (),
                                   num_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """Upper bound of the free blocks that ``add_computed_blocks(new_computed_blocks)`` +
        ``allocate_new_blocks(num_tokens, num_lookahead_tokens)`` will consume: new blocks plus
        hit blocks still in the free queue (touching one takes it out)."""
        t = self._tables.get(request_id)
        held = len(t.blocks) if t is not None else 0
        missing = -((num_tokens + num_lookahead_tokens) // -self.block_size) - held
        if new_computed_blocks:
            return max(0, missing - len(new_computed_blocks)) + num_evictable(new_computed_blocks)
        return missing if missing > 0 else 0

    def num_covered_tokens(self, request_id: str) -> int:
        """Tokens (lookahead included) the request's table covers without a new block:
        ``get_num_blocks_to_allocate`` is 0 for any running step up to this many."""
        t = self._tables.get(request_id)
        return 0 if t is None else len(t.blocks) * self.block_size

    # ------------------------------------------------------------------ commit
    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """A new request's prefix hit: touch the hit blocks and start its table with them.

        Raises:
            InvalidRequestError: the request already holds blocks (hits are for new requests).
            InvalidBlockError: a real block listed twice (from ``BlockPool.touch``).
        """
        if not new_computed_blocks:
            return
        t = self._tables.get(request_id)
        if t is not None and t.blocks:
            raise InvalidRequestError(f"request {request_id!r} already holds blocks; hits are for new requests")
        self.block_pool.touch(new_computed_blocks)
        t = self.table(request_id)
        t.blocks.extend(new_computed_blocks)
        t.num_cached_blocks = len(t.blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens + num_lookahead_tokens`` tokens; return the new
        blocks (empty if it already does). Raises OutOfBlocksError (nothing changed) if the
        pool is short; the coordinator counts first so that never happens.
        `num_draft_tokens` (unverified drafts among the tokens) matters to Mamba groups only."""
        t = self._tables.get(request_id) or self.table(request_id)
        n = -((num_tokens + num_lookahead_tokens) // -self.block_size) - len(t.blocks)
        if n <= 0:
            return []
        new = self.block_pool.get_new_blocks(n)
        t.blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first `num_tokens` tokens
        (which must be real tokens, never unverified drafts). Nulls are skipped."""
        t = self._tables.get(request.request_id)
        if t is None or not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        start = t.num_cached_blocks
        if num_full <= start:
            return  # the common decode step: no block became full
        num_full = min(num_full, len(t.blocks))
        keys = group_block_hashes(request, self.block_size)
        num_full = min(num_full, len(keys))
        if num_full <= start:
            return
        pool = self.block_pool
        fields = (stored_event_fields(request, keys, start, num_full, self.block_size)
                  if pool.enable_kv_cache_events else {})
        pool.cache_full_blocks(t.blocks[start:num_full], keys[start:num_full], self.kv_cache_group_id, **fields)
        t.num_cached_blocks = num_full

    # ------------------------------------------------------------------ prefix hits
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               use_eagle: bool = False) -> tuple[list[KVCacheBlock], ...]:
        """The longest prefix hit of at most `max_length` tokens whose length is a multiple of
        `alignment_tokens`, valid in every group of `kv_cache_group_ids`.

        `block_hashes` are keys at this spec's block size. Returns one list per group; the hit
        length is ``len(list) * block_size``; leading entries may be the null block. With
        `use_eagle`, the hit is recomputed once at the next aligned length below it (the last
        hit position must be recomputed for the drafter).
        """
        hit = cls._find_hit(block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, alignment_tokens)
        if use_eagle and hit[0]:
            length = len(hit[0]) * kv_cache_spec.block_size
            back = (length - 1) // alignment_tokens * alignment_tokens
            hit = cls._find_hit(block_hashes, back, kv_cache_group_ids, block_pool, kv_cache_spec, alignment_tokens)
        return hit

    @classmethod
    @abstractmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The hit without EAGLE back-off (see find_longest_cache_hit)."""

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

record_own_calls(SingleTypeKVCacheManager, _CHUNK_STEPS)  # (chunks_fusable: a rule planted on the class opts out)
