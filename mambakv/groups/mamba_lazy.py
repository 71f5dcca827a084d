"""LazyMambaManager: ``MambaCacheMode.ALIGN_LAZY`` (issue 10; after SGLang's ``extra_buffer_lazy``).

Prefill is eager align mode without scratch blocks (last state + running state; a chunk's
boundary state is published once processed). From its first decode step a request holds::

    table  [0, 0, ..., 0, W, C, (S)]      W working state, at the running slot cdiv(n, bs) - 1
                                          C private checkpoint, S spare (near a boundary only)
    scratch rows for draft k (k = 1..nspec): lent from the group's reserved region, not in the table

C sits after W, not at its boundary's slot: a step that ends exactly on a boundary leaves W's
running slot equal to that boundary's slot, and C holds no boundary at all until the first
crossing. ``get_state_plan`` names every block, so an engine never indexes the table.

Pinned prefix-cache blocks per running request in decode (scratch rows excluded):

    mode        nspec  between boundaries   inside the crossing window
    eager       0      1 (running)          2 (+ last state at the crossing step)
    eager       3      4 (running+scratch)  5
    lazy        0, 3   2 (W + C)            3 (W + C + S; S only if free without eviction)

Rules (B = next boundary above the settled position p, K = nspec, window = 2 (K + 1)):

* plan (``allocate``): if ``B - p <= window`` take a spare if none (never evicting a cached
  block: ``BlockPool.get_new_unhashed_block``; the "evict" policy may), and record the step's
  write target (S, else C in place) and B. The engine's kernel writes the state at B into the
  target if B falls in the step's computed range, rejected drafts included.
* resolve (``accept_drafts``, or ``retire`` for a step without drafts), in order; the step
  computed ``(start, start + 1 + drafts]`` and settled at ``end``:

      wrote B?  end >= B   target   effect
      yes       yes        S        promote at the request's next allocate: free old C
                                    unhashed, S becomes C (holds B); never at finish
      yes       yes        C        C holds B (written in place)
      yes       no         S        keep S (a later step rewrites it)
      yes       no         C        C invalid until a later verified crossing rewrites it
      no        -          -        nothing

* finish (``free``): no promotion; S freed unhashed; C published (hashed under B's key, then
  immutable) only if valid, not written in place by the last resolved step, and no unresolved
  step may still write it; else freed unhashed. Scratch rows go back to the region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidDraftCountError, InvalidSpecError, InvalidTokenCountError, OutOfBlocksError
from mambakv.core.events import stored_event_fields
from mambakv.core.request import Request
from mambakv.core.spec import MambaCacheMode, MambaSpec
from mambakv.groups.base import cdiv, group_block_hashes
from mambakv.groups.lazy_state import (
    LazyRequestBlocks,
    LazyStep,
    ScratchRegion,
    StatePlan,
    check_lazy_requests,
    state_plan,
)
from mambakv.groups.mamba import MambaManager


class LazyMambaManager(MambaManager):
    """State blocks of one Mamba group in ``ALIGN_LAZY`` mode (see the module docstring).

    Args:
        kv_cache_spec: a MambaSpec with mode ALIGN_LAZY; its ``num_speculative_blocks`` is the
            number of scratch rows a request borrows (the table itself has none, so the
            inherited ``num_speculative_blocks`` attribute is 0; ``num_draft_slots`` = nspec).
        max_num_seqs: most requests with drafts at once: sizes the reserved scratch region.
        spare_may_evict: take spares even by evicting a cached block (the "lazy-evict"
            benchmark policy); default False, the issue's rule.
    """

    table_class = LazyRequestBlocks

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, *, max_num_seqs: int = 256,
                 spare_may_evict: bool = False, enable_caching: bool = True, kv_cache_group_id: int = 0) -> None:
        if kv_cache_spec.mode is not MambaCacheMode.ALIGN_LAZY:
            raise InvalidSpecError(f"LazyMambaManager needs mode align_lazy, got {kv_cache_spec.mode.value}")
        # The prefill path is eager align mode with no scratch blocks in the table.
        super().__init__(replace(kv_cache_spec, mode=MambaCacheMode.ALIGN, num_speculative_blocks=0),
                         block_pool, enable_caching=enable_caching, kv_cache_group_id=kv_cache_group_id)
        self.kv_cache_spec = kv_cache_spec
        self.mode = MambaCacheMode.ALIGN_LAZY
        self.num_draft_slots = kv_cache_spec.num_speculative_blocks
        self.window = 2 * (self.num_draft_slots + 1)
        self.spare_may_evict = spare_may_evict
        self.scratch_region = ScratchRegion(block_pool, max_num_seqs, self.num_draft_slots)
        self._writes: list[tuple[str, int, int]] = []
        self._list_writes = False
        self._tables: dict[str, LazyRequestBlocks]  # type: ignore[assignment]

    # ------------------------------------------------------------------ planning
    def _is_decode(self, st: LazyRequestBlocks | None, num_tokens: int, num_computed: int, drafts: int) -> bool:
        """A decode step has one real token (``num_tokens - computed - drafts <= 1``)."""
        return (st is not None and st.decode) or num_tokens - num_computed - drafts <= 1

    def check_lazy_step(self, request_id: str, num_tokens: int, num_computed_tokens: int, num_draft_tokens: int) -> bool:
        """Validate a step before anything changes. Returns False when the scratch region has
        no ``nspec`` idle rows for a request's first step with drafts (more than
        ``max_num_seqs`` such requests): ``allocate`` then returns None, like a full pool.

        Raises:
            InvalidDraftCountError: more drafts than nspec, or drafts in a step whose real
                tokens are not exactly one (drafts belong to decode steps).
            InvalidTokenCountError: so many steps in flight that one crossing window could
                hold two boundaries (``(in flight + 1) x (nspec + 1) > block_size``).
        """
        st = self._tables.get(request_id)
        K = self.num_draft_slots
        if num_draft_tokens:
            if num_draft_tokens > K:
                raise InvalidDraftCountError(f"{num_draft_tokens} drafts > {K} scratch rows of group "
                                             f"{self.kv_cache_group_id}; pass allocate(num_draft_tokens=...)")
            if num_tokens - num_computed_tokens - num_draft_tokens != 1:
                raise InvalidDraftCountError("a step with drafts must have exactly one real token")
        if st is not None and st.decode and (len(st.steps) + 1) * (K + 1) > self.block_size:
            raise InvalidTokenCountError(f"{len(st.steps)} steps in flight: too many for block {self.block_size}")
        if num_draft_tokens and (st is None or not st.scratch):
            return self.scratch_region.can_lend()
        return True

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = (),
                                   num_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """0 in decode (W moves in the table, spares are optional); else eager align's count
        (no scratch), + 1 for C when the step may be the first decode step (an upper bound:
        drafts are not known here)."""
        st = self._tables.get(request_id)
        if st is not None and st.decode:
            return 0
        n = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, num_computed_tokens,
                                               num_lookahead_tokens)
        return n + 1 if num_tokens - num_computed_tokens <= 1 + self.num_draft_slots else n

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0, decode: bool = False, num_computed_tokens: int | None = None,
                            defer_spare: bool = False) -> list[KVCacheBlock]:
        """Prefill: eager align (no scratch). Decode: at the first decode step, eager growth of
        the running block if its slot moves (copy plan) and a new C; later steps only move W to
        the running slot. Every decode step is recorded; then (unless `defer_spare`, which the
        coordinator uses to take spares after every group's mandatory blocks)
        ``plan_checkpoint_write``. Returns the new mandatory blocks.

        `num_computed_tokens`: tokens computed before the step (the coordinator passes it;
        None = the previous allocation's tokens).
        """
        if num_tokens <= 0 or num_draft_tokens < 0:
            raise InvalidTokenCountError(f"num_tokens must be > 0 and drafts >= 0, got {num_tokens}, {num_draft_tokens}")
        st = self._tables.get(request_id)
        computed = num_computed_tokens if num_computed_tokens is not None else (st.num_tokens if st else 0)
        if not self._is_decode(st, num_tokens, computed, num_draft_tokens):
            return super().allocate_new_blocks(request_id, num_tokens, num_lookahead_tokens)
        if not self.check_lazy_step(request_id, num_tokens, computed, num_draft_tokens):
            raise OutOfBlocksError(f"scratch region of group {self.kv_cache_group_id} exhausted")
        new: list[KVCacheBlock] = []
        if st is None or not st.decode:
            new = super().allocate_new_blocks(request_id, num_tokens, num_lookahead_tokens)
            st = self._tables[request_id]
            st.positions.pop(st.running_slot, None)  # W is rewritten in place: never published
            ckpt = self.block_pool.get_new_blocks(1)[0]
            st.blocks.append(ckpt)
            new.append(ckpt)
            st.decode, st.working, st.ckpt, st.ckpt_pos = True, st.blocks[st.running_slot], ckpt, 0
            st.pos = st.decode_start = computed
        else:
            if st.promote_at:
                self._promote(st)
            self._move_working(st, num_tokens)
        st.steps.append(LazyStep(num_draft_tokens))
        if num_draft_tokens and not st.scratch:
            st.scratch = self.scratch_region.lend()
        if not defer_spare:
            self.plan_checkpoint_write(request_id)
        return new

    def _move_working(self, st: LazyRequestBlocks, num_tokens: int) -> None:
        """Keep W at the running slot as the tokens grow (no new block, no copy)::

            slot 7 -> 8:   [0 .. 0 W C S]  ->  [0 .. 0 0 W C S]
        """
        if num_tokens > st.num_tokens:
            st.num_tokens = num_tokens
        r, old = cdiv(num_tokens, self.block_size) - 1, st.running_slot
        if r <= old:
            return
        blocks = st.blocks
        tail = blocks[old + 1 :]
        del blocks[old:]
        blocks.extend([self.null_block] * (r - old))
        blocks.append(st.working)  # type: ignore[arg-type]
        blocks.extend(tail)
        st.running_slot = r

    def plan_checkpoint_write(self, request_id: str) -> None:
        """Window check for the request's latest planned step: inside the window, make sure a
        spare exists (never evicting unless ``spare_may_evict``) and record the step's write
        target (S, else C in place) and boundary for ``take_checkpoint_writes``."""
        st = self._tables.get(request_id)
        if st is None or not st.decode or not st.steps or not self.enable_caching:
            return
        step = st.steps[-1]
        bs, p = self.block_size, st.pos
        boundary = (p // bs + 1) * bs
        if step.boundary or boundary - p > max(2, len(st.steps)) * (self.num_draft_slots + 1):
            return
        if st.spare is None:
            pool = self.block_pool
            if self.spare_may_evict:
                spare = pool.get_new_blocks(1)[0] if pool.get_num_free_blocks() else None
            else:
                spare = pool.get_new_unhashed_block()
            if spare is not None:
                st.spare = spare
                st.blocks.append(spare)
        step.target = st.spare or st.ckpt
        step.boundary = boundary
        self._writes.append((request_id, step.target.block_id, boundary))  # type: ignore[union-attr]

    def take_checkpoint_writes(self) -> list[tuple[str, int, int]]:
        """``(request id, block id, position)`` per planned step with a write target, since the
        last call: the step's forward writes the state at `position` into the block if it
        computes that position."""
        out, self._writes = self._writes, []
        return out

    # ------------------------------------------------------------------ results
    def _resolve(self, st: LazyRequestBlocks, step: LazyStep, end: int) -> None:
        """Apply the table of the module docstring to one step that settled at `end`."""
        start, st.pos = st.pos, end
        target, boundary = step.target, step.boundary
        wrote = target is not None and start < boundary <= start + 1 + step.drafts
        st.wrote_ckpt = wrote and target is st.ckpt
        if wrote and end >= boundary:
            if target is st.spare:
                st.promote_at = boundary  # applied by the next allocate, never at finish
            else:
                st.ckpt_pos = boundary
        elif wrote and target is st.ckpt:
            st.ckpt_pos = 0
        spare = st.spare
        if spare is not None and not st.promote_at and not st.may_still_write(spare):
            nxt = (end // self.block_size + 1) * self.block_size
            if nxt - end > self.window:  # out of the window and idle: give it back
                st.blocks.remove(spare)
                st.spare = None
                self.block_pool.free_blocks([spare])

    def _promote(self, st: LazyRequestBlocks) -> None:
        """S holds the boundary ``promote_at``: free the old C unhashed, S becomes C."""
        old = st.ckpt
        st.blocks.remove(old)  # type: ignore[arg-type]
        self.block_pool.free_blocks([old])  # type: ignore[list-item]
        st.ckpt, st.spare, st.ckpt_pos, st.promote_at = st.spare, None, st.promote_at, 0

    def _settle(self, st: LazyRequestBlocks, num_processed_tokens: int) -> None:
        """Resolve leading steps without drafts that `num_processed_tokens` covers."""
        steps = st.steps
        while steps and not steps[0].drafts and st.pos + 1 <= num_processed_tokens:
            self._resolve(st, steps.popleft(), st.pos + 1)

    def accept_drafts(self, request_id: str, num_accepted: int) -> list[tuple[int, int]]:
        """Resolve the oldest step with drafts (``1 + num_accepted`` tokens settled); returns
        the copy scratch row of the last accepted draft -> W (none for 0 accepted).

        Raises:
            InvalidDraftCountError: `num_accepted` outside ``0 .. drafts`` (nothing changed).
        """
        st = self._tables.get(request_id)
        if st is None or not st.decode:
            return super().accept_drafts_columns(request_id, num_accepted)[0]
        step = next((s for s in st.steps if s.drafts), None)
        if step is None or not 0 <= num_accepted <= step.drafts:
            if step is None and num_accepted == 0:
                return []
            raise InvalidDraftCountError(f"accepted {num_accepted} of {step.drafts if step else 0} drafts")
        while st.steps[0] is not step:  # their results came before this verify
            self._resolve(st, st.steps.popleft(), st.pos + 1)
        st.steps.popleft()
        self._resolve(st, step, st.pos + 1 + num_accepted)
        if num_accepted == 0:
            return []
        return [(st.scratch[num_accepted - 1].block_id, st.working.block_id)]  # type: ignore[union-attr]

    def accept_drafts_columns(self, request_id: str, num_accepted: int) -> list[list[tuple[int, int]]]:
        """One column (lazy groups never share a policy): ``[accept_drafts(...)]``."""
        return [self.accept_drafts(request_id, num_accepted)]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Settle steps without drafts, then publish settled prefill states (eager rule)."""
        st = self._tables.get(request.request_id)
        if st is not None:
            st.request = request
            self._settle(st, num_tokens)
        super().cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        if num_processed_tokens < 0:
            raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
        st = self._tables.get(request_id)
        if st is not None and st.steps:
            self._settle(st, num_processed_tokens)
        super().remove_skipped_blocks(request_id, num_processed_tokens)
        if st is not None and st.decode and st.pos > st.decode_start and st.retired_below < st.running_slot:
            # The first decode step ran, and with it its copy from the prefill's last state:
            # nothing below W is needed any more (settled prefill states were published first).
            self.retire_slots(st, st.running_slot)

    def free(self, request_id: str) -> None:
        """Finish or preemption: publish C if it is safe (module docstring), give the scratch
        rows back, drop untaken checkpoint writes, then free the table (S and W unhashed)."""
        st = self._tables.get(request_id)
        if st is not None and st.decode:
            ckpt, req = st.ckpt, st.request
            if (self.enable_caching and st.ckpt_pos and req is not None and not st.wrote_ckpt
                    and not st.may_still_write(ckpt)):  # type: ignore[arg-type]
                keys = group_block_hashes(req, self.block_size)
                slot = st.ckpt_pos // self.block_size - 1
                if slot < len(keys):
                    fields = (stored_event_fields(req, keys, slot, slot + 1, self.block_size)
                              if self.block_pool.enable_kv_cache_events else {})
                    self.block_pool.cache_full_blocks([ckpt], [keys[slot]], self.kv_cache_group_id,  # type: ignore[list-item]
                                                      **fields)
            if st.scratch:
                self.scratch_region.give_back(st.scratch)
                st.scratch = []
            if self._writes:
                self._writes = [w for w in self._writes if w[0] != request_id]
        super().free(request_id)

    # ------------------------------------------------------------------ queries
    def get_state_plan(self, request_id: str) -> StatePlan | None:
        """Where the request's states live (see StatePlan); None for an unknown request."""
        st = self._tables.get(request_id)
        return None if st is None or st.running_slot < 0 else state_plan(st)

    def get_state_block_ids(self, request_id: str) -> list[int]:
        """Real states of the request: W and a valid C in decode (scratch and spare excluded)."""
        st = self._tables.get(request_id)
        if st is None or not st.decode:
            return super().get_state_block_ids(request_id)
        return [st.working.block_id] + ([st.ckpt.block_id] if st.ckpt_pos else [])  # type: ignore[union-attr]

    @property
    def reserved_blocks(self) -> list[KVCacheBlock]:
        """The scratch region (held for good; the coordinator counts them as in use)."""
        return self.scratch_region.blocks

    def check_invariants(self) -> None:
        """Base checks, plus ``lazy_state.check_lazy_requests`` (decode layout, targets,
        scratch region partition)."""
        super().check_invariants()
        check_lazy_requests(self._tables, self.block_size, self.scratch_region)
