"""Decode checkpoints of an align-mode Mamba group: ``MambaSpec.decode_checkpoints`` (issue 16).

A request is in decode once its whole prompt is computed before the step (the coordinator
passes ``decode=True``; never judged by the size of a step). Prefill is the same in every
policy. In decode:

=========  =====================================================================================
every      eager align (``mamba_steps.py``): a new block per boundary, copy last -> running;
           each settled boundary state in its own block is published (today's behaviour)
latest     the running block advances in place (case ADVANCE); near a boundary a *spare* block,
           only if one is free without eviction, receives the boundary state; published once
           the crossing is settled, then released to the prefix cache (LRU tail)
none       the running block advances in place; no decode-boundary state is ever published
=========  =====================================================================================

``latest`` in one picture (block 64, 3 drafts, ``0`` null, R running, S scratch, P spare)::

    settled 600          [0 .. 0 R S S S]          outside the window: R + scratch, as every
    step may reach 640   [0 .. 0 R S S S P]        P taken (never evicting); target (P, 640)
    crossed, settled     [0 .. 0 0 R S S S]        P hashed under 640's key, freed (cached);
                                                   the request's previous checkpoint is evicted

Rules (B = the next boundary above a lower bound of the step's start):

* plan (``plan_checkpoint_write``, after every group's mandatory blocks): if the step's
  planned main tokens reach B (the forward may compute the state at B: exact under
  synchronous scheduling, an upper bound under async, where the planned count is optimistic),
  take a spare if there is none (``BlockPool.get_new_unhashed_block``; ``spare_may_evict``
  lets it evict, a benchmark knob) and record the write target ``(spare, B)``. The window is
  therefore ``B - settled <= (1 + steps in flight) x (nspec + 1)``: ``nspec + 1`` synchronous,
  ``2 (nspec + 1)`` at async lag 1 (issue 16's window), no earlier than a step can write B.
  No spare free -> B is not tracked. The spare serves one boundary at a time: while a step
  in flight targets B, a later step that could reach only the next boundary gets no target
  (block sizes below ``(1 + lag) x (nspec + 1)`` lose such boundaries, nothing worse).
* resolve (``accept_drafts`` for a step with drafts, ``retire`` otherwise), in order: the
  step that computed B and settled at or past it crossed into the spare (it holds B). Not
  crossed: the spare is kept (a later step rewrites B).
* publish (``retire``): a crossed spare whose position is processed and that no unresolved
  step lists as its write target is hashed under B's key and freed.
* finish (``free``): the spare is freed unhashed, whatever it holds.

Pinned blocks per running request (block 64, sync, 1 token per step; test_pinned_blocks.py)::

    policy  nspec  outside a window   most inside     why
    every   0      1                  2               + last state at the crossing step
    every   3      4                  5               + last state at the crossing step
    latest  0      1                  2               + spare
    latest  3      4                  5               + spare
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.events import stored_event_fields
from mambakv.core.request import Request
from mambakv.groups.base import group_block_hashes
from mambakv.groups.drafts import DecodeStep, MambaTable
from mambakv.groups.mamba_steps import AlignStep, AlignStepsMixin

if TYPE_CHECKING:
    from mambakv.groups.mamba import MambaManager

__all__ = ["DecodeCheckpointsMixin"]


class DecodeCheckpointsMixin(AlignStepsMixin):
    """The ``latest`` / ``none`` decode half of MambaManager (see the module docstring)."""

    _column_managers: tuple[MambaManager, ...]
    num_speculative_blocks: int
    #: decode steps advance the running block in place (``latest`` / ``none`` in align mode)
    _decode_in_place: bool
    #: ``latest`` with caching: decode boundaries get spares
    _spares: bool
    #: take spares even by evicting a cached block (benchmark knob; default never)
    spare_may_evict: bool
    #: ``(request id, block id, position)`` the planned forwards write, since the last take
    _writes: list[tuple[str, int, int]]
    #: list every write of a planned step in ``_writes`` (a subclass may turn it off)
    _list_writes: bool

    # ------------------------------------------------------------------ planning
    def _move_running(self, t: MambaTable, running: int) -> None:
        """Case ADVANCE: move the running block, its scratch and the spare to the new running
        slot (no new block, no copy)::

            slot 7 -> 8, nspec 2:   [0 .. 0 R S S P]  ->  [0 .. 0 0 R S S P]
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
        except when it holds a boundary state that is (to be) published: the first decode step
        after a chunk that ended on a boundary grows once, as in every. The running block is
        never tagged."""
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
        if t.positions:
            t.positions.pop(t.running_slot, None)
        if self._spares:
            self._record_decode(t, num_tokens, drafts, num_computed)
        t.in_decode = True
        return out

    def _record_decode(self, t: MambaTable, num_tokens: int, drafts: int, num_computed: int) -> None:
        """Remember a ``latest`` decode step (its start is exact when nothing is in flight)."""
        real = max(1, num_tokens - drafts - num_computed)
        if not t.decode_steps:
            t.settled = max(t.settled, num_computed) if t.in_decode else num_computed
            start = lb = num_computed
        else:
            prev = t.decode_steps[-1]
            start, lb = -1, prev.lb + prev.real
        t.decode_steps.append(DecodeStep(drafts, real, start, lb, num_tokens))

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
        """``latest``: the window check of the request's latest planned step (module
        docstring); a no-op otherwise. The coordinator calls it after every group's mandatory
        blocks, so a spare only takes a block nobody counted on."""
        t = self._tables.get(request_id)
        if t is None or not self._spares or not t.decode_steps:
            return
        step = t.decode_steps[-1]
        if step.boundary or t.spare_pos:
            return  # planned already, or the spare holds a crossing waiting to be published
        bs = self.block_size
        boundary = (step.lb // bs + 1) * bs
        if boundary > step.end or any(s.boundary not in (0, boundary) for s in t.decode_steps):
            return  # out of reach, or the spare serves an earlier boundary of a step in flight
        if not t.has_spare and not self._take_spare(t):
            return
        step.boundary = boundary
        for col, m in zip(t.columns, self._column_managers):
            m._writes.append((request_id, col[-1].block_id, boundary))

    def _take_spare(self, t: MambaTable) -> bool:
        """One spare per column, all or none; never evicting unless ``spare_may_evict``."""
        pool, got = self.block_pool, list[KVCacheBlock]()
        for _ in t.columns:
            if self.spare_may_evict:
                block = pool.get_new_blocks(1)[0] if pool.get_num_free_blocks() else None
            else:
                block = pool.get_new_unhashed_block()
            if block is None:
                if got:
                    pool.free_blocks(got)
                return False
            got.append(block)
        for col, block in zip(t.columns, got):
            col.append(block)
        t.has_spare = True
        return True

    def take_checkpoint_writes(self) -> list[tuple[str, int, int]]:
        """``(request id, block id, position)`` for each block a planned forward writes, since
        the last call: running block, scratch blocks, and (``latest``) the spare, which
        receives the state at `position` if the step computes that position (drafts
        included). Quiet steps (no drafts, strictly inside the running block, outside any
        crossing window) are not listed: they only advance the running block in place."""
        out, self._writes = self._writes, []
        return out

    def drop_checkpoint_writes(self) -> None:
        """Forget the writes not taken (the coordinator's ``new_step`` calls it)."""
        if self._writes:
            self._writes = []

    # ------------------------------------------------------------------ results
    def _resolve_step(self, t: MambaTable, step: DecodeStep, num_accepted: int) -> None:
        """The step settled: it crossed into the spare iff it computed its target boundary
        and ended at or past it."""
        start = step.start if step.start >= 0 else t.settled
        end = start + step.real + num_accepted
        t.settled = end
        b = step.boundary
        if b and start < b <= end:
            t.spare_pos = b

    def _resolve_verify(self, t: MambaTable, num_accepted: int) -> None:
        """``accept_drafts`` of the oldest step with drafts: earlier steps without drafts
        settled first (their results came before this verify)."""
        steps = t.decode_steps
        while steps and not steps[0].drafts:
            self._resolve_step(t, steps.popleft(), 0)
        if steps:
            self._resolve_step(t, steps.popleft(), num_accepted)

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

    def _publish_spare(self, request: Request, t: MambaTable, num_processed_tokens: int) -> None:
        """A crossed spare, processed and no unresolved step's write target: hash it under
        its boundary's key and free it (it lands at the LRU tail, cached). The request's
        previous decode checkpoint, if free, becomes evict-first: a deeper state on its chain exists."""
        b = t.spare_pos
        if not b or b > num_processed_tokens or any(s.boundary for s in t.decode_steps):
            return
        bs = self.block_size
        slot = b // bs - 1
        keys = group_block_hashes(request, bs)
        if slot >= len(keys):
            return
        pool = self.block_pool
        fields = stored_event_fields(request, keys, slot, slot + 1, bs) if pool.enable_kv_cache_events else {}
        spares: list[KVCacheBlock] = []
        for col, m in zip(t.columns, self._column_managers):
            spare = col.pop()
            pool.cache_full_blocks([spare], [keys[slot]], m.kv_cache_group_id, **fields)
            spares.append(spare)
        pool.free_blocks(spares)
        old = [blk for blk, key in t.ckpts if blk.block_hash == key and blk.ref_cnt == 0]
        if old:
            self._evict_first(old)
        t.ckpts = [(blk, keys[slot]) for blk in spares]
        t.has_spare, t.spare_pos = False, 0

    def _evict_first(self, blocks: list[KVCacheBlock]) -> None:
        """Move free cached `blocks` to the head of the cached part of the free queue (right
        after the unhashed free blocks, which the pool keeps first): the next eviction takes
        them, a hit may still revive them. O(unhashed free blocks): once per published decode
        checkpoint.

            queue  u1 u2 | h1 h2 OLD h3    ->    u1 u2 | OLD h1 h2 h3
        """
        q = self.block_pool.free_block_queue
        head, tail = q.sentinels
        for b in blocks:
            q.remove(b)
        node = head.next_free_block
        while node is not tail and node is not None and node.block_hash is None:
            node = node.next_free_block
        assert node is not None and node.prev_free_block is not None
        q._link_run(node.prev_free_block, blocks, node)  # the queue's own O(1) splice

    def decode_event(self, t: MambaTable) -> int:
        """The next processed count at which ``retire`` must reach this group: while a decode
        step is unresolved or a crossing waits, the next token."""
        return t.settled + 1 if t.decode_steps or t.spare_pos else 1 << 62

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
