"""The align-mode step cases of :class:`~mambakv.groups.mamba.MambaManager` (DESIGN.md 5.1).

Each allocation is one named case of :class:`AlignStep` (recorded on the table as
``last_step``)::

    step  computed + scheduled  table after allocate            case   copy (slot -> slot)
    1     0    + 2800           0 0 0 0 1 1 1 1                 NEW    none (no hit)
    2     2800 + 2240           0 0 0 0 1 0 0 0 1 1 1 1         GROW   4 -> 8
    3     5040 + 560            0 0 0 0 0 0 0 0 1 1 1 1 1       GROW   8 -> 9

(block 560, 3 speculative blocks; ``1`` real block, ``0`` null.) Decode steps of the
``latest`` / ``none`` decode-checkpoint policies move the running block instead
(``mambakv/groups/mamba_decode.py``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import InvalidTokenCountError
from mambakv.core.spec import MambaCacheMode
from mambakv.groups.base import cdiv
from mambakv.groups.drafts import DraftsMixin, MambaTable

if TYPE_CHECKING:
    from mambakv.groups.mamba import MambaManager

__all__ = ["AlignStep", "AlignStepsMixin", "running_slot"]


def running_slot(num_tokens: int, block_size: int) -> int:
    """Table slot of the running state once `num_tokens` tokens are computed (>= 1 token)."""
    return cdiv(num_tokens, block_size) - 1


class AlignStep(str, enum.Enum):
    """What one ``allocate_new_blocks`` did to a request's table (``MambaTable.last_step``).

    ==========  ========================================================================
    NEW         first step: ``1 + nspec`` blocks; copy from the hit state, or zero
    GROW        the running slot moved on: relocate scratch, 1 new block, copy last state
    IN_PLACE    the step ends inside the running slot: the state advances in its block
    BEHIND      a step after rejected drafts ends below the running slot: the state lives in
                the running block (drafts pushed it up), so it advances in place there
    COVERED     a request that never had drafts asks for fewer tokens than its running slot
                covers: nothing changes (vllm-ascend #16329 crashed here)
    ADVANCE     a decode step under ``latest`` / ``none`` whose running slot moves on: the
                running block moves to the new slot with its scratch; no new
                block, no copy (``mamba_decode.py``)
    ==========  ========================================================================

    A step that would write a published running block (its state may be another request's
    hit) raises InvalidTokenCountError instead.
    """

    NEW = "new"
    GROW = "grow"
    IN_PLACE = "in_place"
    BEHIND = "behind"
    COVERED = "covered"
    ADVANCE = "advance"


class AlignStepsMixin(DraftsMixin):
    """The step cases NEW and GROW and the tagging rule of every step (``_record_step``)."""

    num_speculative_blocks: int
    _copy_plan: list[tuple[int, int]]
    _zero_plan: list[int]
    _column_managers: tuple[MambaManager, ...]
    mode: MambaCacheMode
    _decode_in_place: bool

    @property
    def _no_new(self) -> list[list[KVCacheBlock]]:
        return [[] for _ in self._column_managers]

    def _start(self, t: MambaTable, running: int, num_tokens: int, drafts: int) -> list[list[KVCacheBlock]]:
        """Case NEW: a hit table is ``[null, ..., H]`` (H is the state to resume from, copied into
        the running block); without a hit the running block starts from zero."""
        per = 1 + self.num_speculative_blocks
        new = self.block_pool.get_new_blocks(per * len(t.columns))
        out = []
        null = self.null_block
        for k, (col, m) in enumerate(zip(t.columns, self._column_managers)):
            source = len(col) - 1
            self._pad_to_running_slot(col, running)
            mine = new[k * per : (k + 1) * per]
            col.extend(mine)
            if source >= 0 and col[source] is not null:
                m._copy_plan.append((col[source].block_id, col[running].block_id))
            else:
                m._zero_plan.append(col[running].block_id)
            out.append(mine)
        self._record_step(t, running, num_tokens, drafts, AlignStep.NEW)
        return out

    def _grow(self, t: MambaTable, running: int, num_tokens: int, drafts: int) -> list[list[KVCacheBlock]]:
        """Case GROW: the running slot moves from `source` to `running` (one new block per
        column). The named steps ``_pad_to_running_slot`` and ``_relocate_scratch_blocks`` are
        inlined here: this runs once per chunk of every long prefill."""
        source = t.running_slot
        null = self.null_block
        cols = t.columns
        relocate_stop = min(running, source + 1 + self.num_speculative_blocks)
        for col in cols:
            if len(col) < running:  # _pad_to_running_slot: a jump past the scratch blocks (rare)
                col.extend([null] * (running - len(col)))
            for slot in range(source + 1, relocate_stop):  # _relocate_scratch_blocks
                col.append(col[slot])
                col[slot] = null
        num_new = running + 1 + self.num_speculative_blocks - len(cols[0])
        if len(cols) == 1:
            new = self.block_pool.get_new_blocks(num_new)
            col = cols[0]
            col.extend(new)
            self._copy_plan.append((col[source].block_id, col[running].block_id))
            self._record_step(t, running, num_tokens, drafts, AlignStep.GROW)
            return [new]
        new = self.block_pool.get_new_blocks(num_new * len(cols))
        out = []
        for k, (col, m) in enumerate(zip(cols, self._column_managers)):
            mine = new[k * num_new : (k + 1) * num_new]
            col.extend(mine)
            m._copy_plan.append((col[source].block_id, col[running].block_id))
            out.append(mine)
        self._record_step(t, running, num_tokens, drafts, AlignStep.GROW)
        return out

    def _pad_to_running_slot(self, blocks: list[KVCacheBlock], running: int) -> None:
        """Fill the table with null up to (not including) the running slot: interior
        boundaries of a multi-block chunk hold no state."""
        if len(blocks) < running:
            blocks.extend([self.null_block] * (running - len(blocks)))

    def _relocate_scratch_blocks(self, blocks: list[KVCacheBlock], source: int, running: int) -> None:
        """Move the previous scratch blocks that now lie below the running slot to the end of
        the table and null their old slots (no new block, no copy)::

            source 4, running 8, nspec 3:  [.. S 5 6 7]  ->  [.. S 0 0 0 5 6 7]
        """
        null = self.null_block
        for slot in range(source + 1, min(running, source + 1 + self.num_speculative_blocks)):
            block = blocks[slot]
            assert block is not null and block.ref_cnt == 1 and block.block_hash is None, \
                f"scratch block {block.block_id} at slot {slot} is not writable"
            blocks.append(block)
            blocks[slot] = null

    def _record_step(self, t: MambaTable, running: int, num_tokens: int, num_drafts: int, case: AlignStep) -> None:
        """Remember the step, and tag the running block with the position its state will hold
        after the forward if that position is the slot's boundary (only such a state can ever
        be published). A verify step's position is known only after ``accept_drafts``.

        Any older tag of the slot is dropped: this step overwrites the block in place."""
        t.running_slot = running
        t.num_tokens = num_tokens
        t.last_step = case
        positions = t.positions
        if num_drafts:
            t.verify_steps.append((running, num_tokens, num_drafts))
            t.had_drafts = True
        elif self.enable_caching and num_tokens == (running + 1) * self.block_size and not t.verify_steps:
            # A step planned while an earlier step's drafts await their verify starts from an
            # optimistic count (async scheduling): the state it writes may include rejected
            # drafts, so its boundary is never tagged (nothing it writes is published).
            positions[running] = num_tokens
            return
        if positions:
            positions.pop(running, None)

    def _align_columns(self, request_id: str, t: MambaTable, num_tokens: int,
                       num_draft_tokens: int) -> list[list[KVCacheBlock]]:
        """Prefill, and every decode step under ``every``: the AlignStep cases."""
        running = -(num_tokens // -self.block_size) - 1 if self._align else 0
        if t.running_slot < 0:
            return self._start(t, running, num_tokens, num_draft_tokens)
        if running > t.running_slot:
            return self._grow(t, running, num_tokens, num_draft_tokens)
        case = AlignStep.IN_PLACE
        if running < t.running_slot:
            if not t.had_drafts:
                t.last_step = AlignStep.COVERED  # vllm-ascend #16329: a no-op, not a crash
                return self._no_new
            # Block 2, 3 computed, 1 + 3 drafts: running slot 3; 0 accepted; the next step from
            # 4 reaches slot 2 only, but the state at 4 is in slot 3.
            case, running = AlignStep.BEHIND, t.running_slot
        self._check_writable(request_id, t, running, num_tokens)
        self._record_step(t, running, num_tokens, num_draft_tokens, case)
        return self._no_new

    def check_writable_step(self, request_id: str, num_tokens: int, decode: bool = False) -> None:
        """Raise (nothing changed) what the allocation of a running request's step to
        `num_tokens` main tokens would raise for rewriting a published running state: a step
        that ends inside (IN_PLACE) or, after drafts, below (BEHIND) the running slot writes
        the running block in place. The coordinator asks every Mamba policy before any group
        commits. `decode`: the prompt was computed before the step (``latest`` / ``none``).

        Raises:
            InvalidTokenCountError: the running block is published (the engine moved its
                computed count below a retired one)."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0 or self.mode is not MambaCacheMode.ALIGN:
            return
        r = t.running_slot
        running = -(num_tokens // -self.block_size) - 1
        if running > r:  # GROW / ADVANCE: the state goes to a block of its own
            return
        if running < r and not (t.had_drafts or (decode and self._decode_in_place)):
            return  # COVERED: nothing is written
        self._check_writable(request_id, t, r, num_tokens)

    def _check_writable(self, request_id: str, t: MambaTable, running: int, num_tokens: int) -> None:
        if t.blocks[running].block_hash is not None:
            raise InvalidTokenCountError(
                f"request {request_id!r}: a step to {num_tokens} tokens would rewrite the published state at slot "
                f"{running} (another request may hold it as a hit)")

    # ------------------------------------------------------------------ plans
    def take_copy_plan(self) -> list[tuple[int, int]]:
        """``(src, dst)`` block-id pairs to copy before the next forward (last state or hit
        state -> running block), accumulated since the last call."""
        plan, self._copy_plan = self._copy_plan, []
        return plan

    def take_zero_plan(self) -> list[int]:
        """Running blocks that start without initial state, since the last call."""
        plan, self._zero_plan = self._zero_plan, []
        return plan

    def pending_plan(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        """``(copies, zeros)`` not taken yet, read-only (drains nothing)."""
        return tuple(self._copy_plan), tuple(self._zero_plan)
