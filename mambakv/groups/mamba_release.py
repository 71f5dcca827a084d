"""Release of a Mamba group's tables: ``free`` and ``check_free`` over every block column (and
the pending copy / zero plans and checkpoint writes of a freed request), and ``retire_slots``
(the base class's watermark retirement, one free for all columns)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.errors import DoubleFreeError
from mambakv.groups.base import BlockTable
from mambakv.groups.drafts import DraftsMixin, MambaTable
from mambakv.groups.tables import real_slots

if TYPE_CHECKING:
    from mambakv.groups.mamba import MambaManager

__all__ = ["MambaReleaseMixin"]


class MambaReleaseMixin(DraftsMixin):
    """The release half of :class:`~mambakv.groups.mamba.MambaManager`."""

    _column_managers: tuple[MambaManager, ...]
    _copy_plan: list[tuple[int, int]]
    _zero_plan: list[int]
    _writes: list[tuple[str, int, int]]
    _num_planned: int
    _freed_at: int

    def free(self, request_id: str) -> None:
        """Drop the request in every column (tail first, see the base class), and its pending
        entries of the copy and zero plans: a preempted request's copy must not run into a
        block that is reused.

        Raises:
            DoubleFreeError: a block is already free; nothing changed."""
        t = self._tables.get(request_id)
        if t is None:
            return
        self._check_leader()
        low = t.retired_below  # below the watermark every slot is null: a long prefill's table is mostly that
        self.block_pool.free_blocks([b for col in t.columns for b in reversed(col[low:])])  # raises before any change
        self._freed_at = self._num_planned  # latest: a step of it may be in flight (see _decode_verify)
        for col, m in zip(t.columns, self._column_managers):
            del m._tables[request_id]
            if m._writes:
                m._writes = [w for w in m._writes if w[0] != request_id]
            if m._copy_plan or m._zero_plan:
                ids = {b.block_id for b in col if not b.is_null}
                m._copy_plan = [p for p in m._copy_plan if p[1] not in ids]
                m._zero_plan = [b for b in m._zero_plan if b not in ids]

    def check_free(self, request_id: str) -> None:
        """Raise DoubleFreeError (nothing changed) if ``free(request_id)`` would fail."""
        t = self._tables.get(request_id)
        if t is not None:
            low = t.retired_below
            for col in t.columns:
                for b in col[low:]:
                    if b.ref_cnt <= 0 and not b.is_null:
                        raise DoubleFreeError(f"block {b.block_id} of request {request_id!r} is already free")

    def retire_slots(self, table: BlockTable, num_slots: int) -> None:
        """Retire slots ``[watermark, num_slots)`` in every column (see the base class): one
        free for all columns (deepest first, null gaps skipped), then the slots are nulled and
        the watermark moves; all or nothing."""
        t: MambaTable = table  # type: ignore[assignment]
        stop = min(num_slots, len(t.blocks))
        low = t.retired_below
        if stop <= low:
            return
        blocks, null = t.blocks, self.null_block
        # Every column has column 0's null pattern (check_invariants): scan one, gather from all.
        real = real_slots(blocks, low, stop, null)  # deepest first
        if real:
            self.block_pool.free_blocks([col[i] for col in t.columns for i in real])
        nulls = [null] * (stop - low)
        for col in t.columns:
            col[low:stop] = nulls
        t.retired_below = stop
