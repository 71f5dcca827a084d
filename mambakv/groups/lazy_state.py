"""Per-request state of the lazy Mamba manager (``mamba_lazy.py``), its step records, the
engine-facing ``StatePlan`` and the reserved scratch region.

Kept apart from the manager so that each file states one concern: here *what* is tracked,
there *when* it changes.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidSpecError, OutOfBlocksError
from mambakv.core.request import Request
from mambakv.groups.mamba import MambaRequestBlocks


class StatePlan(NamedTuple):
    """Where a request's states live now, for the engine's kernels (no index arithmetic).

    Attributes:
        working_block_id: the running state (read and advanced in place by every step).
        checkpoint_block_id: the private checkpoint (0 before the first decode step).
        checkpoint_position: the boundary (tokens) the checkpoint holds; 0 while it holds none
            (not written yet, or overwritten by a draft that was rejected).
        spare_block_id: the spare taken near a boundary, 0 when none.
        scratch_block_ids: draft states, ``scratch_block_ids[k]`` = state after draft ``k + 1``
            (lent from the group's reserved region; empty until the first step with drafts).
        write_target: ``(block id, boundary position)`` of the latest planned step, or None:
            if the step's forward computes the state at that position (even for a draft that
            is rejected later), it writes it into that block as well.
    """

    working_block_id: int
    checkpoint_block_id: int
    checkpoint_position: int
    spare_block_id: int
    scratch_block_ids: tuple[int, ...]
    write_target: tuple[int, int] | None


class LazyStep:
    """One planned decode step: its draft count and, inside a crossing window, its write
    target (the spare, or the checkpoint in place) and the boundary it may write."""

    __slots__ = ("drafts", "target", "boundary")

    def __init__(self, drafts: int) -> None:
        self.drafts = drafts
        self.target: KVCacheBlock | None = None
        self.boundary = 0


class LazyRequestBlocks(MambaRequestBlocks):
    """Per-request state of a LazyMambaManager (the eager fields serve the prefill).

    Attributes:
        decode: the request switched to the lazy decode layout ``[0 .. 0, W, C, (S)]``.
        working: W, the running state block (at the running slot).
        ckpt: C, the private checkpoint block (right after W).
        ckpt_pos: the boundary C holds, 0 when it holds none that is valid.
        spare: S, the spare (after C), or None.
        scratch: draft-state rows lent from the reserved region.
        steps: planned decode steps whose results are not resolved yet, oldest first.
        pos: the settled position: tokens processed after the last resolved step.
        decode_start: the position the first decode step started from.
        wrote_ckpt: the last resolved step wrote C in place (C is then never published at free).
        promote_at: a step crossed into S, which now holds this boundary; S becomes C at the
            request's next ``allocate`` (0: none pending). A request that finishes first
            never promotes: S is freed unhashed, C stays what it was.
        request: the Request (kept from ``cache_blocks``; its hashes key C at free).
    """

    __slots__ = ("decode", "working", "ckpt", "ckpt_pos", "spare", "scratch", "steps", "pos", "decode_start", "wrote_ckpt",
                 "promote_at", "request")

    def __init__(self) -> None:
        super().__init__()
        self.decode = False
        self.working: KVCacheBlock | None = None
        self.ckpt: KVCacheBlock | None = None
        self.ckpt_pos = 0
        self.spare: KVCacheBlock | None = None
        self.scratch: list[KVCacheBlock] = []
        self.steps: deque[LazyStep] = deque()
        self.pos = 0
        self.decode_start = 0
        self.wrote_ckpt = False
        self.promote_at = 0
        self.request: Request | None = None

    def may_still_write(self, block: KVCacheBlock) -> bool:
        """An unresolved step targets `block` with a boundary not yet passed (steps whose
        boundary is at or below the settled position start beyond it and cannot write it)."""
        return any(s.target is block and s.boundary > self.pos for s in self.steps)


class ScratchRegion:
    """``max_num_seqs x nspec`` blocks taken from the pool once (ref count 1, never hashed,
    never in a block table); a request in decode borrows ``nspec`` of them at its first step
    with drafts and gives them back at ``free``.

    Why from the pool: scratch rows are rows of the same state tensors, so reserving them from
    the one pool charges them to the same memory budget as eager mode's per-request scratch
    blocks (a separate region would hand lazy mode extra memory), and no state-pool change is
    needed (a scratch row is an ordinary block id).

    Raises:
        InvalidSpecError: the pool cannot hold the region.
    """

    def __init__(self, block_pool: BlockPool, max_num_seqs: int, nspec: int) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs <= 0:
            raise InvalidSpecError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
        self.nspec = nspec
        try:
            self.blocks: list[KVCacheBlock] = block_pool.reserve_blocks(max_num_seqs * nspec) if nspec else []
        except OutOfBlocksError:
            raise InvalidSpecError(
                f"the lazy scratch region needs max_num_seqs x nspec = {max_num_seqs * nspec} blocks, the pool has "
                f"{block_pool.get_num_free_blocks()} free") from None
        self._idle = list(reversed(self.blocks))

    def can_lend(self) -> bool:
        return len(self._idle) >= self.nspec

    def lend(self) -> list[KVCacheBlock]:
        out = self._idle[-self.nspec:][::-1]
        del self._idle[-self.nspec:]
        return out

    def give_back(self, blocks: list[KVCacheBlock]) -> None:
        self._idle.extend(reversed(blocks))

    def check_invariants(self, lent: list[KVCacheBlock]) -> None:
        """Every reserved block: ref count 1, unhashed, not queued; idle and lent partition it."""
        for b in self.blocks:
            assert b.ref_cnt == 1 and b.block_hash is None and not b.is_null, f"bad reserved block {b}"
        ids = [b.block_id for b in self._idle] + [b.block_id for b in lent]
        assert sorted(ids) == sorted(b.block_id for b in self.blocks), "scratch region leaked or double-lent"


def state_plan(st: LazyRequestBlocks) -> StatePlan:
    """The StatePlan of a request that holds a running state."""
    if not st.decode:
        return StatePlan(st.blocks[st.running_slot].block_id, 0, 0, 0, (), None)
    last = st.steps[-1] if st.steps else None
    target = (last.target.block_id, last.boundary) if last is not None and last.target is not None else None
    return StatePlan(st.working.block_id, st.ckpt.block_id, st.ckpt_pos,  # type: ignore[union-attr]
                     st.spare.block_id if st.spare else 0, tuple(b.block_id for b in st.scratch), target)


def check_lazy_requests(reqs: dict[str, LazyRequestBlocks], block_size: int, region: ScratchRegion) -> None:
    """In decode the table is ``[0 .. 0, W, C, (S)]`` with W at the running slot; W, C, S are
    unshared and unhashed; live step targets are C or S; C's boundary is settled; the scratch
    region is partitioned between idle rows and the requests' lent rows."""
    lent: list[KVCacheBlock] = []
    for rid, st in reqs.items():
        lent.extend(st.scratch)
        if not st.decode:
            assert not st.scratch and not st.steps, f"{rid}: lazy state before decode"
            continue
        tail = [st.ckpt] + ([st.spare] if st.spare is not None else [])
        assert st.blocks[st.running_slot] is st.working and st.blocks[st.running_slot + 1 :] == tail, \
            f"{rid}: lazy layout broken"
        for b in [st.working, *tail]:
            assert b is not None and b.ref_cnt == 1 and b.block_hash is None, f"{rid}: shared or published state block {b}"
        assert all(s.target is None or s.boundary <= st.pos or any(s.target is b for b in tail)
                   for s in st.steps), f"{rid}: a live write target outside C / S"
        assert st.ckpt_pos % block_size == 0 and st.ckpt_pos <= st.pos, f"{rid}: checkpoint ahead"
    region.check_invariants(lent)
