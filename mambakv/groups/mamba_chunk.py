"""The running prefill chunk of an align-mode Mamba policy, fused over every block column (the
contract is :mod:`mambakv.groups.chunks`).

A chunk is case GROW without drafts: the running slot moves from `source` to `running`, each
column relocates its scratch blocks, takes one block and queues one copy (``_grow``,
``_record_step`` and ``_list_step_writes`` of the general path, in the same order)::

    block 544, nspec 2, chunk 1088 -> 3264 tokens (source 1, running 5), per column:
    before  [0 R S1 S2]                      R = running state, S = scratch
    after   [0 R 0 0 0 S1 S2 N]              slot 5 (S1) is the running block: copy R -> S1

At retire, a chunk publishes the settled boundary state and retires the slots the processed
tokens skipped (``cache_blocks`` + ``retire_slots``), with no verify or decode bookkeeping to
settle. Any other state of the table (a verify pending, verified states, decode under
``latest`` / ``none``, a table not shaped ``[.. R S*nspec]``) answers -1 / False.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.pool_fused import cache_then_free
from mambakv.core.request import Request
from mambakv.groups.drafts import MambaTable
from mambakv.groups.mamba_queries import QueriesMixin
from mambakv.groups.mamba_steps import AlignStep
from mambakv.groups.tables import BlockTable, group_block_hashes, real_slots

__all__ = ["MAMBA_CHUNK_STEPS", "MambaChunkMixin"]


#: the general path's steps the Mamba chunk path stands in for (a subclass changing one opts out)
MAMBA_CHUNK_STEPS = ("get_num_blocks_to_allocate", "count_columns", "allocate_new_blocks", "allocate_columns",
                     "_align_columns", "_grow", "_record_step", "_list_step_writes", "plan_checkpoint_write",
                     "dead_slots", "_dead_slots", "settle", "next_event", "thresholds", "cache_blocks",
                     "publish_settled", "retire_slots")


class MambaChunkMixin(QueriesMixin):
    """The Mamba half of the chunk path (see the module docstring)."""

    _list_writes: bool
    _column_ids: tuple[int, ...]

    if TYPE_CHECKING:  # MambaManager's
        def publish_settled(self, request: Request, t: MambaTable, num_tokens: int) -> None: ...

    def chunk_need(self, table: BlockTable, num_tokens: int, num_lookahead_tokens: int) -> int:
        """One block per column for a GROW chunk (lookahead never adds Mamba blocks), else -1
        (a verify pending or verified, decode bookkeeping: the general path)."""
        t: MambaTable = table  # type: ignore[assignment]
        if not self.chunks or t.verify_steps or t.verified or t.in_decode or t.decode_steps or t.spare_pos:
            return -1
        source = t.running_slot
        if 0 <= source < -(num_tokens // -self.block_size) - 1 \
                and len(t.blocks) == source + 1 + self.num_speculative_blocks:
            return len(t.columns)
        return -1

    def grow_chunk(self, request: Request, table: BlockTable, num_tokens: int, num_lookahead_tokens: int,
                   num_real: int, out: list[list[KVCacheBlock]]) -> tuple[int, int, int] | None:
        """Commit the GROW chunk ``chunk_need`` counted (see the module docstring); append each
        column's new block to `out`. Returns ``(covered, quiet, next_event)``: a GROW chunk
        leaves no verify pending and is not in decode, so ``thresholds`` is the running slot's
        boundary and one token short of it."""
        t: MambaTable = table  # type: ignore[assignment]
        bs = self.block_size
        source = t.running_slot
        running = -(num_tokens // -bs) - 1
        lo = source + 1  # the scratch blocks [lo, lo + nspec) ...
        k = min(running - lo, self.num_speculative_blocks)  # ... of which the first k now lie below the running slot
        gap = [self.null_block] * (running - lo)  # null from lo up to the running slot
        new = self.block_pool.get_new_blocks(len(t.columns))
        list_writes = self._list_writes
        rid = request.request_id
        jump = k == self.num_speculative_blocks  # every scratch block moves: the gap goes in before them
        for col, m, block in zip(t.columns, self._column_managers, new):
            if jump:
                col[lo:lo] = gap
            else:
                scratch = col[lo:]
                col[lo:] = gap + scratch[k:] + scratch[:k]  # the first k move to the end, past the gap
            col.append(block)
            block_id = col[running].block_id
            m._copy_plan.append((col[source].block_id, block_id))
            if list_writes:
                m._writes.append((rid, block_id, num_tokens))
            out.append([block])
        self._record_step(t, running, num_tokens, 0, AlignStep.GROW)
        covered = (running + 1) * bs
        nxt = (t.retired_below + 1) * bs + 1  # next_event(), inlined: a chunk's tags and watermark only
        for pos in t.positions.values():
            if pos < nxt:
                nxt = pos
        return covered, covered - 1, nxt

    def chunk_retire_ok(self, table: BlockTable, num_processed_tokens: int) -> bool:
        """No verify or decode bookkeeping pending, and the running state outlives the retire
        (else the general path raises its error)."""
        t: MambaTable = table  # type: ignore[assignment]
        if not self.chunks or t.verify_steps or t.verified or t.in_decode or t.decode_steps or t.spare_pos:
            return False
        return not 0 <= t.running_slot < (num_processed_tokens - 1) // self.block_size

    def retire_chunk(self, request: Request, table: BlockTable, num_processed_tokens: int) -> tuple[int, bool]:
        """Publish the settled boundary states, retire the skipped slots (``cache_blocks`` +
        ``retire_slots``; one pool pass, ``cache_then_free``, for a chunk's one tag). Returns
        the next event and False: in a chunk's state the thresholds follow the running slot and
        the verify state, which a retire never moves."""
        t: MambaTable = table  # type: ignore[assignment]
        bs = self.block_size
        positions = t.positions
        slot = -1  # the settled tag (a chunk has one; several: the general publication)
        several = False
        for s, p in positions.items():
            if p <= num_processed_tokens:
                several = slot >= 0
                slot = s
        states: list[KVCacheBlock] = []
        key = None
        if slot >= 0:
            if several or not self.enable_caching or self.block_pool.enable_kv_cache_events:
                self.publish_settled(request, t, num_processed_tokens)
            else:  # published below, in the same pool pass as the free
                pos = positions.pop(slot)
                keys = request.block_hashes if request.hash_block_size == bs else group_block_hashes(request, bs)
                if pos == (slot + 1) * bs and slot < len(keys):
                    key = keys[slot]
                    for col in t.columns:
                        states.append(col[slot])
        num_slots = (num_processed_tokens - 1) // bs  # only the last state matters
        low = t.retired_below
        stop = min(num_slots, len(t.blocks))
        freed: list[KVCacheBlock] = []
        real: list[int] = []
        null = self.null_block
        if stop > low:  # column 0's real slots, deepest first, in every column: as retire_slots frees them
            real = real_slots(t.blocks, low, stop, null)
            for col in t.columns:
                for i in real:
                    freed.append(col[i])
        if key is not None or freed:
            cache_then_free(self.block_pool, states, key, self._column_ids, freed)
        if stop > low:  # the rest of the span is null already (pads, moved scratch): null the freed slots
            for col in t.columns:
                for i in real:
                    col[i] = null
            t.retired_below = stop
        nxt = (t.retired_below + 1) * bs + 1
        for pos in positions.values():
            if pos < nxt:
                nxt = pos
        return nxt, False
