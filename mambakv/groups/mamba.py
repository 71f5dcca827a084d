"""MambaManager: recurrent-state blocks, in mode NONE or align mode (DESIGN.md 5.1).

Align mode in one picture (block 560, 3 speculative blocks; ``1`` real block, ``0`` null;
the engine retires to the computed tokens before each allocation)::

    step  computed + scheduled  table after allocate            copy (slot -> slot)
    1     0    + 2800           0 0 0 0 1 1 1 1                 none (new, no hit)
    2     2800 + 2240           0 0 0 0 1 0 0 0 1 1 1 1         4 -> 8
    3     5040 + 560            0 0 0 0 0 0 0 0 1 1 1 1 1       8 -> 9
    4     5600 + 4              0 0 0 0 0 0 0 0 0 1 1 1 1 1     9 -> 10

Slot i holds the state after token ``(i + 1) * block_size``. The running state sits at
``running_slot(main) = cdiv(main, bs) - 1``; the ``nspec`` scratch blocks follow it.

Each allocation is one named case of :class:`AlignStep` (recorded on the table as
``last_step``); spec-decode bookkeeping (verify steps, ``accept_drafts``, the verified-state
retirement rule) lives in :mod:`mambakv.groups.drafts`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidDraftCountError, InvalidTokenCountError
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec
from mambakv.groups.base import NEVER, BlockTable, cdiv, group_block_hashes, num_evictable
from mambakv.groups.drafts import DraftsMixin, MambaTable
from mambakv.groups.kinds import GroupKind
from mambakv.plans import TableView

__all__ = ["AlignStep", "MambaManager", "MambaRequestBlocks", "MambaTable", "running_slot"]

#: the 0.1 name of :class:`MambaTable`
MambaRequestBlocks = MambaTable


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
    ==========  ========================================================================

    A step that would write a published running block (its state may be another request's
    hit) raises InvalidTokenCountError instead.
    """

    NEW = "new"
    GROW = "grow"
    IN_PLACE = "in_place"
    BEHIND = "behind"
    COVERED = "covered"


class MambaManager(DraftsMixin):
    """State blocks of one Mamba group (one block = one whole state of every layer).

    Mode NONE: a request holds ``1 + nspec`` blocks (running state + scratch) whatever its
    length; nothing is hashed or retired. Mode ALIGN: see the module docstring and
    ``allocate_new_blocks``.

    Copies the engine must run, as ``(src block id, dst block id)`` pairs:
    ``take_copy_plan()`` before the step's forward, and the list ``accept_drafts`` returns
    after its verify. ``take_zero_plan()`` lists running blocks that start with no initial
    state (new requests without a hit): zero them, or run the kernel without initial state.
    """

    kind = GroupKind.MAMBA
    publishes_at_allocation = False
    table_class: ClassVar[type[BlockTable]] = MambaTable
    _tables: dict[str, MambaTable]  # type: ignore[assignment]

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0) -> None:
        super().__init__(kv_cache_spec, block_pool, enable_caching=enable_caching,
                         kv_cache_group_id=kv_cache_group_id)
        self.mode = kv_cache_spec.mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self._align = self.mode is MambaCacheMode.ALIGN
        if not self._align:
            self.enable_caching = False
            self.retires = False  # mode NONE keeps one state per request: nothing to retire
        # Only the last state matters: n - 1 tokens are skipped (none in mode NONE).
        self.num_kept_tokens = 1 if self._align else NEVER
        self._copy_plan: list[tuple[int, int]] = []
        self._zero_plan: list[int] = []

    # ------------------------------------------------------------------ check + count
    def check_step(self, num_tokens: int, num_draft_tokens: int) -> None:
        """Raise (nothing changed) for a step this group cannot run.

        Raises:
            InvalidTokenCountError: ``num_tokens <= 0`` or negative drafts.
            InvalidDraftCountError: more drafts than scratch blocks (scratch block k holds the
                state after draft k + 1: a draft without one has nowhere to go).
        """
        if num_tokens <= 0 or num_draft_tokens < 0:
            raise InvalidTokenCountError(f"num_tokens must be > 0 and drafts >= 0, got {num_tokens}, {num_draft_tokens}")
        if num_draft_tokens > self.num_speculative_blocks:
            raise InvalidDraftCountError(
                f"{num_draft_tokens} draft tokens but group {self.kv_cache_group_id} has "
                f"{self.num_speculative_blocks} speculative blocks")

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = (),
                                   num_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """``1 + nspec`` (+ evictable hits) for a new request; for a running one 1 when the
        running slot moves past the table, else 0. Lookahead tokens never add blocks."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            evictable = num_evictable(new_computed_blocks) if new_computed_blocks else 0
            return 1 + self.num_speculative_blocks + evictable
        if self._align and -(num_tokens // -self.block_size) > t.running_slot + 1:
            return 1  # the running slot moves on: exactly one block is missing (see allocate)
        return 0

    def num_covered_tokens(self, request_id: str) -> int:
        """Tokens up to the running slot's boundary: beyond it the running state moves to a
        new slot (one block); mode NONE never needs one once running."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            return 0
        return (t.running_slot + 1) * self.block_size if self._align else NEVER

    # ------------------------------------------------------------------ commit
    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0) -> list[KVCacheBlock]:
        """Give the request a running state for ``num_tokens`` main tokens (computed +
        scheduled, drafts under verification included) and ``nspec`` scratch blocks.

        Align mode, when the table must grow to ``R = cdiv(num_tokens, bs) + nspec`` (case
        GROW): the previous running slot is the copy source; the table is padded with null up
        to the new running slot (``_pad_to_running_slot``); scratch blocks now below the running
        slot move to the end (``_relocate_scratch_blocks``); then the one missing block (or
        ``1 + nspec`` for a new request, case NEW) is allocated. The cases are
        :class:`AlignStep`.

        `num_draft_tokens`: how many of the main tokens are unverified drafts (then
        ``accept_drafts`` must follow the step's verify).

        Raises (nothing changed):
            InvalidTokenCountError / InvalidDraftCountError: see ``check_step``; or a step that
                would rewrite a published running state.
            OutOfBlocksError: the pool is short (the coordinator counts first).
        """
        self.check_step(num_tokens, num_draft_tokens)
        t = self._tables.get(request_id) or self.table(request_id)  # type: ignore[assignment]
        running = -(num_tokens // -self.block_size) - 1 if self._align else 0
        if t.running_slot < 0:
            return self._start(t, running, num_tokens, num_draft_tokens)
        if running > t.running_slot:
            return self._grow(t, running, num_tokens, num_draft_tokens)
        case = AlignStep.IN_PLACE
        if running < t.running_slot:
            if not t.had_drafts:
                t.last_step = AlignStep.COVERED  # vllm-ascend #16329: a no-op, not a crash
                return []
            # Block 2, 3 computed, 1 + 3 drafts: running slot 3; 0 accepted; the next step from
            # 4 reaches slot 2 only, but the state at 4 is in slot 3.
            case, running = AlignStep.BEHIND, t.running_slot
        if t.blocks[running].block_hash is not None:
            raise InvalidTokenCountError(
                f"request {request_id!r}: a step to {num_tokens} tokens would rewrite the published state at slot "
                f"{running} (another request may hold it as a hit)")
        self._record_step(t, running, num_tokens, num_draft_tokens, case)
        return []

    def _start(self, t: MambaTable, running: int, num_tokens: int, drafts: int) -> list[KVCacheBlock]:
        """Case NEW: a hit table is ``[null, ..., H]`` (H is the state to resume from, copied into
        the running block); without a hit the running block starts from zero."""
        blocks = t.blocks
        source = len(blocks) - 1
        self._pad_to_running_slot(blocks, running)
        new = self.block_pool.get_new_blocks(1 + self.num_speculative_blocks)
        blocks.extend(new)
        if source >= 0 and blocks[source] is not self.null_block:
            self._copy_plan.append((blocks[source].block_id, blocks[running].block_id))
        else:
            self._zero_plan.append(blocks[running].block_id)
        self._record_step(t, running, num_tokens, drafts, AlignStep.NEW)
        return new

    def _grow(self, t: MambaTable, running: int, num_tokens: int, drafts: int) -> list[KVCacheBlock]:
        """Case GROW: the running slot moves from `source` to `running` (one new block)."""
        blocks = t.blocks
        source = t.running_slot
        if len(blocks) < running:  # a jump past the scratch blocks (rare): pad first
            self._pad_to_running_slot(blocks, running)
        self._relocate_scratch_blocks(blocks, source, running)
        new = self.block_pool.get_new_blocks(running + 1 + self.num_speculative_blocks - len(blocks))
        blocks.extend(new)
        self._copy_plan.append((blocks[source].block_id, blocks[running].block_id))
        self._record_step(t, running, num_tokens, drafts, AlignStep.GROW)
        return new

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
        elif self.enable_caching and num_tokens == (running + 1) * self.block_size:
            positions[running] = num_tokens
            return
        if positions:
            positions.pop(running, None)

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

    # ------------------------------------------------------------------ publication
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the states that are settled: a block whose tagged position is at most
        `num_tokens` *processed* tokens is published iff that position is exactly its slot's
        boundary ``(slot + 1) * block_size``; other settled tags are dropped. Scratch blocks
        and nulls are never published."""
        t = self._tables.get(request.request_id)
        if t is None or not t.positions:
            return
        positions = t.positions
        bs = self.block_size
        keys: Sequence[bytes] | None = None
        for slot, pos in [(s, p) for s, p in positions.items() if p <= num_tokens]:
            del positions[slot]
            if pos != (slot + 1) * bs or not self.enable_caching:
                continue  # settled off its boundary (or no caching): nothing to publish
            block = t.blocks[slot]
            if keys is None:
                keys = group_block_hashes(request, bs)
            if slot < len(keys) and block is not self.null_block:
                self.block_pool.cache_full_blocks([block], [keys[slot]], self.kv_cache_group_id, block_size=bs)

    def next_event(self, table: BlockTable) -> int:
        """The earliest of: a tagged state's position (publication), the next retirement
        (``(watermark + 1) * bs + 1``), a verified step's position (its state's slot rule), and
        the start of the oldest step waiting for ``accept_drafts`` (retiring past it raises)."""
        t: MambaTable = table  # type: ignore[assignment]
        nxt = (t.retired_below + 1) * self.block_size + 1 if self._align else NEVER
        if t.positions:
            nxt = min(nxt, min(t.positions.values()))
        if t.verified:
            nxt = min(nxt, t.verified[0][0])
        if t.verify_steps:
            _, tokens, drafts = t.verify_steps[0]
            nxt = min(nxt, tokens - drafts)
        return nxt

    def free(self, request_id: str) -> None:
        """Drop the request (see the base class), and its pending entries of the copy and
        zero plans: a preempted request's copy must not run into a block that is reused."""
        t = self._tables.get(request_id)
        if t is not None and (self._copy_plan or self._zero_plan):
            ids = {b.block_id for b in t.blocks if not b.is_null}
            self.block_pool.free_blocks(reversed(t.blocks))  # raises before any change
            del self._tables[request_id]
            self._copy_plan = [p for p in self._copy_plan if p[1] not in ids]
            self._zero_plan = [b for b in self._zero_plan if b not in ids]
            return
        super().free(request_id)

    # ------------------------------------------------------------------ queries
    def describe(self, request_id: str) -> TableView | None:
        """A read-only snapshot of the request's table, with the align-mode fields."""
        t = self._tables.get(request_id)
        if t is None:
            return None
        return TableView(self.kv_cache_group_id, tuple(b.block_id for b in t.blocks), t.num_cached_blocks,
                         t.retired_below, t.running_slot, t.num_tokens, tuple(sorted(t.positions.items())),
                         tuple(t.verify_steps), tuple(t.verified), t.had_drafts)

    def quiet_tokens(self, table: BlockTable) -> int:
        """Steps strictly inside the running slot with no step awaiting ``accept_drafts`` only
        advance the state in place (nothing to tag: the boundary itself is excluded)."""
        t: MambaTable = table  # type: ignore[assignment]
        if t.running_slot < 0 or t.verify_steps:
            return 0
        return (t.running_slot + 1) * self.block_size - 1 if self._align else NEVER

    def get_state_block_ids(self, request_id: str) -> list[int]:
        """Block ids of the request's real states (last + running), scratch excluded: what
        an engine saves or offloads for the request."""
        t = self._tables.get(request_id)
        if t is None:
            return []
        end = t.running_slot + 1 if t.running_slot >= 0 else len(t.blocks)
        return [b.block_id for b in t.blocks[:end] if not b.is_null]

    def num_held_blocks(self, request_id: str) -> int:
        """Non-null blocks in the request's table."""
        t = self._tables.get(request_id)
        return 0 if t is None else sum(1 for b in t.blocks if not b.is_null)

    @classmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The rightmost cached state whose end is aligned: ``[null, ..., null, state]``."""
        if not isinstance(kv_cache_spec, MambaSpec) or kv_cache_spec.mode is MambaCacheMode.NONE:
            return tuple([] for _ in kv_cache_group_ids)
        bs = kv_cache_spec.block_size
        get = block_pool.get_cached_block
        for i in range(min(max_length // bs, len(block_hashes)) - 1, -1, -1):
            if ((i + 1) * bs) % alignment_tokens:
                continue
            cached = get(block_hashes[i], kv_cache_group_ids)
            if cached is not None:
                return tuple([block_pool.null_block] * i + [c] for c in cached)
        return tuple([] for _ in kv_cache_group_ids)

    def check_invariants(self) -> None:
        """Base checks, plus: scratch blocks have ref count 1 and no hash; the running block
        is real and unshared; position tags lie within the table."""
        super().check_invariants()
        null = self.null_block
        for rid, t in self._tables.items():
            if t.running_slot < 0:
                continue
            r = t.running_slot
            assert r < len(t.blocks) and t.blocks[r] is not null, f"{rid}: running slot {r} null"
            for b in t.blocks[r + 1 :]:
                assert b is not null and b.ref_cnt == 1 and b.block_hash is None, f"{rid}: bad scratch {b}"
            assert all(0 <= s < len(t.blocks) for s in t.positions), f"{rid}: tag outside table"
