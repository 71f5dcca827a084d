"""Decode checkpoints of an align-mode Mamba group: ``MambaSpec.decode_checkpoints`` (issue 16).

A request is in decode once its whole prompt is computed before the step (the coordinator
passes ``decode=True``; never judged by the size of a step). Prefill is the same in every
policy. In decode:

=========  =====================================================================================
every      eager align (``mamba_steps.py``): a new block per boundary, copy last -> running;
           each settled boundary state in its own block is published (today's behaviour)
latest     the running block advances in place (case ADVANCE); when a verified step crossed a
           boundary, its state is copied out of the running / scratch block that holds it into
           a block free without eviction (or the request's own superseded checkpoint),
           published at the next retire (LRU tail); a step without drafts that ends exactly
           on a boundary is tagged and grows, as in every
none       the running block advances in place; no decode-boundary state is ever published
=========  =====================================================================================

``latest`` in one picture (block 64, 3 drafts, ``0`` null, R running, S scratch, C checkpoint)::

    planned from 637     [0 .. 0 0 R S S S]        R: 638, S: 639 640 641 (every grows here: 5)
    verify, 3 accepted   [0 .. 0 0 R S S S C]      copies S3 -> R, S2 -> C (C free: never evicting)
    retire 641           [0 .. 0 0 R S S S]        C hashed under 640's key, freed (cached); the
                                                   request's previous checkpoint is evict-first

Rules (``_decode_verify``; a step's start is exact once the steps before it settled):

* plan: nothing beyond running + scratch; a forward writes only those (``take_checkpoint_writes``).
* verify (``accept_drafts``): the step from ``start`` settled at ``end``; B, the highest
  boundary in ``(start, end]``, is the state of the running block (B = start + 1) or of
  scratch block ``B - start - 1``. Take C (``BlockPool.get_new_unhashed_block``;
  ``spare_may_evict`` lets it evict, a benchmark knob; with no block free, the request's own
  previous decode checkpoint if it is free and still cached: B supersedes it on its chain,
  nobody else's state is evicted) and return the copy ``X -> C`` with ``scratch a -> R``.
  That copy runs after this step's forward and before any later step's pre-forward copies,
  so the state reaches C before a step in flight overwrites ``X``, and no forward writes C.
  Not tracked: no C (no free block, no own checkpoint to recycle); B is R's state and drafts
  were accepted (the copy ``scratch a -> R`` overwrites it; a chain is not a plan) while a
  later step is planned (it writes R; with none, C simply becomes the running block and R the
  checkpoint). After a ``free`` since the step was planned only the recycled checkpoint may be
  C (the freed request may have a step in flight that still writes its blocks, and unhashed
  free blocks are reused first).
* publish (``retire``): C, once B is processed, is hashed under B's key and freed.
* finish (``free``): a C not yet published is freed unhashed (it is no step's write target).
* nspec 0 / steps without drafts (no verify): a step that ends exactly on B tags R (the
  every rule, ``_record_step``): published at the retire of B, the next step grows.

Pinned blocks per running request, per planned step (block 64, 500-token prompt, 0 accepted,
B = 640; test_pinned_blocks.py, where the settled counts at planning are listed)::

    policy  nspec  sync            async lag 1       why
    every   0      1, 2 at 1 step  1, 2 at 2 steps   the step after 640 grows (+ 640's block)
    latest  0      the same        the same          tagged and grown as every
    every   3      4, 5 at 1 step  4, 5 at 5 steps   + the last state from the step that grows
                                                     until retire frees it
    latest  3      4               4                 advances in place; C only between a
                                                     verify and its retire (then 5)

The checkpoint blocks themselves (take C, publish it at retire, evict-first) are
``mamba_checkpoints.py``.

(Before: latest took a spare as soon as a step could reach B and held it until the crossing
settled. nspec 0: 2 at 1 step sync / 2 steps lag 1, but one step before every's; nspec 3: 5
at 4 steps sync / 8 steps lag 1.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.groups.drafts import DecodeStep, MambaTable
from mambakv.groups.mamba_checkpoints import CheckpointBlocksMixin
from mambakv.groups.mamba_steps import AlignStep, AlignStepsMixin

if TYPE_CHECKING:
    from mambakv.groups.mamba import MambaManager

__all__ = ["DecodeCheckpointsMixin"]


class DecodeCheckpointsMixin(AlignStepsMixin, CheckpointBlocksMixin):
    """The ``latest`` / ``none`` decode half of MambaManager (see the module docstring)."""

    _column_managers: tuple[MambaManager, ...]
    num_speculative_blocks: int
    #: decode steps advance the running block in place (``latest`` / ``none`` in align mode)
    _decode_in_place: bool
    #: ``latest`` with caching: crossed decode boundaries are copied out and published
    _spares: bool
    #: ``(request id, block id, position)`` the planned forwards write, since the last take
    _writes: list[tuple[str, int, int]]
    #: list every write of a planned step in ``_writes`` (a subclass may turn it off)
    _list_writes: bool
    #: ``latest`` decode steps planned so far, and that count at the last ``free``
    _num_planned: int
    _freed_at: int

    # ------------------------------------------------------------------ planning
    def _move_running(self, t: MambaTable, running: int) -> None:
        """Case ADVANCE: move the running block and its scratch (and a checkpoint C still
        waiting for its retire) to the new running slot (no new block, no copy)::

            slot 7 -> 8, nspec 2:   [0 .. 0 R S S]  ->  [0 .. 0 0 R S S]
        """
        old, null = t.running_slot, self.null_block
        for col in t.columns:
            tail = col[old:]
            del col[old:]
            col.extend([null] * (running - old))
            col.extend(tail)

    def _decode_columns(self, request_id: str, t: MambaTable, num_tokens: int, drafts: int,
                        num_computed: int) -> list[list[KVCacheBlock]]:
        """A decode step under latest / none: the running block advances in place (ADVANCE),
        except when it holds a boundary state that is (to be) published: the step after a
        chunk that ended on a boundary, or (``latest``) after a step without drafts that ended
        exactly on one (tagged as in every), grows once, as in every."""
        running = -(num_tokens // -self.block_size) - 1
        r = t.running_slot
        if r < 0:
            out = self._start(t, running, num_tokens, drafts)
        elif running > r and (r in t.positions or t.blocks[r].block_hash is not None):
            out = self._grow(t, running, num_tokens, drafts)
        else:
            out = self._no_new
            case = AlignStep.IN_PLACE
            if running > r:
                self._move_running(t, running)
                case = AlignStep.ADVANCE
            elif running < r:
                case, running = AlignStep.BEHIND, r
            self._check_writable(request_id, t, running, num_tokens)
            self._record_step(t, running, num_tokens, drafts, case)
        if t.positions and not self._spares:
            t.positions.pop(t.running_slot, None)  # none: no decode-boundary state
        if self._spares:
            self._record_decode(t, num_tokens, drafts, num_computed)
        t.in_decode = True
        return out

    def _record_decode(self, t: MambaTable, num_tokens: int, drafts: int, num_computed: int) -> None:
        """Remember a ``latest`` decode step (its start is exact when nothing is in flight)."""
        real = max(1, num_tokens - drafts - num_computed)
        if not t.decode_steps:
            t.settled = max(t.settled, num_computed) if t.in_decode else num_computed
            start = num_computed
        else:
            start = -1
        self._num_planned += 1
        t.decode_steps.append(DecodeStep(drafts, real, start, self._num_planned))

    def _list_step_writes(self, request_id: str, t: MambaTable, num_tokens: int, drafts: int) -> None:
        """The running block holds position ``num_tokens - drafts`` after the forward, scratch
        block k position ``num_tokens - drafts + k + 1`` (planned counts: exact under synchronous
        scheduling, optimistic under async)."""
        r, real_end = t.running_slot, num_tokens - drafts
        for col, m in zip(t.columns, self._column_managers):
            w = m._writes
            w.append((request_id, col[r].block_id, real_end))
            for k in range(drafts):
                w.append((request_id, col[r + 1 + k].block_id, real_end + k + 1))

    def plan_checkpoint_write(self, request_id: str) -> None:
        """A no-op, kept for callers (the coordinator calls it after every group's mandatory
        blocks): ``latest`` takes no block when a step is planned; a crossed boundary's state is
        copied out at its verify (``_decode_verify``), so a forward writes only the running and
        scratch blocks."""

    def take_checkpoint_writes(self) -> list[tuple[str, int, int]]:
        """``(request id, block id, position)`` for each block a planned forward writes, since
        the last call: the running block and the scratch blocks (``latest`` adds none: its
        checkpoint is a copy made at verify). Quiet steps (no drafts, strictly inside the
        running block, below the next boundary under ``latest``) are not listed: they only
        advance the running block in place."""
        out, self._writes = self._writes, []
        return out

    def drop_checkpoint_writes(self) -> None:
        """Forget the writes not taken (the coordinator's ``new_step`` calls it)."""
        if self._writes:
            self._writes = []

    # ------------------------------------------------------------------ results
    def _resolve_step(self, t: MambaTable, step: DecodeStep, num_accepted: int) -> int:
        """The step settled at ``start + real + accepted``; returns its start."""
        start = step.start if step.start >= 0 else t.settled
        t.settled = start + step.real + num_accepted
        return start

    def _decode_verify(self, t: MambaTable, num_accepted: int) -> list[list[tuple[int, int]]]:
        """``accept_drafts`` of the oldest step with drafts (earlier steps without drafts
        settled first: their results came before this verify): the copy scratch ``a`` ->
        running, and under ``latest``, when the step crossed a boundary B, the copy-out of B's
        state into a checkpoint block C taken now (free without eviction; none: B is not
        tracked). Block 64, 3 drafts, the step from 637 (R: 638, S1: 639, S2: 640, S3: 641)::

            a = 2:  copies  S2 -> R, S2 -> C      C waits at the table's end, published at retire
            a = 0:  settled 638 < 640: no crossing, no block taken
            from 639, a = 0:   R holds 640:       R -> C
            from 639, a = 2:   R holds 640, but S2 -> R overwrites it (a chain R -> C -> ..
                               is not a plan): with no later step planned, C takes R's place as
                               the running block (copy S2 -> C) and R is the checkpoint; with a
                               step in flight (it writes R) 640 is not tracked

        C is written only by that copy, which runs after this step's forward and before any
        later step's pre-forward copies (engine-integration.md): no forward ever writes it,
        and nothing may read it before it is published."""
        steps, bs = t.decode_steps, self.block_size
        while steps and not steps[0].drafts:
            self._resolve_step(t, steps.popleft(), 0)
        r, a = t.running_slot, num_accepted
        copies = [[(col[r + a].block_id, col[r].block_id)] if a else [] for col in t.columns]
        if not steps:
            return copies  # none (no steps recorded)
        step = steps.popleft()
        start = self._resolve_step(t, step, a)
        b = t.settled // bs * bs  # the highest boundary the step settled at or past
        i = b - start - step.real  # B's state: 0 the running block, k scratch block k
        if b <= start or i < 0 or t.spare_pos:
            return copies  # no crossing (or not on a kept state), or a checkpoint still waiting
        swap = i == 0 and a > 0
        if swap and (steps or t.verify_steps):
            return copies  # a later step writes R
        # After a free since this step was planned, a free block may still be written by a
        # step of the freed request in flight: only the request's own old checkpoint is safe.
        got = self._take_checkpoint_blocks(t, fresh=self._freed_at < step.seq)
        if got is None:
            return copies
        for col, pairs, c in zip(t.columns, copies, got):
            if swap:  # C is the new running block, R (holding B) the checkpoint
                pairs[0] = (pairs[0][0], c.block_id)
                col[r], c = c, col[r]
            else:
                pairs.append((col[r + i].block_id, c.block_id))
            col.append(c)
        t.has_spare, t.spare_pos = True, b
        return copies

    def _settle_decode(self, t: MambaTable, num_processed_tokens: int) -> None:
        """``retire``: leading steps without drafts that the processed count covers settle."""
        steps = t.decode_steps
        while steps and not steps[0].drafts:
            s = steps[0]
            if (s.start if s.start >= 0 else t.settled) + s.real > num_processed_tokens:
                break
            self._resolve_step(t, steps.popleft(), 0)
        if not steps and num_processed_tokens > t.settled:
            t.settled = num_processed_tokens

    def decode_event(self, t: MambaTable) -> int:
        """The next processed count at which ``retire`` must reach this group: a waiting
        checkpoint's boundary; while a decode step is unresolved, the next token."""
        if t.spare_pos:
            return t.spare_pos
        return t.settled + 1 if t.decode_steps else 1 << 62

    def decode_quiet(self, t: MambaTable, covered: int) -> int:
        """Quiet threshold in decode: below the running slot's end and, for ``latest``, below
        the next boundary (a step that may reach it is planned, to get its target); none
        while a step is unresolved."""
        if not self._spares:
            return covered - 1
        if t.decode_steps:
            return 0
        b = (t.settled // self.block_size + 1) * self.block_size
        return min(covered, b) - 1
