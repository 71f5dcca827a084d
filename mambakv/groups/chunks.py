"""The running prefill chunk, fused: the group half of the coordinator's chunk path
(:mod:`mambakv.coordinator_steps`).

The commonest slow step of a long prompt is a running request's next prefill chunk without
drafts or hits. Each policy takes it in two calls instead of the general path's six or more::

    general path                                       chunk path
    count_columns / get_num_blocks_to_allocate   ->    chunk_need     (pure; -1: not a chunk here)
    allocate_columns, plan_checkpoint_write      ->    grow_chunk     (commit)
    dead_slots, cache_blocks, retire_slots,
      settle, next_event (at retire)             ->    chunk_retire_ok + retire_chunk

A policy answers -1 / False whenever its step is anything else (drafts pending, decode, a
subclass overriding a step of the contract), and the coordinator takes the general path; the
two paths leave the same tables, blocks, queue order and plans (``tests/test_chunk_path.py``
replays both side by side). This module holds the attention kinds' half; Mamba's is
:mod:`mambakv.groups.mamba_chunk`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.pool_checks import keeps_calls
from mambakv.core.pool_fused import get_then_cache
from mambakv.core.request import Request
from mambakv.groups.tables import BlockTable, group_block_hashes

if TYPE_CHECKING:
    from mambakv.groups.base import SingleTypeKVCacheManager

__all__ = ["ChunkMixin", "chunks_fusable"]


def chunks_fusable(manager: SingleTypeKVCacheManager, base: type, names: tuple[str, ...]) -> bool:
    """True when `manager`'s class keeps `base`'s own version of every method in `names` (as
    `base` defined them: ``record_own_calls``): a subclass that changes one, or a rule planted
    on `base` itself (a teeth test's, an engine's own policy), gets the general path, so the
    chunk path never bypasses it."""
    return keeps_calls(type(manager), base, names)


class ChunkMixin:
    """``chunk_need`` / ``grow_chunk`` / ``chunk_retire_ok`` / ``retire_chunk`` of the attention
    kinds (the table grows by whole blocks; full blocks are published at allocation)."""

    block_size: int
    block_pool: BlockPool
    enable_caching: bool
    retires: bool
    kv_cache_group_id: int
    #: the chunk path applies to this manager (set by ``SingleTypeKVCacheManager.__init__``)
    chunks: bool

    def chunk_need(self, table: BlockTable, num_tokens: int, num_lookahead_tokens: int) -> int:
        """Blocks (over every column) a running prefill chunk to `num_tokens` main tokens takes,
        or -1 when this group needs the general path. Pure."""
        if not self.chunks:
            return -1
        n = -((num_tokens + num_lookahead_tokens) // -self.block_size) - len(table.blocks)
        return n if n > 0 else 0

    def grow_chunk(self, request: Request, table: BlockTable, num_tokens: int, num_lookahead_tokens: int,
                   num_real: int, out: list[list[KVCacheBlock]]) -> tuple[int, int, int] | None:
        """Commit the chunk ``chunk_need`` counted (the caller checked that the pool has the
        blocks): grow the table and append its new blocks to `out`, one list per column.

        When every block to publish is new and its hash new to the group, the blocks full
        within `num_real` real tokens are published in the same pass
        (``pool_fused.get_then_cache``). Returns the table's ``(covered, quiet, next_event)``
        (``thresholds`` and ``next_event``) when nothing is left to publish, else None: the
        coordinator's ``cache_blocks`` publishes the rest once every policy grew (as on the
        general path), then recounts."""
        blocks = table.blocks
        bs = self.block_size
        held = len(blocks)
        n = -((num_tokens + num_lookahead_tokens) // -bs) - held
        new: list[KVCacheBlock] = []
        if n > 0:
            start = table.num_cached_blocks
            if start == held and num_real // bs > start and self.enable_caching:
                keys = request.block_hashes if request.hash_block_size == bs else group_block_hashes(request, bs)
                num_full = num_real // bs
                if num_full > len(keys):
                    num_full = len(keys)
                published = get_then_cache(self.block_pool, n, keys[start:num_full], self.kv_cache_group_id)
                if published is not None:
                    new = published
                    table.num_cached_blocks = num_full
            if not new:
                new = self.block_pool.get_new_blocks(n)
            blocks += new
        out.append(new)
        covered = len(blocks) * bs
        if not self.enable_caching:
            return covered, covered, self.next_event(table)
        num_cached = table.num_cached_blocks
        if min(num_real // bs, len(blocks)) > num_cached:
            return None
        quiet = (num_cached + 1) * bs - 1  # thresholds(), inlined (the chunk path runs only for its own)
        return covered, quiet if quiet < covered else covered, self.next_event(table)

    def chunk_retire_ok(self, table: BlockTable, num_processed_tokens: int) -> bool:
        """True when ``retire_chunk`` can take this group's retire (it raises nothing then)."""
        return self.chunks

    def retire_chunk(self, request: Request, table: BlockTable, num_processed_tokens: int) -> tuple[int, bool]:
        """Publish what the processed tokens filled, retire what they skipped. Returns the
        table's next event (``next_event``) and whether its ``thresholds`` moved (a block was
        published: the quiet threshold follows the published cursor)."""
        moved = False
        if self.enable_caching and num_processed_tokens // self.block_size > table.num_cached_blocks:
            self.cache_blocks(request, num_processed_tokens)
            moved = True
        if self.retires:
            num_slots = self.num_dead_slots(table, num_processed_tokens)
            if num_slots > table.retired_below:
                self.retire_slots(table, num_slots)
                moved = True
        return self.next_event(table), moved

    if TYPE_CHECKING:  # SingleTypeKVCacheManager's
        def cache_blocks(self, request: Request, num_tokens: int) -> None: ...
        def num_dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int: ...
        def retire_slots(self, table: BlockTable, num_slots: int) -> None: ...
        def next_event(self, table: BlockTable) -> int: ...
        def thresholds(self, table: BlockTable) -> tuple[int, int]: ...
