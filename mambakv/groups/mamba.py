"""MambaManager: recurrent-state blocks, in mode NONE or align mode (DESIGN.md 5.1).

Align mode in one picture (block 560, 3 speculative blocks; ``1`` real block, ``0`` null;
the engine retires to the computed tokens before each allocation)::

    step  computed + scheduled  table after allocate            copy (slot -> slot)
    1     0    + 2800           0 0 0 0 1 1 1 1                 none (new, no hit)
    2     2800 + 2240           0 0 0 0 1 0 0 0 1 1 1 1         4 -> 8
    3     5040 + 560            0 0 0 0 0 0 0 0 1 1 1 1 1       8 -> 9
    4     5600 + 4              0 0 0 0 0 0 0 0 0 1 1 1 1 1     9 -> 10

Slot i holds the state after token ``(i + 1) * block_size``. The running state sits at
``running_slot(main) = cdiv(main, bs) - 1``; the ``nspec`` scratch blocks follow it. The table
and its transitions (pad, relocate, record, the watermark) are :mod:`mambakv.groups.mamba_table`;
the decode-checkpoint policies (every / latest / none) are objects in
:mod:`mambakv.groups.decode_checkpoints`. This module decides:

=====================  ===========================================================
count                  ``get_num_blocks_to_allocate``: 1 + nspec new, 1 to grow, else 0
commit                 the AlignStep cases (NEW, GROW, IN_PLACE, BEHIND, COVERED,
                       ADVANCE) and the copy / zero plans
spec decode            ``accept_drafts``; the verified-state retirement rule
publish                a tagged state, once its position is processed
retire, free           the watermark over every column
shared policy          one table for several groups with one spec (``share_policy``)
=====================  ===========================================================

Several groups with one spec (Qwen3-Next: 3 GDN groups) share one policy: the first group's
manager drives one :class:`MambaTable` whose ``columns`` are every group's block lists; the
others are read-only views. Their tables have the same null pattern (every transition moves
all columns alike), but their blocks' *contents* may differ: one group's copy of a published
state can be evicted alone (``BlockPool.evict_blocks``, or eviction under pressure). So every
decision that reads a block's hash or ref count asks every column (``_published``).
"""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.engine_request import EngineRequest
from mambakv.core.errors import (
    DoubleFreeError,
    InvalidDraftCountError,
    InvalidRequestError,
    InvalidSpecError,
    InvalidTokenCountError,
    as_count,
)
from mambakv.core.events import stored_event_fields
from mambakv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec
from mambakv.groups.base import NEVER, BlockTable, SingleTypeKVCacheManager, group_block_hashes, num_evictable
from mambakv.groups.decode_checkpoints import DecodeCheckpointPolicy, make_decode_policy
from mambakv.groups.kinds import GroupKind
from mambakv.groups.mamba_table import (
    AlignStep,
    ColumnTable,
    MambaTable,
    move_running,
    null_slots,
    pad_to_running_slot,
    real_slots,
    record_step,
    relocate_scratch_blocks,
)
from mambakv.plans import StatePlan, TableView

__all__ = ["MambaManager"]

_GROW = AlignStep.GROW


class MambaManager(SingleTypeKVCacheManager):
    """State blocks of one Mamba group (one block = one whole state of every layer).

    Mode NONE: a request holds ``1 + nspec`` blocks (running state + scratch) whatever its
    length; nothing is hashed or retired. Mode ALIGN: see the module docstring and
    ``allocate_new_blocks``.

    Copies the engine must run, as ``(src block id, dst block id)`` pairs:
    ``take_copy_plan()`` before the step's forward, and the list ``accept_drafts`` returns
    after its verify. ``take_zero_plan()`` lists running blocks that start with no initial
    state (new requests without a hit): zero them, or run the kernel without initial state.

    Attributes:
        decode: the decode-checkpoint policy (``MambaSpec.decode_checkpoints``).
    """

    kind = GroupKind.MAMBA
    publishes_at_allocation = False
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
        self.decode_checkpoints = kv_cache_spec.decode_checkpoints
        self.decode: DecodeCheckpointPolicy = make_decode_policy(
            self.decode_checkpoints, align=self._align, caching=self.enable_caching, block_pool=block_pool,
            block_size=self.block_size)
        self._copy_plan: list[tuple[int, int]] = []
        self._zero_plan: list[int] = []
        #: ``(request id, block id, position)`` the planned forwards write, since the last take
        self._writes: list[tuple[str, int, int]] = []
        #: the managers of every column this one drives (itself first, then its followers)
        self._column_managers: tuple[MambaManager, ...] = (self,)

    @property
    def spare_may_evict(self) -> bool:
        """``latest`` may evict a cached block for a decode checkpoint (a benchmark knob)."""
        return self.decode.spare_may_evict

    @spare_may_evict.setter
    def spare_may_evict(self, value: bool) -> None:
        self.decode.spare_may_evict = bool(value)

    # ------------------------------------------------------------------ one policy, several columns
    def share_policy(self, followers: Sequence[MambaManager]) -> None:
        """Drive the tables of `followers` (groups with an identical spec) with this manager's
        policy: their per-request work is done once, for every block column, so a step of a
        model with 3 identical Mamba groups does its bookkeeping once. Only before any request
        holds blocks::

            leader table   columns[0]  [0 0 0 R S S S]     group 1 (the leader's own ``blocks``)
                           columns[1]  [0 0 0 R S S S]     group 3 (a read-only ColumnTable view)
                           columns[2]  [0 0 0 R S S S]     group 5

        Raises:
            InvalidSpecError: a follower's spec or pool differs, or a table already exists."""
        for f in followers:
            if f.kv_cache_spec != self.kv_cache_spec or f.block_pool is not self.block_pool:
                raise InvalidSpecError(f"group {f.kv_cache_group_id} cannot share group {self.kv_cache_group_id}'s policy")
        if self._tables or any(f._tables for f in followers):
            raise InvalidSpecError("share_policy before any request holds blocks")
        for f in followers:
            f.is_follower = True
        self._column_managers = (self, *followers)
        self.column_ids = tuple(m.kv_cache_group_id for m in self._column_managers)

    def _check_leader(self) -> None:
        """Followers are driven through their leader (the coordinator does that).

        Raises:
            InvalidRequestError: this manager follows another group's policy."""
        if self.is_follower:
            raise InvalidRequestError(
                f"group {self.kv_cache_group_id} shares the policy of another group with the same spec: "
                f"drive it through the coordinator (or build the manager alone)")

    def table(self, request_id: str) -> MambaTable:
        """The request's table (created with one block column per sharing group)."""
        t = self._tables.get(request_id)
        if t is None:
            t = self._tables[request_id] = MambaTable()
            for f in self._column_managers[1:]:
                col: list[KVCacheBlock] = []
                t.columns.append(col)
                f._tables[request_id] = ColumnTable(t, col)  # type: ignore[assignment]  # a read-only view
        return t

    @staticmethod
    def _published(t: MambaTable, slot: int) -> bool:
        """Any column's block at `slot` is published (its state may be another request's hit,
        so no step may write it). Columns share their null pattern, not their hashes: one
        group's copy may have been evicted alone."""
        for col in t.columns:
            if col[slot].block_hash is not None:
                return True
        return False

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
        running slot moves past the table, else 0 (decode under ``latest`` / ``none``: 1 only
        when the running block holds a boundary state to publish). Lookahead tokens never add
        blocks. Pure."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            evictable = num_evictable(new_computed_blocks) if new_computed_blocks else 0
            return 1 + self.num_speculative_blocks + evictable
        r = t.running_slot
        if not self._align or -(num_tokens // -self.block_size) <= r + 1:
            return 0
        if t.in_decode and not (r in t.positions or self._published(t, r)):
            return 0  # latest / none: the running block advances in place
        return 1  # the running slot moves on: exactly one block is missing

    def count_columns(self, request_id: str, num_tokens: int, hits: Sequence[Sequence[KVCacheBlock]],
                      num_computed_tokens: int, num_lookahead_tokens: int) -> int:
        """``get_num_blocks_to_allocate`` times the columns, plus every column's evictable hits."""
        n = self.get_num_blocks_to_allocate(request_id, num_tokens, hits[0], num_computed_tokens,
                                            num_lookahead_tokens)
        if len(hits) == 1 or not n:
            return n
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            return (1 + self.num_speculative_blocks) * len(hits) + sum(num_evictable(h) for h in hits if h)
        return n * len(hits)

    def num_covered_tokens(self, request_id: str) -> int:
        """Tokens up to the running slot's boundary: beyond it the running state moves to a
        new slot (one block); mode NONE never needs one once running."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            return 0
        return (t.running_slot + 1) * self.block_size if self._align else NEVER

    def check_writable_step(self, request_id: str, num_tokens: int, decode: bool = False) -> None:
        """Raise (nothing changed) what the allocation of a running request's step to
        `num_tokens` main tokens would raise for rewriting a published running state: a step
        that ends inside (IN_PLACE) or, after drafts, below (BEHIND) the running slot writes
        the running block in place, and so does a decode step under ``latest`` / ``none``
        that advances it (ADVANCE). The coordinator asks every Mamba policy before any group
        commits. `decode`: the prompt was computed before the step.

        Raises:
            InvalidTokenCountError: the running block is published (the engine moved its
                computed count below a retired one)."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0 or not self._align:
            return
        r = t.running_slot
        running = -(num_tokens // -self.block_size) - 1
        if running > r:  # GROW / ADVANCE: the state goes to a block of its own, or R moves on unpublished
            return
        if running < r and not (t.had_drafts or (decode and self.decode.in_place)):
            return  # COVERED: nothing is written
        self._check_writable(request_id, t, r, num_tokens)

    def _check_writable(self, request_id: str, t: MambaTable, running: int, num_tokens: int) -> None:
        if self._published(t, running):
            raise InvalidTokenCountError(
                f"request {request_id!r}: a step to {num_tokens} tokens would rewrite the published state at slot "
                f"{running} (another request may hold it as a hit)")

    # ------------------------------------------------------------------ commit
    def add_hits(self, request_id: str, hits: Sequence[Sequence[KVCacheBlock]]) -> None:
        """A new request's hit in every column (``[null, .., H]``): one touch for all of them.

        Raises (nothing changed):
            InvalidRequestError: the request already holds blocks, or this manager follows
                another's policy.
            InvalidBlockError: a real block listed twice (from ``BlockPool.touch``).
        """
        self._check_leader()
        if len(hits) != len(self._column_managers):
            raise InvalidRequestError("a shared Mamba policy takes every column's hits at once (add_hits)")
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

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0, decode: bool = False,
                            num_computed_tokens: int | None = None) -> list[KVCacheBlock]:
        """Give the request a running state for ``num_tokens`` main tokens (computed +
        scheduled, drafts under verification included) and ``nspec`` scratch blocks.

        Align mode, when the table must grow to ``R = cdiv(num_tokens, bs) + nspec`` (case
        GROW): the previous running slot is the copy source; the table is padded with null up
        to the new running slot (``pad_to_running_slot``); scratch blocks now below the running
        slot move to the end (``relocate_scratch_blocks``); then the one missing block (or
        ``1 + nspec`` for a new request, case NEW) is allocated. The cases are
        :class:`~mambakv.groups.mamba_table.AlignStep`.

        `num_draft_tokens`: how many of the main tokens are unverified drafts (then
        ``accept_drafts`` must follow the step's verify). `decode`: the whole prompt was
        computed before this step (then ``decode_checkpoints`` latest / none apply);
        `num_computed_tokens`: tokens computed before the step (None:
        ``num_tokens - 1 - drafts``).

        Raises (nothing changed):
            InvalidTokenCountError / InvalidDraftCountError: see ``check_step``; or a step that
                would rewrite a published running state.
            InvalidRequestError: this manager follows another group's policy.
            OutOfBlocksError: the pool is short (count first, as the coordinator does).
        """
        return self.allocate_columns(request_id, num_tokens, num_lookahead_tokens, num_draft_tokens, decode=decode,
                                     num_computed_tokens=num_computed_tokens)[0]

    def allocate_columns(self, request_id: str, num_tokens: int, num_lookahead_tokens: int,
                         num_draft_tokens: int, *, decode: bool = False,
                         num_computed_tokens: int | None = None) -> list[list[KVCacheBlock]]:
        """``allocate_new_blocks`` for every column of the policy: the new blocks of each.

        Raises: as ``allocate_new_blocks``."""
        if num_tokens <= 0 or num_draft_tokens < 0 or num_draft_tokens > self.num_speculative_blocks \
                or self.is_follower:
            self._check_leader()
            self.check_step(num_tokens, num_draft_tokens)
        t = self._tables.get(request_id) or self.table(request_id)
        bs = self.block_size
        running = -(num_tokens // -bs) - 1 if self._align else 0
        r = t.running_slot
        in_place = decode and self.decode.in_place
        if r < 0:
            out = self._start(t, running, num_tokens, num_draft_tokens)
        elif in_place:
            out = self._advance(request_id, t, running, num_tokens, num_draft_tokens)
        elif running > r:
            out = self._grow(t, running, num_tokens, num_draft_tokens)
        else:
            out = [[] for _ in t.columns]
            case = AlignStep.IN_PLACE
            if running < r and not t.had_drafts:
                t.last_step = AlignStep.COVERED  # vllm-ascend #16329: a no-op, not a crash
            else:
                if running < r:
                    # Block 2, 3 computed, 1 + 3 drafts: running slot 3; 0 accepted; the next step
                    # from 4 reaches slot 2 only, but the state at 4 is in slot 3.
                    case, running = AlignStep.BEHIND, r
                self._check_writable(request_id, t, running, num_tokens)
                record_step(t, running, num_tokens, num_draft_tokens, case,
                            self.enable_caching and num_tokens == (running + 1) * bs)
        if in_place:
            computed = num_tokens - 1 - num_draft_tokens if num_computed_tokens is None else num_computed_tokens
            self.decode.after_plan(t, num_tokens, num_draft_tokens, computed)
            t.in_decode = True
        # the forward writes the running block (position num_tokens - drafts) and scratch block
        # k (position num_tokens - drafts + k + 1): planned counts, exact under synchronous
        # scheduling, optimistic under async
        r, real_end = t.running_slot, num_tokens - num_draft_tokens
        for col, m in zip(t.columns, self._column_managers):
            m._writes.append((request_id, col[r].block_id, real_end))
            if num_draft_tokens:
                m._writes.extend([(request_id, col[r + 1 + k].block_id, real_end + k + 1)
                                  for k in range(num_draft_tokens)])
        return out

    def _start(self, t: MambaTable, running: int, num_tokens: int, drafts: int) -> list[list[KVCacheBlock]]:
        """Case NEW: a hit table is ``[null, ..., H]`` (H is the state to resume from, copied into
        the running block); without a hit the running block starts from zero."""
        per = 1 + self.num_speculative_blocks
        new = self.block_pool.get_new_blocks(per * len(t.columns))
        null = self.null_block
        source = len(t.blocks) - 1
        hit = source >= 0 and t.blocks[source] is not null
        pad_to_running_slot(t, running, null)
        out = []
        for k, (col, m) in enumerate(zip(t.columns, self._column_managers)):
            mine = new[k * per : (k + 1) * per]
            col += mine
            if hit:
                m._copy_plan.append((col[source].block_id, col[running].block_id))
            else:
                m._zero_plan.append(col[running].block_id)
            out.append(mine)
        record_step(t, running, num_tokens, drafts, AlignStep.NEW,
                    self.enable_caching and num_tokens == (running + 1) * self.block_size)
        return out

    def _grow(self, t: MambaTable, running: int, num_tokens: int, drafts: int) -> list[list[KVCacheBlock]]:
        """Case GROW: the running slot moves from `source` to `running`; every column's scratch
        below the running slot is relocated (``relocate_scratch_blocks``, padding included),
        which leaves exactly one block missing per column (the last scratch block); the last
        state is copied into the new running block."""
        source = t.running_slot
        relocate_scratch_blocks(t, running, self.num_speculative_blocks, self.null_block)
        cols = t.columns
        new = self.block_pool.get_new_blocks(len(cols))
        out = []
        for col, m, block in zip(cols, self._column_managers, new):
            col.append(block)
            m._copy_plan.append((col[source].block_id, col[running].block_id))
            out.append([block])
        record_step(t, running, num_tokens, drafts, _GROW,
                    self.enable_caching and num_tokens == (running + 1) * self.block_size)
        return out

    def _advance(self, request_id: str, t: MambaTable, running: int, num_tokens: int,
                 drafts: int) -> list[list[KVCacheBlock]]:
        """A decode step under ``latest`` / ``none``: the running block advances in place
        (ADVANCE when its slot moves on), except when it holds a boundary state that is (to be)
        published: the step after a chunk that ended on a boundary, or (``latest``) after a step
        without drafts that ended exactly on one, grows once, as in every."""
        r = t.running_slot
        if running > r and (r in t.positions or self._published(t, r)):
            return self._grow(t, running, num_tokens, drafts)
        case = AlignStep.IN_PLACE
        if running > r:
            move_running(t, running, self.null_block)
            case = AlignStep.ADVANCE
        elif running < r:
            case, running = AlignStep.BEHIND, r
        self._check_writable(request_id, t, running, num_tokens)
        record_step(t, running, num_tokens, drafts, case,
                    self.enable_caching and num_tokens == (running + 1) * self.block_size)
        return [[] for _ in t.columns]

    # ------------------------------------------------------------------ spec decode
    def accept_drafts(self, request_id: str, num_accepted: int) -> list[tuple[int, int]]:
        """After the verify of the request's oldest unverified step: the copy that moves the
        state of the last accepted position into the running block::

            slots  [.. R  S1 S2 S3]      step: 1 + 3 drafts, running slot R
            a = 2: copy S2 -> R          the state after draft 2 becomes the running state
            a = 0: no copy               R already holds the state after the real token

        Scratch block k (slot ``running + 1 + k``) holds the state after draft ``k + 1``.

        Raises (nothing changed):
            InvalidDraftCountError: `num_accepted` outside ``0 .. drafts of that step``, or not
                an int.
            InvalidRequestError: this manager follows another group's policy.
        """
        return self.accept_drafts_columns(request_id, num_accepted)[0]

    def accept_drafts_columns(self, request_id: str, num_accepted: int) -> list[list[tuple[int, int]]]:
        """``accept_drafts`` for every column of the policy: the copies of each group."""
        self._check_leader()
        num_accepted = as_count(num_accepted, "num_accepted", error=InvalidDraftCountError)
        t = self._tables.get(request_id)
        if t is None or not t.verify_steps:
            if num_accepted != 0:
                raise InvalidDraftCountError(f"request {request_id!r} has no step with drafts to verify")
            return [[] for _ in self.column_ids]
        slot, num_tokens, num_drafts = t.verify_steps[0]
        if not 0 <= num_accepted <= num_drafts:
            raise InvalidDraftCountError(f"accepted {num_accepted} of {num_drafts} drafts")
        t.verify_steps.popleft()
        position = num_tokens - num_drafts + num_accepted
        if self._align and slot > (position - 1) // self.block_size:
            t.verified.append((position, slot))  # see dead_slots
        if t.in_decode:  # latest / none: the running block advances in place
            r = t.running_slot
            copies = [[(col[r + num_accepted].block_id, col[r].block_id)] if num_accepted else []
                      for col in t.columns]
            return self.decode.on_verify(t, num_accepted, copies)
        # Tag a boundary state only if no later step was planned into this block meanwhile
        # (async scheduling): then the block keeps exactly this state.
        latest = not t.verify_steps and t.running_slot == slot and t.num_tokens == num_tokens
        if latest and self.enable_caching and position == (slot + 1) * self.block_size:
            t.positions[slot] = position
        if num_accepted == 0:
            return [[] for _ in t.columns]
        return [[(col[slot + num_accepted].block_id, col[slot].block_id)] for col in t.columns]

    # ------------------------------------------------------------------ publish
    def cache_blocks(self, request: EngineRequest, num_tokens: int) -> None:
        """Publish the states that are settled: a block whose tagged position is at most
        `num_tokens` *processed* tokens is published iff that position is exactly its slot's
        boundary ``(slot + 1) * block_size``; other settled tags are dropped. Scratch blocks
        and nulls are never published.

        Raises:
            InvalidRequestError: this manager follows another group's policy.
        """
        t = self._tables.get(request.request_id)
        if t is None or not (t.positions or t.decode_steps or t.spare_pos):
            return
        if self.is_follower:
            self._check_leader()
        if t.decode_steps or t.spare_pos:  # latest: settle decode steps, publish a settled crossing
            self.decode.on_retire(request, t, self.column_ids, num_tokens)
        positions = t.positions
        settled = []
        for slot, pos in positions.items():
            if pos <= num_tokens:
                settled.append(slot)
        if not settled:
            return
        bs = self.block_size
        keys: Sequence[bytes] | None = None
        pool = self.block_pool
        for slot in settled:
            pos = positions.pop(slot)
            if pos != (slot + 1) * bs or not self.enable_caching:
                continue  # settled off its boundary (or no caching): nothing to publish
            if keys is None:
                keys = request.block_hashes if request.hash_block_size == bs else group_block_hashes(request, bs)
            if slot >= len(keys):
                continue
            states = [col[slot] for col in t.columns]
            if pool.enable_kv_cache_events:
                pool.cache_state_blocks(states, keys[slot], self.column_ids,
                                        **stored_event_fields(request, keys, slot, slot + 1, bs))
            else:
                pool.cache_state_blocks(states, keys[slot], self.column_ids)
            if t.in_decode:  # a decode step without drafts ended exactly on the boundary
                self.decode.note_checkpoint(t, states, keys[slot])

    # ------------------------------------------------------------------ retire
    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Retire (see the base class): ``dead_slots`` (its checks run in mode NONE too, where
        nothing is retired), ``retire_slots``, ``settle``.

        Raises (nothing changed): as ``dead_slots``; InvalidRequestError for a follower."""
        t = self._tables.get(request_id)
        if t is None or num_processed_tokens < 0:
            if num_processed_tokens < 0:
                raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
            return
        if self.is_follower:
            self._check_leader()
        num_slots = self.dead_slots(t, num_processed_tokens)
        if num_slots > t.retired_below:
            self.retire_slots(t, num_slots)
        if t.verified or t.decode_steps:
            self.settle(t, num_processed_tokens)

    def dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int:
        """Slots below ``(n - 1) // bs`` (only the last state matters), plus: the state of a
        verified step lives in its running slot, which its drafts may have pushed past
        ``(n - 1) // bs``; once that state is processed, every slot below it is dead too.
        Block 2, nspec 3, after 1 computed token a step of 1 + 2 drafts runs at slot 1; with 0
        accepted its state is at 2 tokens, so retiring to 2 frees slot 0 (the first rule frees
        ``(2 - 1) // 2 = 0`` slots: the request would hold 6 blocks, not 2 + 3, after its next
        step). Pure.

        Raises:
            InvalidDraftCountError: the tokens claim results of a step with drafts whose
                ``accept_drafts`` has not come (pass ``allocate(num_draft_tokens=...)`` under
                async scheduling: placeholders are not drafts).
            InvalidTokenCountError: it would retire the running slot: processed tokens beyond
                the running state's boundary were never scheduled.
        """
        t: MambaTable = table  # type: ignore[assignment]
        if t.verify_steps:
            _, tokens, drafts = t.verify_steps[0]
            if num_processed_tokens > tokens - drafts - 1:
                raise InvalidDraftCountError(
                    f"{num_processed_tokens} tokens processed, but the step to {tokens} tokens with {drafts} drafts "
                    f"was not verified: call accept_drafts first (or pass num_draft_tokens=0 for a step without "
                    f"drafts)")
        if not self.retires:
            return 0
        num_slots = (num_processed_tokens - 1) // self.block_size
        for position, slot in t.verified:
            if position > num_processed_tokens:
                break
            if slot > num_slots:
                num_slots = slot
        running = t.running_slot
        if 0 <= running < num_slots:
            raise InvalidTokenCountError(
                f"retiring {num_slots} slots would free the running state at slot {running}: more tokens "
                f"processed than were ever scheduled (at most {(running + 1) * self.block_size})")
        return num_slots

    def retire_slots(self, table: BlockTable, num_slots: int) -> None:
        """Retire slots ``[watermark, num_slots)`` in every column (see the base class): one
        free for all columns (deepest first, null gaps skipped), then the slots are nulled and
        the watermark moves; all or nothing."""
        t: MambaTable = table  # type: ignore[assignment]
        n = len(t.blocks)
        stop = num_slots if num_slots < n else n
        if stop <= t.retired_below:
            return
        null = self.null_block
        # Every column has column 0's null pattern (check_invariants): scan one, gather from all.
        real = real_slots(t.blocks, t.retired_below, stop, null)  # deepest first
        if real:
            freed = []  # a loop, not a comprehension: this runs once per chunk of every long prefill
            for col in t.columns:
                for i in real:
                    freed.append(col[i])
            self.block_pool.free_blocks(freed)
        null_slots(t, real, stop, null)

    def settle(self, table: BlockTable, num_processed_tokens: int) -> None:
        """Drop the verified entries that `num_processed_tokens` passed (``dead_slots`` applied
        their slot rule), and settle ``latest``'s decode steps."""
        t: MambaTable = table  # type: ignore[assignment]
        verified = t.verified
        if not (verified or t.decode_steps):  # a prefill chunk's retire: nothing to settle
            return
        while verified and verified[0][0] <= num_processed_tokens:
            verified.popleft()
        if t.decode_steps:
            self.decode.settle(t, num_processed_tokens)

    def next_event(self, table: BlockTable) -> int:
        """The earliest of: a tagged state's position (publication), the next retirement
        (``(watermark + 1) * bs + 1``), a verified step's position (its state's slot rule), the
        start of the oldest step waiting for ``accept_drafts`` (retiring past it raises), and
        the decode policy's next event. Pure."""
        t: MambaTable = table  # type: ignore[assignment]
        nxt = (t.retired_below + 1) * self.block_size + 1 if self._align else NEVER
        for pos in t.positions.values():
            if pos < nxt:
                nxt = pos
        if t.verified and t.verified[0][0] < nxt:
            nxt = t.verified[0][0]
        if t.verify_steps:
            _, tokens, drafts = t.verify_steps[0]
            if tokens - drafts < nxt:
                nxt = tokens - drafts
        if t.decode_steps or t.spare_pos:
            nxt = min(nxt, self.decode.next_event(t))
        return nxt

    def thresholds(self, table: BlockTable) -> tuple[int, int]:
        """Covered: up to the running slot's boundary (``num_covered_tokens``). Quiet: steps
        strictly inside the running slot with no step awaiting ``accept_drafts`` only advance
        the state in place (nothing to tag: the boundary itself is excluded); in decode, what
        the decode policy allows. Pure::

            covered   (running slot + 1) x bs       beyond it the running block must move (or grow)
            quiet     covered - 1                   every / prefill: a step strictly inside the block
                      min(covered, B) - 1           latest in decode: below the next boundary B
                      0                             a step awaits accept_drafts, or latest has a step
                                                    in flight (it must be resolved in order)
        """
        t: MambaTable = table  # type: ignore[assignment]
        if t.running_slot < 0:
            return 0, 0
        if not self._align:
            return NEVER, 0 if t.verify_steps else NEVER
        covered = (t.running_slot + 1) * self.block_size
        if t.verify_steps:
            return covered, 0
        return covered, self.decode.quiet(t, covered) if t.in_decode else covered - 1

    # ------------------------------------------------------------------ free
    def check_free(self, request_id: str) -> None:
        """Raise DoubleFreeError (nothing changed) if ``free(request_id)`` would fail."""
        t = self._tables.get(request_id)
        if t is not None:
            low = t.retired_below
            for col in t.columns:
                for b in col[low:]:
                    if b.ref_cnt <= 0 and not b.is_null:
                        raise DoubleFreeError(f"block {b.block_id} of request {request_id!r} is already free")

    def free(self, request_id: str) -> None:
        """Drop the request in every column (tail first, see the base class), and its pending
        entries of the copy and zero plans and checkpoint writes: a preempted request's copy
        must not run into a block that is reused.

        Raises (nothing changed):
            DoubleFreeError: a block is already free.
            InvalidRequestError: this manager follows another group's policy."""
        t = self._tables.get(request_id)
        if t is None:
            return
        self._check_leader()
        low = t.retired_below  # below the watermark every slot is null: a long prefill's table is mostly that
        self.block_pool.free_blocks([b for col in t.columns for b in reversed(col[low:])])  # raises before any change
        self.decode.on_free()  # latest: a step of it may be in flight
        for col, m in zip(t.columns, self._column_managers):
            del m._tables[request_id]
            if m._writes:
                m._writes = [w for w in m._writes if w[0] != request_id]
            if m._copy_plan or m._zero_plan:
                ids = {b.block_id for b in col if not b.is_null}
                m._copy_plan = [p for p in m._copy_plan if p[1] not in ids]
                m._zero_plan = [b for b in m._zero_plan if b not in ids]

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

    def take_checkpoint_writes(self) -> list[tuple[str, int, int]]:
        """``(request id, block id, position)`` for each block a planned forward writes, since
        the last call: the running block and the scratch blocks (``latest`` adds none: its
        checkpoint is a copy made at verify). Quiet steps (the coordinator's O(1) path: no
        drafts, strictly inside the running block) are not listed: they only advance the
        running block in place."""
        out, self._writes = self._writes, []
        return out

    def drop_checkpoint_writes(self) -> None:
        """Forget the writes not taken (the coordinator's ``new_step`` calls it)."""
        if self._writes:
            self._writes = []

    # ------------------------------------------------------------------ queries
    def get_state_plan(self, request_id: str) -> StatePlan | None:
        """Running, scratch and spare block ids of the request (None before it holds a state)."""
        t = self._tables.get(request_id)
        if t is None or t.running_slot < 0:
            return None
        blocks, r = t.blocks, t.running_slot
        spare = blocks[-1].block_id if t.has_spare else 0
        scratch = tuple(b.block_id for b in blocks[r + 1 : r + 1 + self.num_speculative_blocks])
        return StatePlan(blocks[r].block_id, 0, 0, spare, scratch, None)

    def describe(self, request_id: str) -> TableView | None:
        """A read-only snapshot of the request's table, with the align-mode fields."""
        t = self._tables.get(request_id)
        if t is None:
            return None
        return TableView(self.kv_cache_group_id, tuple(b.block_id for b in t.blocks), t.num_cached_blocks,
                         t.retired_below, t.running_slot, t.num_tokens, tuple(sorted(t.positions.items())),
                         tuple(t.verify_steps), tuple(t.verified), t.had_drafts)

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
        return 0 if t is None else sum(1 for b in t.blocks[t.retired_below:] if not b.is_null)  # null below

    # ------------------------------------------------------------------ prefix hits
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

    # ------------------------------------------------------------------ a manager used alone
    def schedule_step(self, request_id: str, num_tokens: int, num_processed_tokens: int, *,
                      num_draft_tokens: int = 0) -> list[KVCacheBlock] | None:
        """One request-step of a manager used alone: retire to `num_processed_tokens`, count,
        allocate for `num_tokens` main tokens (``remove_skipped_blocks`` +
        ``get_num_blocks_to_allocate`` + ``allocate_new_blocks``). Returns the new blocks, or
        None (nothing changed but the retirement) when the pool is short.

        Raises: as those three calls."""
        self.remove_skipped_blocks(request_id, num_processed_tokens)
        need = self.get_num_blocks_to_allocate(request_id, num_tokens) * len(self._column_managers)
        if need > self.block_pool.get_num_free_blocks():
            return None
        return self.allocate_new_blocks(request_id, num_tokens, num_draft_tokens=num_draft_tokens)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Base checks, plus: scratch blocks have ref count 1 and no hash; the running block
        is real and unshared; position tags lie within the table; every block column (groups
        sharing the policy) has column 0's length and null slots; a table in decode is shaped
        ``[0 .. R S*nspec (C)]``."""
        super().check_invariants()
        null = self.null_block
        for rid, t in self._tables.items():
            for col in t.columns[1:]:
                assert len(col) == len(t.blocks) and all((a is null) == (b is null) for a, b in zip(col, t.blocks)), \
                    f"{rid}: block columns differ in shape"
            if t.running_slot < 0:
                continue
            r = t.running_slot
            assert r < len(t.blocks) and t.blocks[r] is not null, f"{rid}: running slot {r} null"
            for col in t.columns:
                for b in col[r + 1 :]:
                    assert b is not null and b.ref_cnt == 1 and b.block_hash is None, f"{rid}: bad scratch {b}"
            assert all(0 <= s < len(t.blocks) for s in t.positions), f"{rid}: tag outside table"
            if t.in_decode:  # latest / none: [0 .. R S .. S (C)], the running block never tagged
                assert len(t.blocks) == r + 1 + self.num_speculative_blocks + t.has_spare, f"{rid}: decode layout"
                bound = (r + 1) * self.block_size  # latest: a step without drafts ended on it
                assert t.positions.get(r, bound) == bound and (self.decode.keeps_tags or r not in t.positions), \
                    f"{rid}: decode tags"
                assert t.has_spare == bool(t.spare_pos), f"{rid}: a checkpoint block without its boundary"
