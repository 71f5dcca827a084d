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
from mambakv.core.request import Request
from mambakv.groups.drafts import MambaTable
from mambakv.groups.mamba_queries import QueriesMixin
from mambakv.groups.mamba_steps import AlignStep
from mambakv.groups.tables import BlockTable

__all__ = ["MAMBA_CHUNK_STEPS", "MambaChunkMixin"]

_GROW = AlignStep.GROW

#: the general path's steps the Mamba chunk path stands in for (a subclass changing one opts out)
MAMBA_CHUNK_STEPS = ("get_num_blocks_to_allocate", "count_columns", "allocate_new_blocks", "allocate_columns",
                     "_align_columns", "_grow", "_record_step", "_list_step_writes", "plan_checkpoint_write",
                     "dead_slots", "_dead_slots", "settle", "next_event")


class MambaChunkMixin(QueriesMixin):
    """The Mamba half of the chunk path (see the module docstring)."""

    _list_writes: bool

    if TYPE_CHECKING:  # MambaManager's
        def publish_settled(self, request: Request, t: MambaTable, num_tokens: int) -> None: ...

    def chunk_need(self, table: BlockTable, num_tokens: int, num_lookahead_tokens: int) -> int:
        """One block per column for a GROW chunk (lookahead never adds Mamba blocks), else -1."""
        t: MambaTable = table  # type: ignore[assignment]
        if not self.chunks or t.verify_steps or t.verified or t.in_decode:
            return -1
        source = t.running_slot
        if 0 <= source < -(num_tokens // -self.block_size) - 1 \
                and len(t.blocks) == source + 1 + self.num_speculative_blocks:
            return len(t.columns)
        return -1

    def grow_chunk(self, request_id: str, table: BlockTable, num_tokens: int,
                   num_lookahead_tokens: int) -> list[list[KVCacheBlock]]:
        """Commit the GROW chunk ``chunk_need`` counted (see the module docstring)."""
        t: MambaTable = table  # type: ignore[assignment]
        bs = self.block_size
        source = t.running_slot
        running = -(num_tokens // -bs) - 1
        null = self.null_block
        lo = source + 1  # scratch slots [lo, hi) now lie below the running slot: they move to the end
        hi = min(running, lo + self.num_speculative_blocks)
        nulls = [null] * (hi - lo)
        pad = running - len(t.blocks)  # a jump past the scratch blocks: null up to the running slot
        new = self.block_pool.get_new_blocks(len(t.columns))
        out = []
        for col, m, block in zip(t.columns, self._column_managers, new):
            if pad > 0:
                col += [null] * pad
            moved = col[lo:hi]
            col[lo:hi] = nulls
            col += moved
            col.append(block)
            block_id = col[running].block_id
            m._copy_plan.append((col[source].block_id, block_id))
            if self._list_writes:
                m._writes.append((request_id, block_id, num_tokens))
            out.append([block])
        t.running_slot = running  # _record_step: no drafts, none pending
        t.num_tokens = num_tokens
        t.last_step = _GROW
        if self.enable_caching and num_tokens == (running + 1) * bs:
            t.positions[running] = num_tokens
        elif t.positions:
            t.positions.pop(running, None)
        return out

    def chunk_retire_ok(self, table: BlockTable, num_processed_tokens: int) -> bool:
        """No verify or decode bookkeeping pending, and the running state outlives the retire
        (else the general path raises its error)."""
        t: MambaTable = table  # type: ignore[assignment]
        if not self.chunks or t.verify_steps or t.verified or t.in_decode or t.decode_steps or t.spare_pos:
            return False
        return not 0 <= t.running_slot < (num_processed_tokens - 1) // self.block_size

    def retire_chunk(self, request: Request, table: BlockTable, num_processed_tokens: int) -> int:
        """Publish the settled boundary states, retire the skipped slots; returns the next event."""
        t: MambaTable = table  # type: ignore[assignment]
        positions = t.positions
        if positions:
            self.publish_settled(request, t, num_processed_tokens)
        num_slots = (num_processed_tokens - 1) // self.block_size  # only the last state matters
        if num_slots > t.retired_below:
            self.retire_slots(t, num_slots)
        nxt = (t.retired_below + 1) * self.block_size + 1
        if positions:
            low = min(positions.values())
            if low < nxt:
                return low
        return nxt
