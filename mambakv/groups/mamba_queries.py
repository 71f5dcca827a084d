"""Read-only queries and invariants of :class:`~mambakv.groups.mamba.MambaManager`: the table
snapshot, the coordinator's thresholds, state block ids, the hit rule and ``check_invariants``.

Quiet thresholds (``thresholds``), per request::

    covered   (running slot + 1) x bs       beyond it the running block must move (or grow)
    quiet     covered - 1                   every / prefill: a step strictly inside the block
              min(covered, B) - 1           latest in decode: below the next boundary B
              0                             a step awaits accept_drafts, or latest has a step
                                            in flight (it must be resolved in order)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec
from mambakv.groups.base import NEVER, BlockTable
from mambakv.groups.drafts import MambaTable
from mambakv.groups.mamba_decode import DecodeCheckpointsMixin
from mambakv.plans import TableView

__all__ = ["QueriesMixin", "StatePlan"]


class StatePlan(NamedTuple):
    """Where a request's states live now (``get_state_plan``), for kernels that prefer named
    blocks to the table. ``take_checkpoint_writes`` gives the same blocks per planned step.

    Attributes:
        working_block_id: the running state block.
        checkpoint_block_id, checkpoint_position: 0 (the 0.x ALIGN_LAZY private checkpoint is
            gone; kept so that 0.x callers still unpack the tuple).
        spare_block_id: ``latest``'s checkpoint waiting for its ``retire`` (a copy made at
            verify, see ``mamba_decode.py``), 0 when none.
        scratch_block_ids: draft states, ``scratch_block_ids[k]`` = state after draft ``k + 1``.
        write_target: None (no forward writes a checkpoint block any more; kept for 0.x callers).
    """

    working_block_id: int
    checkpoint_block_id: int
    checkpoint_position: int
    spare_block_id: int
    scratch_block_ids: tuple[int, ...]
    write_target: tuple[int, int] | None


class QueriesMixin(DecodeCheckpointsMixin):
    """The query half of MambaManager."""

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

    def thresholds(self, table: BlockTable) -> tuple[int, int]:
        """Covered: up to the running slot's boundary (``num_covered_tokens``). Quiet: steps
        strictly inside the running slot with no step awaiting ``accept_drafts`` only advance
        the state in place (nothing to tag: the boundary itself is excluded)."""
        t: MambaTable = table  # type: ignore[assignment]
        if t.running_slot < 0:
            return 0, 0
        if not self._align:
            return NEVER, 0 if t.verify_steps else NEVER
        covered = (t.running_slot + 1) * self.block_size
        if t.verify_steps:
            return covered, 0
        return covered, self.decode_quiet(t, covered) if t.in_decode else covered - 1

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

    def check_invariants(self) -> None:
        """Base checks, plus: scratch blocks have ref count 1 and no hash; the running block
        is real and unshared; position tags lie within the table; every block column (groups
        sharing the policy) has column 0's length and null slots."""
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
            for b in t.blocks[r + 1 :]:
                assert b is not null and b.ref_cnt == 1 and b.block_hash is None, f"{rid}: bad scratch {b}"
            assert all(0 <= s < len(t.blocks) for s in t.positions), f"{rid}: tag outside table"
            if t.in_decode:  # latest / none: [0 .. R S .. S (P)], the running block never tagged
                assert len(t.blocks) == r + 1 + self.num_speculative_blocks + t.has_spare, f"{rid}: decode layout"
                bound = (r + 1) * self.block_size  # latest: a step without drafts ended on it
                assert t.positions.get(r, bound) == bound and (self._spares or r not in t.positions), \
                    f"{rid}: decode tags"
                assert t.has_spare == bool(t.spare_pos), f"{rid}: a checkpoint block without its boundary"
