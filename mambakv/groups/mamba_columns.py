"""One Mamba policy over several block columns (groups with an identical spec).

A model with 3 identical Mamba groups keeps one :class:`MambaTable` per request whose
``columns`` are the three groups' block lists; the leader does the per-request work once::

    leader table   columns[0]  [0 0 0 R S S S]     group 1 (the leader's own ``blocks``)
                   columns[1]  [0 0 0 R S S S]     group 3 (its ``_tables`` holds a ColumnTable view)
                   columns[2]  [0 0 0 R S S S]     group 5

Only the block ids differ between columns; slots, tags and steps are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import InvalidRequestError, InvalidSpecError
from mambakv.groups.base import num_evictable
from mambakv.groups.drafts import ColumnTable, DraftsMixin, MambaTable

if TYPE_CHECKING:
    from mambakv.groups.mamba import MambaManager

__all__ = ["ColumnsMixin"]


class ColumnsMixin(DraftsMixin):
    """``share_policy`` and the per-column halves of counting and hits."""

    num_speculative_blocks: int
    _column_managers: tuple[MambaManager, ...]
    _column_ids: tuple[int, ...]
    _fused: bool

    def share_policy(self, followers: Sequence[MambaManager]) -> None:
        """Drive the tables of `followers` (groups with an identical spec) with this manager's
        policy: their per-request work is done once, for every block column, so a decode or
        prefill step of a model with 3 identical Mamba groups does its bookkeeping once.
        Only before any request holds blocks.

        Raises:
            InvalidSpecError: a follower's spec differs, or a table already exists."""
        for f in followers:
            if f.kv_cache_spec != self.kv_cache_spec or f.block_pool is not self.block_pool:
                raise InvalidSpecError(f"group {f.kv_cache_group_id} cannot share group {self.kv_cache_group_id}'s policy")
        if self._tables or any(f._tables for f in followers):
            raise InvalidSpecError("share_policy before any request holds blocks")
        for f in followers:
            f.is_follower = True
            f._fused = f.chunks = False  # a follower is driven through its leader
        self._column_managers = (self, *followers)  # type: ignore[arg-type]  # self is a MambaManager
        self._column_ids = tuple(m.kv_cache_group_id for m in self._column_managers)
        self._fused = False  # the fused step drives one column

    @property
    def column_ids(self) -> tuple[int, ...]:
        return self._column_ids

    def table(self, request_id: str) -> MambaTable:
        """The request's table (created with one block column per sharing group)."""
        t = self._tables.get(request_id)
        if t is None:
            new = self.table_class()
            assert isinstance(new, MambaTable)
            t = self._tables[request_id] = new
            for f in self._column_managers[1:]:
                col: list[KVCacheBlock] = []
                t.columns.append(col)
                f._tables[request_id] = ColumnTable(t, col)  # type: ignore[assignment]  # a read-only view
        return t

    def count_columns(self, request_id: str, num_tokens: int, hits: Sequence[Sequence[KVCacheBlock]],
                      num_computed_tokens: int, num_lookahead_tokens: int) -> int:
        """``get_num_blocks_to_allocate`` times the columns, plus every column's evictable hits."""
        n = self.get_num_blocks_to_allocate(request_id, num_tokens, hits[0], num_computed_tokens,
                                            num_lookahead_tokens)
        if len(self._column_managers) == 1 or not n:
            return n
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            return (1 + self.num_speculative_blocks) * len(hits) + sum(num_evictable(h) for h in hits if h)
        return n * len(hits)

    def add_hits(self, request_id: str, hits: Sequence[Sequence[KVCacheBlock]]) -> None:
        """A new request's hit in every column: one touch for all of them."""
        self._check_leader()
        if not hits[0]:
            return
        t = self._tables.get(request_id)
        if t is not None and t.blocks:
            raise InvalidRequestError(f"request {request_id!r} already holds blocks; hits are for new requests")
        self.block_pool.touch([b for h in hits for b in h])
        t = self.table(request_id)
        for col, h in zip(t.columns, hits):
            col.extend(h)
        t.num_cached_blocks = len(t.blocks)

    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """A new request's prefix hit (one column: see ``add_hits`` for a shared policy)."""
        if len(self._column_managers) > 1:
            raise InvalidRequestError("a shared Mamba policy takes every column's hits at once (add_hits)")
        self.add_hits(request_id, (new_computed_blocks,))
