"""The fused request-step of a :class:`~mambakv.groups.mamba.MambaManager` used alone:
retire, count and allocate in one call (``schedule_step``).

A prefill chunk of a running request without drafts (case GROW of one block column) runs in
one pass here: the retirement walk (``retire_slots``), the free + one-block allocation
(``free_then_get``), the padding and scratch relocation and the step record (``_grow``,
``_record_step``, ``_list_step_writes``) inlined, same order, same blocks. Any other step
takes the three calls one by one.
"""

from __future__ import annotations

from mambakv.core.block import KVCacheBlock
from mambakv.core.pool_fused import free_then_get
from mambakv.groups.mamba_queries import QueriesMixin
from mambakv.groups.mamba_release import MambaReleaseMixin
from mambakv.groups.mamba_steps import AlignStep

__all__ = ["FusedStepMixin"]

_GROW = AlignStep.GROW

_RETIRE_SLOTS = MambaReleaseMixin.retire_slots


class FusedStepMixin(QueriesMixin):
    """``schedule_step``; the manager supplies ``allocate_columns``."""

    _writes: list[tuple[str, int, int]]
    _list_writes: bool
    _fused: bool

    def allocate_columns(self, request_id: str, num_tokens: int, num_lookahead_tokens: int,
                         num_draft_tokens: int, *, decode: bool = False,
                         num_computed_tokens: int | None = None) -> list[list[KVCacheBlock]]:
        raise NotImplementedError  # MambaManager.allocate_columns

    def schedule_step(self, request_id: str, num_tokens: int, num_processed_tokens: int, *,
                      num_draft_tokens: int = 0) -> list[KVCacheBlock] | None:
        """One request-step of a manager used alone, fused: retire to `num_processed_tokens`,
        count, allocate for `num_tokens` main tokens. Returns the new blocks, or None (nothing
        changed but the retirement) when the pool is short. Equivalent to
        ``remove_skipped_blocks`` + ``get_num_blocks_to_allocate`` + ``allocate_new_blocks``.

        Raises: as those three calls."""
        t = self._tables.get(request_id)
        if (t is not None and not num_draft_tokens and self._fused
                and num_tokens > 0 and num_processed_tokens > 0 and not (t.verify_steps or t.verified)):
            # The prefill chunk of a running request: retire + count + GROW in one pass, the
            # same steps as the three calls (retire_slots, _grow, _record_step and
            # _list_step_writes inlined); any other case takes them one by one below.
            bs = self.block_size
            source = t.running_slot
            num_slots = (num_processed_tokens - 1) // bs  # only the last state matters
            running = -(num_tokens // -bs) - 1
            if 0 <= source < running and num_slots <= source:
                blocks = t.blocks
                null = self.null_block
                low = t.retired_below
                stop = num_slots if num_slots < len(blocks) else len(blocks)
                freed: list[KVCacheBlock] = []
                if stop > low:
                    if type(self).retire_slots is not _RETIRE_SLOTS:  # a planted rule (teeth tests)
                        self.retire_slots(t, num_slots)
                        stop = low
                    else:
                        i = stop
                        while i > low:  # deepest first, null gaps skipped
                            i -= 1
                            if blocks[i] is not null:
                                freed.append(blocks[i])
                new = free_then_get(self.block_pool, freed, 1)  # raises (nothing changed) as free_blocks
                if stop > low:
                    t.retired_below = i = stop
                    while i > low:
                        i -= 1
                        blocks[i] = null
                if new is None:
                    return None
                if len(blocks) < running:  # _pad_to_running_slot: a jump past the scratch blocks (rare)
                    blocks.extend([null] * (running - len(blocks)))
                slot = source + 1  # _relocate_scratch_blocks: the scratch now below the running slot
                end = slot + self.num_speculative_blocks
                if running < end:
                    end = running
                while slot < end:
                    blocks.append(blocks[slot])
                    blocks[slot] = null
                    slot += 1
                blocks += new
                block_id = blocks[running].block_id
                self._copy_plan.append((blocks[source].block_id, block_id))
                # _record_step's GROW case without drafts, inlined: one call is 10% of this whole step (measured: 1.29 against 1.16 us)
                t.running_slot = running
                t.num_tokens = num_tokens
                t.last_step = _GROW
                if self.enable_caching and num_tokens == (running + 1) * bs:
                    t.positions[running] = num_tokens
                elif t.positions:
                    t.positions.pop(running, None)
                if self._list_writes:
                    self._writes.append((request_id, block_id, num_tokens))
                return new
        self.remove_skipped_blocks(request_id, num_processed_tokens)
        need = self.get_num_blocks_to_allocate(request_id, num_tokens) * len(self._column_managers)
        if need > self.block_pool.free_block_queue.num_free_blocks:
            return None
        return self.allocate_columns(request_id, num_tokens, 0, num_draft_tokens)[0]
