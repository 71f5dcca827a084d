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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidDraftCountError, InvalidTokenCountError, as_count
from mambakv.core.events import stored_event_fields
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec
from mambakv.groups.base import RequestBlocks, SingleTypeKVCacheManager, _num_evictable, cdiv, group_block_hashes


def running_slot(num_tokens: int, block_size: int) -> int:
    """Table slot of the running state once `num_tokens` tokens are computed (>= 1 token)."""
    return cdiv(num_tokens, block_size) - 1


class MambaRequestBlocks(RequestBlocks):
    """Per-request state of a MambaManager.

    Attributes:
        running_slot: slot of the running state (-1 before the first allocation).
        num_tokens: the ``num_tokens`` of the last allocation (its main tokens).
        positions: slot -> the slot's boundary position, for blocks that will hold their
            boundary state once the step that writes them has run; an entry leaves once that
            position is processed and ``cache_blocks`` runs (the state is published then; a
            slot retired meanwhile holds null and publishes nothing), when the block is
            rewritten, or at ``free``.
        verify_steps: ``(running slot, tokens, drafts)`` of steps with draft tokens whose
            ``accept_drafts`` has not come yet, oldest first.
        verified: ``(position, slot)`` of verified steps whose state sits above slot
            ``(position - 1) // bs`` (drafts moved the running slot on), until processed.
    """

    __slots__ = ("running_slot", "num_tokens", "positions", "verify_steps", "verified")

    def __init__(self) -> None:
        super().__init__()
        self.running_slot = -1
        self.num_tokens = 0
        self.positions: dict[int, int] = {}
        self.verify_steps: deque[tuple[int, int, int]] = deque()
        self.verified: deque[tuple[int, int]] = deque()


class MambaManager(SingleTypeKVCacheManager):
    """State blocks of one Mamba group (one block = one whole state of every layer).

    Mode NONE: a request holds ``1 + nspec`` blocks (running state + scratch) whatever its
    length; nothing is hashed or retired. Mode ALIGN: see the module docstring and
    ``allocate_new_blocks``.

    Copies the engine must run, as ``(src block id, dst block id)`` pairs:
    ``take_copy_plan()`` before the step's forward, and the list ``accept_drafts`` returns
    after its verify. ``take_zero_plan()`` lists running blocks that start with no initial
    state (new requests without a hit): zero them, or run the kernel without initial state.
    """

    publishes_at_allocation = False
    state_class = MambaRequestBlocks

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        self.mode = kv_cache_spec.mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self._align = self.mode is MambaCacheMode.ALIGN
        if not self._align:
            self.enable_caching = False
            self.retires = False  # mode NONE keeps one state per request: nothing to retire
        # Only the last state matters: n - 1 tokens are skipped (none in mode NONE).
        self.num_kept_tokens = 1 if self._align else 1 << 62
        self._copy_plan: list[tuple[int, int]] = []
        self._zero_plan: list[int] = []
        self._reqs: dict[str, MambaRequestBlocks]  # type: ignore[assignment]

    # ------------------------------------------------------------------ counting
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = (),
                                   num_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """``1 + nspec`` (+ evictable hits) for a new request; for a running one 1 when the
        running slot moves past the table, else 0. Lookahead tokens never add blocks."""
        st = self._reqs.get(request_id)
        if st is None or st.running_slot < 0:
            evictable = _num_evictable(new_computed_blocks) if new_computed_blocks else 0
            return 1 + self.num_speculative_blocks + evictable
        if self._align and -(num_tokens // -self.block_size) > st.running_slot + 1:
            return 1  # the running slot moves on: exactly one block is missing (see allocate)
        return 0

    def num_covered_tokens(self, request_id: str) -> int:
        """Tokens up to the running slot's boundary: beyond it the running state moves to a
        new slot (one block); mode NONE never needs one once running."""
        st = self._reqs.get(request_id)
        if st is None or st.running_slot < 0:
            return 0
        return (st.running_slot + 1) * self.block_size if self._align else 1 << 62

    # ------------------------------------------------------------------ allocation
    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0) -> list[KVCacheBlock]:
        """Give the request a running state for ``num_tokens`` main tokens (computed +
        scheduled, drafts under verification included) and ``nspec`` scratch blocks.

        Align mode, when the table must grow to ``R = cdiv(num_tokens, bs) + nspec``:
        the previous running slot is the copy source; the table is padded with null up to
        the new running slot (``_pad_to_running_slot``); scratch blocks now below the running
        slot move to the end (``_relocate_scratch_blocks``); then the one missing block (or
        ``1 + nspec`` for a new request) is allocated. Asking for fewer tokens than the table
        covers changes nothing, except for a verify step (drafts): an earlier step's rejected
        drafts moved the running slot past where this step reaches, and it runs in place in
        the running block (its ``accept_drafts`` must find it).

        `num_draft_tokens`: how many of the main tokens are unverified drafts (then
        ``accept_drafts`` must follow the step's verify).
        """
        if num_tokens <= 0 or num_draft_tokens < 0:
            raise InvalidTokenCountError(f"num_tokens must be > 0 and drafts >= 0, got {num_tokens}, {num_draft_tokens}")
        st = self._reqs.get(request_id) or self._state(request_id)
        S = self.num_speculative_blocks
        running = -(num_tokens // -self.block_size) - 1 if self._align else 0
        if num_draft_tokens and 0 <= running < st.running_slot:
            # Block 2, 3 computed, 1 + 3 drafts: running slot 3; 0 accepted; the next step,
            # 1 + 1 drafts from 4, reaches slot 2 only, but the state at 4 is in slot 3.
            running = st.running_slot
        if running == st.running_slot:
            # The common decode step: the running state advances in place (unless it is
            # already published, i.e. fewer tokens than before were asked for).
            if st.blocks[running].block_hash is None:
                self._record_step(st, running, num_tokens, num_draft_tokens)
            return []
        if not self._align:  # mode NONE: a new request gets its running + scratch blocks
            new = self.block_pool.get_new_blocks(1 + S)
            st.blocks.extend(new)
            self._zero_plan.append(new[0].block_id)
            self._record_step(st, 0, num_tokens, num_draft_tokens)
            return new

        blocks = st.blocks
        if st.running_slot < 0:
            # New request: a hit table is [null, ..., H]; H is the state to resume from.
            source = len(blocks) - 1
            self._pad_to_running_slot(blocks, running)
            new = self.block_pool.get_new_blocks(1 + S)
        elif running > st.running_slot:
            source = st.running_slot
            if len(blocks) < running:  # a jump past the scratch blocks (rare): pad first
                self._pad_to_running_slot(blocks, running)
            self._relocate_scratch_blocks(blocks, source, running)
            new = self.block_pool.get_new_blocks(running + 1 + S - len(blocks))
            assert len(new) == 1
        else:
            return []  # fewer tokens than the table covers (or a published state): no-op
        blocks.extend(new)
        if source >= 0 and blocks[source] is not self.null_block:
            self._copy_plan.append((blocks[source].block_id, blocks[running].block_id))
        else:
            self._zero_plan.append(blocks[running].block_id)
        self._record_step(st, running, num_tokens, num_draft_tokens)
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

    def _record_step(self, st: MambaRequestBlocks, running: int, num_tokens: int, num_drafts: int) -> None:
        """Remember the step, and tag the running block with the position its state will hold
        after the forward if that position is the slot's boundary (only such a state can ever
        be published). A verify step's position is known only after ``accept_drafts``.

        Any older tag of the slot is dropped: this step overwrites the block in place."""
        st.running_slot = running
        st.num_tokens = num_tokens
        positions = st.positions
        if num_drafts:
            st.verify_steps.append((running, num_tokens, num_drafts))
        elif self.enable_caching and num_tokens == (running + 1) * self.block_size:
            positions[running] = num_tokens
            return
        if positions:
            positions.pop(running, None)

    # ------------------------------------------------------------------ spec decode
    def accept_drafts(self, request_id: str, num_accepted: int) -> list[tuple[int, int]]:
        """After the verify of the request's oldest unverified step: the copy that moves the
        state of the last accepted position into the running block.

        Scratch block k (slot ``running + 1 + k``) holds the state after draft ``k + 1``; with
        0 accepted the running block already holds the right state (no copy).

        Raises:
            InvalidDraftCountError: `num_accepted` outside ``0 .. drafts of that step``.
            InvalidTokenCountError: `num_accepted` is not an int.
        """
        num_accepted = as_count(num_accepted, "num_accepted", error=InvalidDraftCountError)
        st = self._reqs.get(request_id)
        if st is None or not st.verify_steps:
            if num_accepted != 0:
                raise InvalidDraftCountError(f"request {request_id!r} has no step with drafts to verify")
            return []
        slot, num_tokens, num_drafts = st.verify_steps[0]
        if not 0 <= num_accepted <= num_drafts:
            raise InvalidDraftCountError(f"accepted {num_accepted} of {num_drafts} drafts")
        st.verify_steps.popleft()
        position = num_tokens - num_drafts + num_accepted
        if self._align and slot > (position - 1) // self.block_size:
            st.verified.append((position, slot))  # see remove_skipped_blocks
        # Tag a boundary state only if no later step was planned into this block meanwhile
        # (async scheduling): then the block keeps exactly this state.
        latest = not st.verify_steps and st.running_slot == slot and st.num_tokens == num_tokens
        if latest and self.enable_caching and position == (slot + 1) * self.block_size:
            st.positions[slot] = position
        if num_accepted == 0 or slot + num_accepted >= len(st.blocks):
            return []
        src, dst = st.blocks[slot + num_accepted], st.blocks[slot]
        return [(src.block_id, dst.block_id)]

    def take_copy_plan(self) -> list[tuple[int, int]]:
        """``(src, dst)`` block-id pairs to copy before the next forward (last state or hit
        state -> running block), accumulated since the last call."""
        plan, self._copy_plan = self._copy_plan, []
        return plan

    def take_zero_plan(self) -> list[int]:
        """Running blocks that start without initial state, since the last call."""
        plan, self._zero_plan = self._zero_plan, []
        return plan

    # ------------------------------------------------------------------ publication
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the states that are settled: a block whose tagged position is at most
        `num_tokens` *processed* tokens is published iff that position is exactly its slot's
        boundary ``(slot + 1) * block_size``; other settled tags are dropped. Scratch blocks
        and nulls are never published."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        positions = st.positions
        if not positions:
            return
        bs = self.block_size
        keys: Sequence[bytes] | None = None
        for slot, pos in [(s, p) for s, p in positions.items() if p <= num_tokens]:
            del positions[slot]
            if pos != (slot + 1) * bs or not self.enable_caching:
                continue  # settled off its boundary (or no caching): nothing to publish
            block = st.blocks[slot]
            if keys is None:
                keys = group_block_hashes(request, bs)
            if slot < len(keys) and block is not self.null_block:
                fields = (stored_event_fields(request, keys, slot, slot + 1, bs)
                          if self.block_pool.enable_kv_cache_events else {})
                self.block_pool.cache_full_blocks([block], [keys[slot]], self.kv_cache_group_id, **fields)

    def _num_dead_slots(self, st: RequestBlocks, num_processed_tokens: int) -> int:
        """Slots below ``(n - 1) // bs`` (only the last state matters), plus: the state of a
        verified step lives in its running slot, which its drafts may have pushed past
        ``(n - 1) // bs``; once that state is processed, every slot below it is dead too.
        Block 2, nspec 3, after 1 computed token a step of 1 + 2 drafts runs at slot 1; with 0
        accepted its state is at 2 tokens, so retiring to 2 frees slot 0 (the first rule frees
        ``(2 - 1) // 2 = 0`` slots: the request would hold 6 blocks, not 2 + 3, after its next
        step).

        Raises InvalidTokenCountError (nothing changed) if that would retire the running slot:
        processed tokens beyond the running state's boundary were never scheduled, and
        retiring them would free the running and scratch blocks."""
        num_slots = (num_processed_tokens - self.num_kept_tokens) // self.block_size
        verified = st.verified  # type: ignore[attr-defined]
        num_settled = 0
        for position, slot in verified:
            if position > num_processed_tokens:
                break
            num_settled += 1
            if slot > num_slots:
                num_slots = slot
        running = st.running_slot  # type: ignore[attr-defined]
        if 0 <= running < num_slots:
            raise InvalidTokenCountError(
                f"retiring {num_slots} slots would free the running state at slot {running}: more tokens "
                f"processed than were ever scheduled (at most {(running + 1) * self.block_size})")
        for _ in range(num_settled):
            verified.popleft()
        return num_slots

    def free(self, request_id: str) -> None:
        """Drop the request (see the base class), and its pending entries of the copy and
        zero plans: a preempted request's copy must not run into a block that is reused."""
        st = self._reqs.get(request_id)
        if st is not None and (self._copy_plan or self._zero_plan):
            ids = {b.block_id for b in st.blocks if not b.is_null}
            self._copy_plan = [p for p in self._copy_plan if p[1] not in ids]
            self._zero_plan = [b for b in self._zero_plan if b not in ids]
        super().free(request_id)

    # ------------------------------------------------------------------ helpers
    def get_state_block_ids(self, request_id: str) -> list[int]:
        """Block ids of the request's real states (last + running), scratch excluded: what
        an engine saves or offloads for the request."""
        st = self._reqs.get(request_id)
        if st is None:
            return []
        end = st.running_slot + 1 if st.running_slot >= 0 else len(st.blocks)
        return [b.block_id for b in st.blocks[:end] if not b.is_null]

    def num_held_blocks(self, request_id: str) -> int:
        """Non-null blocks in the request's table."""
        st = self._reqs.get(request_id)
        return 0 if st is None else sum(1 for b in st.blocks if not b.is_null)

    @classmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The rightmost cached state whose end is aligned: ``[null, ..., null, state]``."""
        if getattr(kv_cache_spec, "mode", None) is MambaCacheMode.NONE:
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
        for rid, st in self._reqs.items():
            if st.running_slot < 0:
                continue
            r = st.running_slot
            assert r < len(st.blocks) and st.blocks[r] is not null, f"{rid}: running slot {r} null"
            for b in st.blocks[r + 1 :]:
                assert b is not null and b.ref_cnt == 1 and b.block_hash is None, f"{rid}: bad scratch {b}"
            assert all(0 <= s < len(st.blocks) for s in st.positions), f"{rid}: tag outside table"
