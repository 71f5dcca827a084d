"""Speculative decoding in a Mamba group: verify steps, ``accept_drafts``, and the retirement
rule for states that drafts pushed above their slot (DESIGN.md 5.1, spec decode).

A verify step schedules 1 real token + D drafts; the running block and the D scratch blocks
after it receive the states after each position. Only ``accept_drafts(a)`` says which one is
real::

    slots  [.. R  S1 S2 S3]      step: 1 + 3 drafts, running slot R
    a = 2: copy S2 -> R          the state after draft 2 becomes the running state
    a = 0: no copy               R already holds the state after the real token

Until ``accept_drafts`` the step's results are unknown, so a ``retire`` that claims tokens of
that step processed raises :class:`~mambakv.core.errors.InvalidDraftCountError` (under async
scheduling a derived draft count that counts placeholders as drafts fails here, loudly).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import InvalidDraftCountError, InvalidRequestError, InvalidTokenCountError, as_count
from mambakv.groups.base import BlockTable, SingleTypeKVCacheManager

if TYPE_CHECKING:
    from mambakv.groups.mamba import AlignStep


class DecodeStep:
    """One planned decode step of the ``latest`` policy (``mambakv/groups/mamba_decode.py``).

    Attributes:
        drafts: draft tokens of the step (0: it settles at ``retire``, else at ``accept_drafts``).
        real: its real tokens (1 for a decode step).
        start: the position it starts from, when known at planning (no earlier step of the
            request unresolved); -1: the end of the previous step (known once that one settled).
        seq: the manager's count of planned decode steps when this one was planned (a free
            since then may have put a block a step in flight still writes back in the pool).
    """

    __slots__ = ("drafts", "real", "start", "seq")

    def __init__(self, drafts: int, real: int, start: int, seq: int) -> None:
        self.drafts, self.real, self.start, self.seq = drafts, real, start, seq


class MambaTable(BlockTable):
    """Per-request state of a MambaManager.

    Attributes:
        running_slot: slot of the running state (-1 before the first allocation).
        num_tokens: the ``num_tokens`` of the last allocation (its main tokens).
        last_step: the :class:`~mambakv.groups.mamba.AlignStep` case of the last allocation.
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
            advances in place, see ``mamba_decode.py``).
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
        #: the tables of every group sharing this policy: ``columns[0] is blocks``
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


class DraftsMixin(SingleTypeKVCacheManager):
    """The spec-decode half of :class:`~mambakv.groups.mamba.MambaManager`."""

    _tables: dict[str, MambaTable]  # type: ignore[assignment]
    _align: bool
    num_speculative_blocks: int

    def accept_drafts(self, request_id: str, num_accepted: int) -> list[tuple[int, int]]:
        """After the verify of the request's oldest unverified step: the copy that moves the
        state of the last accepted position into the running block.

        Scratch block k (slot ``running + 1 + k``) holds the state after draft ``k + 1``; with
        0 accepted the running block already holds the right state (no copy).

        Raises (nothing changed):
            InvalidDraftCountError: `num_accepted` outside ``0 .. drafts of that step``, or not
                an int.
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
            t.verified.append((position, slot))  # see num_dead_slots
        if t.in_decode:  # latest / none: the running block advances in place (mamba_decode.py)
            return self._decode_verify(t, num_accepted)
        # Tag a boundary state only if no later step was planned into this block meanwhile
        # (async scheduling): then the block keeps exactly this state.
        latest = not t.verify_steps and t.running_slot == slot and t.num_tokens == num_tokens
        if latest and self.enable_caching and position == (slot + 1) * self.block_size:
            t.positions[slot] = position
        if num_accepted == 0:
            return [[] for _ in t.columns]
        return [[(col[slot + num_accepted].block_id, col[slot].block_id)] for col in t.columns]

    def _decode_verify(self, t: MambaTable, num_accepted: int) -> list[list[tuple[int, int]]]:
        """A decode step's verify under ``latest`` / ``none`` (``mamba_decode.py``)."""
        raise NotImplementedError

    def _check_leader(self) -> None:
        """Followers are driven through their leader (the coordinator does that).

        Raises:
            InvalidRequestError: this manager follows another group's policy."""
        if self.is_follower:
            raise InvalidRequestError(
                f"group {self.kv_cache_group_id} shares the policy of another group with the same spec: "
                f"drive it through the coordinator (or build the manager alone)")

    def num_dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int:
        """Slots below ``(n - 1) // bs`` (only the last state matters), plus: the state of a
        verified step lives in its running slot, which its drafts may have pushed past
        ``(n - 1) // bs``; once that state is processed, every slot below it is dead too.
        Block 2, nspec 3, after 1 computed token a step of 1 + 2 drafts runs at slot 1; with 0
        accepted its state is at 2 tokens, so retiring to 2 frees slot 0 (the first rule frees
        ``(2 - 1) // 2 = 0`` slots: the request would hold 6 blocks, not 2 + 3, after its next
        step).

        Raises (nothing changed):
            InvalidDraftCountError: the tokens claim results of a step with drafts whose
                ``accept_drafts`` has not come (pass ``allocate(num_draft_tokens=...)`` under
                async scheduling: placeholders are not drafts).
            InvalidTokenCountError: it would retire the running slot: processed tokens beyond
                the running state's boundary were never scheduled.
        """
        t: MambaTable = table  # type: ignore[assignment]
        num_slots, num_settled = self._dead_slots(t, num_processed_tokens)
        for _ in range(num_settled):
            t.verified.popleft()
        return num_slots

    def dead_slots(self, table: BlockTable, num_processed_tokens: int) -> int:
        """See the base class: the verify and running-slot checks run in mode NONE too."""
        return self._dead_slots(table, num_processed_tokens)[0]  # type: ignore[arg-type]

    def settle(self, table: BlockTable, num_processed_tokens: int) -> None:
        """Drop the verified entries that `num_processed_tokens` passed (their slot rule was
        applied by ``dead_slots``)."""
        verified = table.verified  # type: ignore[attr-defined]
        while verified and verified[0][0] <= num_processed_tokens:
            verified.popleft()

    def _dead_slots(self, t: MambaTable, num_processed_tokens: int) -> tuple[int, int]:
        """``(dead slots, verified entries settled)``; raises as ``num_dead_slots`` says."""
        if t.verify_steps:
            _, tokens, drafts = t.verify_steps[0]
            if num_processed_tokens > tokens - drafts - 1:
                raise InvalidDraftCountError(
                    f"{num_processed_tokens} tokens processed, but the step to {tokens} tokens with {drafts} drafts "
                    f"was not verified: call accept_drafts first (or pass num_draft_tokens=0 for a step without "
                    f"drafts)")
        if not self.retires:
            return 0, 0
        num_slots = (num_processed_tokens - self.num_kept_tokens) // self.block_size
        num_settled = 0
        for position, slot in t.verified:
            if position > num_processed_tokens:
                break
            num_settled += 1
            if slot > num_slots:
                num_slots = slot
        running = t.running_slot
        if 0 <= running < num_slots:
            raise InvalidTokenCountError(
                f"retiring {num_slots} slots would free the running state at slot {running}: more tokens "
                f"processed than were ever scheduled (at most {(running + 1) * self.block_size})")
        return num_slots, num_settled

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Retire (see the base class), after the checks of ``num_dead_slots``, which run in
        mode NONE too (nothing is retired there). The common case (no verify step pending, no
        verified state above its slot) is inlined: it runs once per step of every request."""
        if num_processed_tokens < 0:
            raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
        t = self._tables.get(request_id)
        if t is None:
            return
        if self.is_follower:
            self._check_leader()
        if t.verify_steps or t.verified or not self.retires:
            num_slots = self.num_dead_slots(t, num_processed_tokens)
        else:
            num_slots = (num_processed_tokens - 1) // self.block_size  # only the last state matters
            if 0 <= t.running_slot < num_slots:
                self._dead_slots(t, num_processed_tokens)  # raises: the running state would be freed
        if num_slots > t.retired_below and self.retires:
            self.retire_slots(t, num_slots)
