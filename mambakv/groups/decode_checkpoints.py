"""Decode checkpoints of an align-mode Mamba group (``MambaSpec.decode_checkpoints``, issue 16): the
three policies, as objects a :class:`~mambakv.groups.mamba.MambaManager` holds.

A request is in decode once its whole prompt is computed before the step (the coordinator
passes ``decode=True``; never judged by the size of a step). Prefill is the same in every
policy. In decode:

=========  =====================================================================================
every      eager align (the AlignStep cases of prefill): a new block per boundary, copy last ->
           running; each settled boundary state in its own block is published
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

Rules (``LatestDecodeCheckpoints.on_verify``; a step's start is exact once the steps before it
settled):

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
  every rule): published at the retire of B, the next step grows.

Pinned blocks per running request, per planned step (block 64, 500-token prompt, 0 accepted,
B = 640; tests/lazy/test_pinned_blocks.py, where the settled counts at planning are listed)::

    policy  nspec  sync            async lag 1       why
    every   0      1, 2 at 1 step  1, 2 at 2 steps   the step after 640 grows (+ 640's block)
    latest  0      the same        the same          tagged and grown as every
    every   3      4, 5 at 1 step  4, 5 at 5 steps   + the last state from the step that grows
                                                     until retire frees it
    latest  3      4               4                 advances in place; C only between a
                                                     verify and its retire (then 5)

The manager calls a policy only for requests in decode (``MambaTable.in_decode``) or with
``latest``'s bookkeeping pending (``decode_steps``, ``spare_pos``); every policy keeps the
table's shape ``[0 .. R S*nspec (C)]`` that ``MambaManager.check_invariants`` asserts.
"""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.engine_request import EngineRequest
from mambakv.core.events import stored_event_fields
from mambakv.core.modes import DecodeCheckpoints
from mambakv.groups.base import NEVER, group_block_hashes
from mambakv.groups.mamba_table import DecodeStep, MambaTable

__all__ = ["DecodeCheckpointPolicy", "LatestDecodeCheckpoints", "NoDecodeCheckpoints", "make_decode_policy"]


def make_decode_policy(mode: DecodeCheckpoints, *, align: bool, caching: bool, block_pool: BlockPool,
                       block_size: int) -> DecodeCheckpointPolicy:
    """The policy object of a Mamba group: ``every`` outside align mode (nothing is in decode
    there), ``none`` for ``latest`` without prefix caching (nothing to publish)."""
    if not align or mode is DecodeCheckpoints.EVERY:
        return DecodeCheckpointPolicy(block_pool, block_size)
    if mode is DecodeCheckpoints.LATEST and caching:
        return LatestDecodeCheckpoints(block_pool, block_size)
    return NoDecodeCheckpoints(block_pool, block_size)


class DecodeCheckpointPolicy:
    """``every``, and the contract of a decode-checkpoint policy (a no-op hook means "nothing
    beyond the align-mode cases"). The manager calls a hook only for a table in decode, or with
    ``latest``'s bookkeeping pending.

    Args:
        block_pool: the group's pool (checkpoint blocks come from it).
        block_size: the group's block size.

    Attributes:
        name: the :class:`~mambakv.core.modes.DecodeCheckpoints` value.
        in_place: decode steps advance the running block in place (case ADVANCE) instead of
            taking a block per boundary.
        keeps_tags: a decode step without drafts that ends on a boundary keeps its tag (and
            is published at its retire); False: decode tags are dropped.
        spare_may_evict: ``latest`` may evict a cached block for a checkpoint (a benchmark
            knob; the default never does).
    """

    name = DecodeCheckpoints.EVERY
    in_place = False
    keeps_tags = True

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.spare_may_evict = False

    def after_plan(self, t: MambaTable, num_tokens: int, num_drafts: int, num_computed: int) -> None:
        """A decode step was planned (its case recorded by the manager)."""

    def quiet(self, t: MambaTable, covered: int) -> int:
        """The quiet threshold of a table in decode whose running slot covers `covered` tokens:
        a step strictly inside the running block only advances it."""
        return covered - 1

    def on_verify(self, t: MambaTable, num_accepted: int,
                  copies: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
        """``accept_drafts`` of a decode step with drafts: `copies` (per column, accepted scratch
        -> running block) plus what the policy adds."""
        return copies

    def next_event(self, t: MambaTable) -> int:
        """The next processed count at which ``retire`` must reach the table for this policy."""
        return NEVER

    def on_retire(self, request: EngineRequest, t: MambaTable, group_ids: Sequence[int], num_processed_tokens: int) -> None:
        """``cache_blocks`` of a table with the policy's bookkeeping pending (`group_ids`: the
        groups of the table's columns)."""

    def settle(self, t: MambaTable, num_processed_tokens: int) -> None:
        """After retirement: forget what `num_processed_tokens` settled."""

    def on_free(self) -> None:
        """A request of the manager was freed (a step of it may still be in flight)."""

    def note_checkpoint(self, t: MambaTable, blocks: list[KVCacheBlock], key: bytes) -> None:
        """`blocks` (one per column) were published under `key` while the request is in decode:
        the request's previous decode checkpoint, if free and still cached, becomes evict-first
        (a deeper state on its chain exists; ``BlockPool.evict_first``)."""
        old = [blk for blk, k in t.ckpts if blk.block_hash == k and blk.ref_cnt == 0]
        if old:
            self.block_pool.evict_first(old)
        t.ckpts = [(blk, key) for blk in blocks]


class NoDecodeCheckpoints(DecodeCheckpointPolicy):
    """``none``: the running block advances in place; a decode step's tag is dropped."""

    name = DecodeCheckpoints.NONE
    in_place = True
    keeps_tags = False

    def after_plan(self, t: MambaTable, num_tokens: int, num_drafts: int, num_computed: int) -> None:
        if t.positions:
            t.positions.pop(t.running_slot, None)  # no decode-boundary state


class LatestDecodeCheckpoints(DecodeCheckpointPolicy):
    """``latest``: see the module docstring.

    Attributes:
        num_planned: decode steps planned so far (``DecodeStep.seq``).
        freed_at: ``num_planned`` at the last ``free`` of the manager's requests.
    """

    name = DecodeCheckpoints.LATEST
    in_place = True

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        super().__init__(block_pool, block_size)
        self.num_planned = 0
        self.freed_at = 0

    # ------------------------------------------------------------------ planning
    def after_plan(self, t: MambaTable, num_tokens: int, num_drafts: int, num_computed: int) -> None:
        """Remember the step (its start is exact when nothing of the request is in flight)."""
        real = max(1, num_tokens - num_drafts - num_computed)
        if not t.decode_steps:
            t.settled = max(t.settled, num_computed) if t.in_decode else num_computed
            start = num_computed
        else:
            start = -1
        self.num_planned += 1
        t.decode_steps.append(DecodeStep(num_drafts, real, start, self.num_planned))

    def quiet(self, t: MambaTable, covered: int) -> int:
        """Below the running slot's end and below the next boundary (a step that may reach it is
        planned, to get its target); none while a step is unresolved."""
        if t.decode_steps:
            return 0
        bs = self.block_size
        b = (t.settled // bs + 1) * bs
        return min(covered, b) - 1

    def next_event(self, t: MambaTable) -> int:
        """A waiting checkpoint's boundary; while a decode step is unresolved, the next token."""
        if t.spare_pos:
            return t.spare_pos
        return t.settled + 1 if t.decode_steps else NEVER

    def on_free(self) -> None:
        self.freed_at = self.num_planned

    # ------------------------------------------------------------------ results
    @staticmethod
    def _resolve_step(t: MambaTable, step: DecodeStep, num_accepted: int) -> int:
        """The step settled at ``start + real + accepted``; returns its start."""
        start = step.start if step.start >= 0 else t.settled
        t.settled = start + step.real + num_accepted
        return start

    def on_verify(self, t: MambaTable, num_accepted: int,
                  copies: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
        """The oldest step with drafts is verified (earlier steps without drafts settled first:
        their results came before this verify); when it crossed a boundary B, add the copy-out
        of B's state into a checkpoint block C taken now (free without eviction; none: B is not
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
        if not steps:
            return copies
        r, a = t.running_slot, num_accepted
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
        got = self._take_checkpoint_blocks(t, fresh=self.freed_at < step.seq)
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

    def _take_checkpoint_blocks(self, t: MambaTable, *, fresh: bool) -> list[KVCacheBlock] | None:
        """One block per column, all or none: if `fresh`, a block free without eviction (any
        free block with ``spare_may_evict``); else, or when none is free, the request's own
        previous decode checkpoint if it is free and still cached under its key (the state
        about to be published supersedes it on the same chain). Nobody else's cached state is
        evicted.

        A recycled block is safe whatever was freed meanwhile: a cached block is written by
        no step (a hit only reads it, and holds it while it may: ref count > 0), and an
        unchanged hash proves it was not evicted and reused since."""
        pool = self.block_pool
        got = list[KVCacheBlock]()
        if fresh:
            for _ in t.columns:
                if self.spare_may_evict:
                    block = pool.get_new_blocks(1)[0] if pool.get_num_free_blocks() else None
                else:
                    block = pool.get_new_unhashed_block()
                if block is None:
                    break
                got.append(block)
            if len(got) == len(t.columns):
                return got
            if got:
                pool.free_blocks(got)
        old = [blk for blk, key in t.ckpts if blk.block_hash == key and blk.ref_cnt == 0]
        if not old or len(old) != len(t.columns):
            return None
        pool.evict_blocks([b.block_id for b in old])  # unhashed now (free, at the queue's head)
        pool.touch(old)  # taken: ref count 1
        t.ckpts = []
        return old

    def settle(self, t: MambaTable, num_processed_tokens: int) -> None:
        """Leading steps without drafts that the processed count covers settle."""
        steps = t.decode_steps
        while steps and not steps[0].drafts:
            s = steps[0]
            if (s.start if s.start >= 0 else t.settled) + s.real > num_processed_tokens:
                break
            self._resolve_step(t, steps.popleft(), 0)
        if not steps and num_processed_tokens > t.settled:
            t.settled = num_processed_tokens

    def on_retire(self, request: EngineRequest, t: MambaTable, group_ids: Sequence[int], num_processed_tokens: int) -> None:
        """Settle the decode steps the processed count covers, then publish a waiting checkpoint
        whose boundary is processed: hash it under the boundary's key and free it (it lands at
        the LRU tail, cached)."""
        self.settle(t, num_processed_tokens)
        b = t.spare_pos
        if not b or b > num_processed_tokens:
            return
        bs = self.block_size
        slot = b // bs - 1
        keys = group_block_hashes(request, bs)
        if slot >= len(keys):
            return
        pool = self.block_pool
        fields = stored_event_fields(request, keys, slot, slot + 1, bs) if pool.enable_kv_cache_events else {}
        spares: list[KVCacheBlock] = []
        for col, gid in zip(t.columns, group_ids):
            spare = col.pop()
            pool.cache_full_blocks([spare], [keys[slot]], gid, **fields)
            spares.append(spare)
        pool.free_blocks(spares)
        self.note_checkpoint(t, spares, keys[slot])
        t.has_spare, t.spare_pos = False, 0
