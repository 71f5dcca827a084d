"""A Mamba request's table in align mode, and its transitions as plain functions (DESIGN.md 5.1).

Slot i of a table holds the state after token ``(i + 1) * block_size``; the running state sits
at ``running_slot(main)``, its ``nspec`` scratch blocks right after it. Each allocation is one
named case (:class:`AlignStep`); block 560, 3 speculative blocks, ``1`` real, ``0`` null::

    step  computed + scheduled  table after allocate            case   copy (slot -> slot)
    1     0    + 2800           0 0 0 0 1 1 1 1                 NEW    none (no hit)
    2     2800 + 2240           0 0 0 0 1 0 0 0 1 1 1 1         GROW   4 -> 8
    3     5040 + 560            0 0 0 0 0 0 0 0 1 1 1 1 1       GROW   8 -> 9
    4     5600 + 4              0 0 0 0 0 0 0 0 0 1 1 1 1 1     GROW   9 -> 10

Step 2 in transitions: the running slot moves from 4 to 8 (``source`` 4); there is nothing to
pad (``pad_to_running_slot``: the scratch blocks reach slot 7); ``relocate_scratch_blocks``
appends the scratch blocks of slots 5, 6, 7 at slots 8, 9, 10 and nulls their old slots; one
new block takes slot 11. The old first scratch block, now at slot 8, is the running block: the
copy plan gets ``4 -> 8``.

Retirement frees everything below the watermark's new position that is real, skipping the
null gaps (``real_slots``), then moves the watermark (``null_slots``).

The manager (:mod:`mambakv.groups.mamba`) decides; these functions only move blocks and
fields. Several groups with one spec share one table: ``columns`` holds each group's block
list (``columns[0] is blocks``), and every transition applies to every column.
"""

from __future__ import annotations

import enum
from collections import deque

from mambakv.core.block import KVCacheBlock
from mambakv.groups.base import BlockTable

__all__ = ["AlignStep", "ColumnTable", "DecodeStep", "MambaTable", "move_running", "null_slots",
           "pad_to_running_slot", "real_slots", "record_step", "relocate_scratch_blocks", "running_slot"]


def running_slot(num_tokens: int, block_size: int) -> int:
    """Table slot of the running state once `num_tokens` tokens are computed (>= 1 token)."""
    return -(num_tokens // -block_size) - 1


class AlignStep(str, enum.Enum):
    """What one allocation did to a request's table (``MambaTable.last_step``).

    ==========  ========================================================================
    NEW         first step: ``1 + nspec`` blocks; copy from the hit state, or zero
    GROW        the running slot moved on: relocate scratch, 1 new block, copy last state
    IN_PLACE    the step ends inside the running slot: the state advances in its block
    BEHIND      a step after rejected drafts ends below the running slot: the state lives in
                the running block (drafts pushed it up), so it advances in place there
    COVERED     a request that never had drafts asks for fewer tokens than its running slot
                covers: nothing changes (vllm-ascend #16329 crashed here)
    ADVANCE     a decode step under ``latest`` / ``none`` whose running slot moves on: the
                running block moves to the new slot with its scratch; no new block, no copy
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


class DecodeStep:
    """One planned decode step of the ``latest`` policy (:mod:`mambakv.groups.decode_checkpoints`).

    Attributes:
        drafts: draft tokens of the step (0: it settles at ``retire``, else at ``accept_drafts``).
        real: its real tokens (1 for a decode step).
        start: the position it starts from, when known at planning (no earlier step of the
            request unresolved); -1: the end of the previous step (known once that one settled).
        seq: the policy's count of planned decode steps when this one was planned (a free
            since then may have put a block a step in flight still writes back in the pool).
    """

    __slots__ = ("drafts", "real", "start", "seq")

    def __init__(self, drafts: int, real: int, start: int, seq: int) -> None:
        self.drafts, self.real, self.start, self.seq = drafts, real, start, seq


class MambaTable(BlockTable):
    """Per-request state of a MambaManager (one object for every column of a shared policy).

    Attributes:
        columns: the block lists of every group sharing this table (``columns[0] is blocks``).
        running_slot: slot of the running state (-1 before the first allocation).
        num_tokens: the ``num_tokens`` of the last allocation (its main tokens).
        last_step: the :class:`AlignStep` case of the last allocation.
        had_drafts: a step with drafts was ever scheduled (rejected drafts may leave the
            state below the running slot).
        positions: slot -> the slot's boundary position, for blocks that will hold their
            boundary state once the step that writes them has run; an entry leaves once that
            position is processed and ``cache_blocks`` runs (the state is published then; a
            slot retired meanwhile holds null and publishes nothing), when the block is
            rewritten, or at ``free``.
        verify_steps: ``(running slot, tokens, drafts)`` of steps with draft tokens whose
            ``accept_drafts`` has not come yet, oldest first.
        verified: ``(position, slot)`` of verified steps whose state sits above slot
            ``(position - 1) // bs`` (drafts moved the running slot on), until processed.
        in_decode: the request is in decode under ``latest`` / ``none`` (the running block
            advances in place).
        decode_steps: ``latest``: planned decode steps not resolved yet, oldest first.
        settled: ``latest``: the settled position (tokens) after the last resolved step.
        has_spare: ``latest``: the last block of every column is a checkpoint waiting for its
            ``retire``: it holds (or receives, by the copy ``accept_drafts`` returned) the
            state at a boundary a verified step crossed; no forward writes it.
        spare_pos: that boundary (0: no checkpoint waiting).
        ckpts: ``(block, key)`` of the request's last published decode checkpoint, per column.
    """

    __slots__ = ("running_slot", "num_tokens", "last_step", "had_drafts", "positions", "verify_steps", "verified",
                 "columns", "in_decode", "decode_steps", "settled", "has_spare", "spare_pos", "ckpts")

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[list[KVCacheBlock]] = [self.blocks]
        self.running_slot = -1
        self.num_tokens = 0
        self.last_step: AlignStep | None = None
        self.had_drafts = False
        self.positions: dict[int, int] = {}
        self.verify_steps: deque[tuple[int, int, int]] = deque()
        self.verified: deque[tuple[int, int]] = deque()
        self.in_decode = False
        self.decode_steps: deque[DecodeStep] = deque()
        self.settled = 0
        self.has_spare = False
        self.spare_pos = 0
        self.ckpts: list[tuple[KVCacheBlock, bytes]] = []


class ColumnTable:
    """A follower group's view of a shared table: its own block column, every other field the
    leader's (groups with one spec evolve in lockstep; only their block ids differ). Read-only."""

    __slots__ = ("leader", "blocks")

    def __init__(self, leader: MambaTable, blocks: list[KVCacheBlock]) -> None:
        self.leader = leader
        self.blocks = blocks

    def __getattr__(self, name: str) -> object:
        return getattr(self.leader, name)


# ---------------------------------------------------------------------- transitions
def pad_to_running_slot(t: MambaTable, running: int, null: KVCacheBlock) -> None:
    """Fill every column with null up to (not including) the running slot: interior boundaries
    of a multi-block chunk hold no state::

        running 6:  [0 0 0 R S]  ->  [0 0 0 R S 0]     (a jump past the scratch blocks)
    """
    for col in t.columns:
        if len(col) < running:
            col.extend([null] * (running - len(col)))


def relocate_scratch_blocks(t: MambaTable, running: int, nspec: int, null: KVCacheBlock) -> None:
    """Case GROW's table change before its one new block: every column is padded with null up
    to the new running slot (``pad_to_running_slot``: a jump past the scratch blocks), then the
    scratch blocks after the old running slot that now lie below the new one move to the end of
    the column, their old slots null (no new block, no copy)::

        source 4, running 8, nspec 3:   [.. R 5 6 7]  ->  [.. R 0 0 0 5 6 7]       (5: running)
        source 4, running 6, nspec 3:   [.. R 5 6 7]  ->  [.. R 0 6 7 5]           (6: running)
        source 4, running 10, nspec 3:  [.. R 5 6 7]  ->  [.. R 0 0 0 0 0 5 6 7]   (a jump)

    The column then lacks exactly its last scratch block. Slices, not a loop over slots: this runs
    once per chunk of every long prefill."""
    lo = t.running_slot + 1
    stop = lo + nspec if lo + nspec < running else running
    gap = [null] * (stop - lo) if stop > lo else None
    for col in t.columns:  # pad_to_running_slot and the move in one pass per column
        if len(col) < running:
            col += [null] * (running - len(col))
        if gap is not None:
            moved = col[lo:stop]
            col[lo:stop] = gap
            col += moved


def move_running(t: MambaTable, running: int, null: KVCacheBlock) -> None:
    """Case ADVANCE: move the running block and what follows it (scratch, and a checkpoint
    waiting for its retire) to the new running slot, in every column (no new block, no copy)::

        slot 7 -> 8, nspec 2:   [0 .. 0 R S S]  ->  [0 .. 0 0 R S S]
    """
    old = t.running_slot
    for col in t.columns:
        tail = col[old:]
        del col[old:]
        col.extend([null] * (running - old))
        col.extend(tail)


def record_step(t: MambaTable, running: int, num_tokens: int, num_drafts: int, case: AlignStep,
                tag: bool) -> None:
    """Remember the step. `tag` (caching on and `num_tokens` is the running slot's boundary):
    the running block will hold its boundary state after the forward, so it is tagged with
    that position (only such a state can ever be published). A verify step's position is known
    only after ``accept_drafts``; a step planned while an earlier step's drafts await their
    verify starts from an optimistic count (async scheduling), so the state it writes may
    include rejected drafts and it is never tagged. Any older tag of the slot is dropped: this
    step overwrites the block in place."""
    t.running_slot = running
    t.num_tokens = num_tokens
    t.last_step = case
    positions = t.positions
    if num_drafts:
        t.verify_steps.append((running, num_tokens, num_drafts))
        t.had_drafts = True
    elif tag and not t.verify_steps:
        positions[running] = num_tokens
        return
    if positions:
        positions.pop(running, None)


def real_slots(blocks: list[KVCacheBlock], low: int, stop: int, null: KVCacheBlock) -> list[int]:
    """The slots in ``[low, stop)`` of `blocks` that hold a real (non-null) block, deepest
    first. A table's span below the running slot is mostly null gaps: a prefill chunk's retire
    finds one real slot (the previous boundary state, at the old watermark), which a count in C
    confirms without a scan in Python (blocks compare by identity)."""
    span = blocks[low:stop]
    num_null = span.count(null)
    if num_null == len(span):
        return []
    if num_null == len(span) - 1 and span[0] is not null:
        return [low]
    return [i for i in range(stop - 1, low - 1, -1) if blocks[i] is not null]


def null_slots(t: MambaTable, real: list[int], stop: int, null: KVCacheBlock) -> None:
    """Null the `real` slots (``real_slots``: the rest of ``[watermark, stop)`` is null already)
    of every column and move the watermark to `stop` (their blocks were freed)."""
    for col in t.columns:
        for i in real:
            col[i] = null
    t.retired_below = stop
