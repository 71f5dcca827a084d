"""The release half of the group contract (:class:`~mambakv.groups.base.SingleTypeKVCacheManager`):
on processed (publish, then retire skipped blocks behind a watermark) and ``free``.

``next_event(table)`` is the smallest processed-token count at which ``cache_blocks`` or
``remove_skipped_blocks`` would change anything: below it ``retire`` is O(1).
"""

from __future__ import annotations

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import DoubleFreeError, InvalidTokenCountError
from mambakv.groups.tables import NEVER, BlockTable

__all__ = ["ReleaseMixin"]


class ReleaseMixin:
    """Retirement and ``free`` of a manager's block tables (see the module docstring)."""

    block_size: int
    block_pool: BlockPool
    null_block: KVCacheBlock
    retires: bool
    num_kept_tokens: int
    _tables: dict[str, BlockTable]

    # ------------------------------------------------------------------ on processed
    def next_event(self, table: BlockTable) -> int:
        """Smallest processed-token count at which ``cache_blocks`` + ``remove_skipped_blocks``
        would change `table` (publish or retire); ``NEVER`` when nothing ever will. Below it,
        the coordinator's ``retire`` skips this group."""
        if not self.retires:
            return NEVER
        # (n - kept) // bs > watermark  <=>  n >= (watermark + 1) * bs + kept
        return (table.retired_below + 1) * self.block_size + self.num_kept_tokens

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
        if t is None or not self.retires:
            return
        num_slots = self.num_dead_slots(t, num_processed_tokens)
        if num_slots > t.retired_below:
            self.retire_slots(t, num_slots)

    def dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int:
        """Slots that die once `num_processed_tokens` are processed (0 when the group never
        retires), raising what ``remove_skipped_blocks`` would raise; changes nothing. The
        coordinator checks every group this way before any publishes or retires."""
        return self.num_dead_slots(table, num_processed_tokens) if self.retires else 0

    def settle(self, table: BlockTable, num_processed_tokens: int) -> None:
        """Forget what `num_processed_tokens` settled (after ``retire_slots``); nothing here."""
        return None

    def num_dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int:
        """Leading table slots no longer needed once `num_processed_tokens` are processed:
        ``max(0, n - num_kept_tokens) // block_size`` (a negative result retires nothing)."""
        return (num_processed_tokens - self.num_kept_tokens) // self.block_size

    def retire_slots(self, table: BlockTable, num_slots: int) -> None:
        """Retire slots ``[watermark, num_slots)``: free their real blocks deepest first,
        skipping null gaps, then null the slots and move the watermark up. All or nothing (the
        free is checked before it changes anything); amortised O(new blocks), no slot is
        scanned twice::

            before  [old, null, committed, in_flight]   watermark 0, num_slots 3
            frees   [committed, old]
            after   [null, null, null, in_flight]       watermark 3

        The documented override point of retirement: the fuzzer's teeth plant vLLM's pre-fix
        walk (stop at the first null, no watermark) here."""
        blocks, null = table.blocks, self.null_block
        stop = min(num_slots, len(blocks))
        low = table.retired_below
        if stop <= low:
            return
        freed = [blocks[i] for i in range(stop - 1, low - 1, -1) if blocks[i] is not null]
        if freed:
            self.block_pool.free_blocks(freed)
        for i in range(low, stop):
            blocks[i] = null
        table.retired_below = stop

    # ------------------------------------------------------------------ free
    def free(self, request_id: str) -> None:
        """Drop the request: free its table tail-first (deepest blocks reach the eviction end
        of the LRU first) and every piece of its bookkeeping. Unknown ids are a no-op.

        Raises:
            DoubleFreeError: a block of the table is already free; nothing changed.
        """
        t = self._tables.get(request_id)
        if t is not None:
            self.block_pool.free_blocks(reversed(t.blocks))
            del self._tables[request_id]

    def check_free(self, request_id: str) -> None:
        """Raise DoubleFreeError (nothing changed) if ``free(request_id)`` would fail: lets the
        coordinator free every group or none."""
        t = self._tables.get(request_id)
        if t is not None:
            for b in t.blocks:
                if b.ref_cnt <= 0 and not b.is_null:
                    raise DoubleFreeError(f"block {b.block_id} of request {request_id!r} is already free")
