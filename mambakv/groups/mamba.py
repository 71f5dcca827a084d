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

The concerns live in one module each:

=====================  ===========================================================
``mamba_steps.py``     the align step cases (:class:`AlignStep`), tagging
``mamba_decode.py``    decode checkpoints: ``MambaSpec.decode_checkpoints``
                       (every / latest / none), spares, checkpoint writes
``mamba_columns.py``   one policy over several block columns (identical groups)
``drafts.py``          spec decode: verify steps, ``accept_drafts``, retirement rule
``mamba_queries.py``   snapshot, thresholds, state block ids, the hit rule, invariants
``mamba_release.py``   ``free`` / ``check_free`` and slot retirement over every column
this module            the manager: counting, allocation dispatch, publication,
                       the next retire event
``mamba_fused.py``     the fused ``schedule_step`` of a manager used alone
``mamba_chunk.py``     the coordinator's fused prefill chunk over every column
=====================  ===========================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidDraftCountError, InvalidTokenCountError
from mambakv.core.events import stored_event_fields
from mambakv.core.pool_checks import record_own_calls
from mambakv.core.request import Request
from mambakv.core.spec import DecodeCheckpoints, MambaCacheMode, MambaSpec
from mambakv.groups.base import NEVER, BlockTable, group_block_hashes, num_evictable
from mambakv.groups.chunks import chunks_fusable
from mambakv.groups.drafts import MambaTable
from mambakv.groups.kinds import GroupKind
from mambakv.groups.mamba_chunk import MAMBA_CHUNK_STEPS, MambaChunkMixin
from mambakv.groups.mamba_columns import ColumnsMixin
from mambakv.groups.mamba_fused import FusedStepMixin
from mambakv.groups.mamba_release import MambaReleaseMixin
from mambakv.groups.mamba_steps import AlignStep, running_slot

__all__ = ["AlignStep", "MambaManager", "MambaRequestBlocks", "MambaTable", "running_slot"]

#: the 0.1 name of :class:`MambaTable`
MambaRequestBlocks = MambaTable


class MambaManager(MambaReleaseMixin, ColumnsMixin, MambaChunkMixin, FusedStepMixin):
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
        #: the managers of every column this one drives (itself first, then its followers)
        self._column_managers: tuple[MambaManager, ...] = (self,)
        self._column_ids = (kv_cache_group_id,)
        #: align mode over one column: ``schedule_step`` may take its fused path
        self._fused = self._align
        #: the coordinator's fused prefill chunk applies (mambakv.groups.mamba_chunk)
        self.chunks = self._align and chunks_fusable(self, MambaManager, MAMBA_CHUNK_STEPS)
        self.decode_checkpoints = kv_cache_spec.decode_checkpoints
        self._decode_in_place = self._align and self.decode_checkpoints is not DecodeCheckpoints.EVERY
        self._spares = self._decode_in_place and self.decode_checkpoints is DecodeCheckpoints.LATEST \
            and self.enable_caching
        self.spare_may_evict = False
        self._writes: list[tuple[str, int, int]] = []
        self._list_writes = True
        self._num_planned = self._freed_at = 0

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
        if t.in_decode:  # latest / none: the running block advances in place, unless it holds a
            r = t.running_slot  # boundary state to publish (_decode_columns grows then, as every)
            if -(num_tokens // -self.block_size) > r + 1 and (r in t.positions or t.blocks[r].block_hash is not None):
                return 1
            return 0
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
                            num_draft_tokens: int = 0, decode: bool = False,
                            num_computed_tokens: int | None = None) -> list[KVCacheBlock]:
        """Give the request a running state for ``num_tokens`` main tokens (computed +
        scheduled, drafts under verification included) and ``nspec`` scratch blocks.

        Align mode, when the table must grow to ``R = cdiv(num_tokens, bs) + nspec`` (case
        GROW): the previous running slot is the copy source; the table is padded with null up
        to the new running slot (``_pad_to_running_slot``); scratch blocks now below the running
        slot move to the end (``_relocate_scratch_blocks``); then the one missing block (or
        ``1 + nspec`` for a new request, case NEW) is allocated. The cases are
        :class:`AlignStep`.

        `num_draft_tokens`: how many of the main tokens are unverified drafts (then
        ``accept_drafts`` must follow the step's verify). `decode`: the whole prompt was
        computed before this step (then ``decode_checkpoints`` latest / none apply, see
        ``mamba_decode.py``); `num_computed_tokens`: tokens computed before the step (None:
        ``num_tokens - 1 - drafts``). Used alone (no coordinator), this also runs
        ``plan_checkpoint_write``.

        Raises (nothing changed):
            InvalidTokenCountError / InvalidDraftCountError: see ``check_step``; or a step that
                would rewrite a published running state.
            OutOfBlocksError: the pool is short (the coordinator counts first).
        """
        out = self.allocate_columns(request_id, num_tokens, num_lookahead_tokens, num_draft_tokens, decode=decode,
                                    num_computed_tokens=num_computed_tokens)[0]
        self.plan_checkpoint_write(request_id)
        return out

    def allocate_columns(self, request_id: str, num_tokens: int, num_lookahead_tokens: int,
                         num_draft_tokens: int, *, decode: bool = False,
                         num_computed_tokens: int | None = None) -> list[list[KVCacheBlock]]:
        """``allocate_new_blocks`` for every column of the policy: the new blocks of each
        (spares are not taken here: ``plan_checkpoint_write`` follows)."""
        if num_tokens <= 0 or num_draft_tokens < 0 or num_draft_tokens > self.num_speculative_blocks \
                or self.is_follower:
            self._check_leader()
            self.check_step(num_tokens, num_draft_tokens)
        t = self._tables.get(request_id) or self.table(request_id)
        if decode and self._decode_in_place:
            computed = num_tokens - 1 - num_draft_tokens if num_computed_tokens is None else num_computed_tokens
            out = self._decode_columns(request_id, t, num_tokens, num_draft_tokens, computed)
        else:
            out = self._align_columns(request_id, t, num_tokens, num_draft_tokens)
        if self._list_writes:
            self._list_step_writes(request_id, t, num_tokens, num_draft_tokens)
        return out

    # ------------------------------------------------------------------ publication
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the states that are settled: a block whose tagged position is at most
        `num_tokens` *processed* tokens is published iff that position is exactly its slot's
        boundary ``(slot + 1) * block_size``; other settled tags are dropped. Scratch blocks
        and nulls are never published."""
        t = self._tables.get(request.request_id)
        if t is None:
            return
        if t.decode_steps or t.spare_pos:  # latest: settle decode steps, publish a settled crossing
            self._check_leader()
            self._settle_decode(t, num_tokens)
            self._publish_spare(request, t, num_tokens)
        if t.positions:
            self._check_leader()
            self.publish_settled(request, t, num_tokens)

    def publish_settled(self, request: Request, t: MambaTable, num_tokens: int) -> None:
        """The tagged half of ``cache_blocks`` (the chunk path calls it directly): each tag at
        most `num_tokens` leaves; a tag on its slot's boundary publishes the slot's block of
        every column under the slot's key."""
        positions = t.positions
        bs = self.block_size
        keys: Sequence[bytes] | None = None
        for slot, pos in [(s, p) for s, p in positions.items() if p <= num_tokens]:
            del positions[slot]
            if pos != (slot + 1) * bs or not self.enable_caching:
                continue  # settled off its boundary (or no caching): nothing to publish
            if keys is None:
                keys = request.block_hashes if request.hash_block_size == bs else group_block_hashes(request, bs)
            if slot >= len(keys):
                continue
            states = [col[slot] for col in t.columns]
            if self.block_pool.enable_kv_cache_events:
                self.block_pool.cache_state_blocks(states, keys[slot], self._column_ids,
                                                   **stored_event_fields(request, keys, slot, slot + 1, bs))
            else:
                self.block_pool.cache_state_blocks(states, keys[slot], self._column_ids)
            if t.in_decode:  # latest: a decode step without drafts ended exactly on the boundary
                self._note_checkpoint(t, [col[slot] for col in t.columns], keys[slot])

    def next_event(self, table: BlockTable) -> int:
        """The earliest of: a tagged state's position (publication), the next retirement
        (``(watermark + 1) * bs + 1``), a verified step's position (its state's slot rule), and
        the start of the oldest step waiting for ``accept_drafts`` (retiring past it raises)."""
        t: MambaTable = table  # type: ignore[assignment]
        nxt = (t.retired_below + 1) * self.block_size + 1 if self._align else NEVER
        for pos in t.positions.values():
            if pos < nxt:
                nxt = pos
        if t.verified and t.verified[0][0] < nxt:
            nxt = t.verified[0][0]
        if t.verify_steps:
            _, tokens, drafts = t.verify_steps[0]
            nxt = min(nxt, tokens - drafts)
        if t.decode_steps or t.spare_pos:
            nxt = min(nxt, self.decode_event(t))
        return nxt

    def settle(self, table: BlockTable, num_processed_tokens: int) -> None:
        """The verified entries (see DraftsMixin), and latest's decode steps."""
        super().settle(table, num_processed_tokens)
        t: MambaTable = table  # type: ignore[assignment]
        if t.decode_steps:
            self._settle_decode(t, num_processed_tokens)

# (chunks_fusable and the coordinator's copy drain: a rule planted on the class opts out)
record_own_calls(MambaManager, (*MAMBA_CHUNK_STEPS, "take_copy_plan"))
