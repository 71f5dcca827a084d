"""The plan drains of :class:`~mambakv.coordinator.KVCacheCoordinator`: what the device runs
for a step (new block ids, pre-forward copies, zero rows, checkpoint writes), taken once per
step after every allocation, and ``new_step``, which drops what an engine did not take::

    new_step()           drop the last step's untaken new block ids and checkpoint writes
    allocate(...) ...    each Mamba group queues copies / zeros / writes; results are kept
    take_step_plan()     all of it as one StepPlan (EMPTY_STEP_PLAN when nothing happened)
    or take_copy_plan() / take_zero_plan() / take_checkpoint_writes(): one part each

Nothing here allocates or frees a block."""

from __future__ import annotations

from mambakv.core.block import KVCacheBlock
from mambakv.groups import MambaManager, SingleTypeKVCacheManager, StatePlan
from mambakv.plans import EMPTY_STEP_PLAN, GroupPlan, StepPlan

__all__ = ["CoordinatorPlans"]


class CoordinatorPlans:
    """Mixed into KVCacheCoordinator, which sets every attribute declared here."""

    managers: tuple[SingleTypeKVCacheManager, ...]
    mamba_managers: tuple[MambaManager, ...]
    num_steps: int
    _new_results: list[tuple[list[KVCacheBlock], ...]]
    _copies_pending: bool
    _own_copy_drains: bool
    _zeros_pending: bool

    def new_step(self) -> None:
        """Mark a scheduling step (statistics; hits never depend on it). The new block ids and
        checkpoint writes of ``take_step_plan`` / ``take_checkpoint_writes`` cover the steps
        planned since the last ``new_step`` or drain: what an engine did not take is dropped
        here, so nothing accumulates for an engine that never asks."""
        self.num_steps += 1
        if self._new_results:
            self._new_results = []
        for m in self.mamba_managers:  # m.drop_checkpoint_writes(), inlined
            if m._writes:
                m._writes = []

    # ------------------------------------------------------------------ plans
    def take_step_plan(self) -> StepPlan:
        """Every group's device work since the last drain, as one immutable :class:`StepPlan`
        (new block ids, pre-forward copies, zero rows, checkpoint writes). Returns the shared
        ``EMPTY_STEP_PLAN`` at once when nothing happened."""
        writes = self.take_checkpoint_writes()
        results = self._new_results
        if not (results or self._copies_pending or self._zeros_pending or writes):
            return EMPTY_STEP_PLAN
        copies = self.take_copy_plan()
        zeros = self.take_zero_plan()
        self._new_results = []
        out = []
        for gid in range(len(self.managers)):
            plan = GroupPlan(gid, tuple(b.block_id for r in results for b in r[gid]), tuple(copies.get(gid, ())),
                             tuple(zeros.get(gid, ())), tuple(writes.get(gid, ())))
            if not plan.empty:
                out.append(plan)
        return StepPlan(tuple(out)) if out else EMPTY_STEP_PLAN

    def take_copy_plan(self) -> dict[int, list[tuple[int, int]]]:
        """Per Mamba group with copies: ``(src, dst)`` block ids to run before the forward."""
        if not self._copies_pending:
            return {}
        self._copies_pending = False
        out = {}
        if self._own_copy_drains:  # each manager's take_copy_plan, inline (a call per group saved)
            for m in self.mamba_managers:
                plan = m._copy_plan
                if plan:
                    m._copy_plan = []
                    out[m.kv_cache_group_id] = plan
            return out
        for m in self.mamba_managers:
            plan = m.take_copy_plan()
            if plan:
                out[m.kv_cache_group_id] = plan
        return out

    def take_zero_plan(self) -> dict[int, list[int]]:
        """Per Mamba group: running blocks that start with no initial state (zero them)."""
        if not self._zeros_pending:
            return {}
        self._zeros_pending = False
        return {m.kv_cache_group_id: p for m in self.mamba_managers if (p := m.take_zero_plan())}

    def take_checkpoint_writes(self) -> dict[int, list[tuple[str, int, int]]]:
        """Per Mamba group: ``(request id, block id, position)`` for each block a step planned
        since the last call writes (running state, scratch, ``latest``'s spare) and the
        position it holds after the step; a spare gets the state at `position` only if the
        step computes that position (drafts included). See MambaManager.take_checkpoint_writes."""
        # A group with nothing listed is skipped without a call: most steps list nothing.
        return {m.kv_cache_group_id: m.take_checkpoint_writes() for m in self.mamba_managers if m._writes}

    def get_state_plan(self, request_id: str) -> dict[int, StatePlan]:
        """Per Mamba group holding the request: its running / spare / scratch block ids and
        the latest step's write target (MambaManager.get_state_plan)."""
        out = {}
        for m in self.mamba_managers:
            plan = m.get_state_plan(request_id)
            if plan is not None:
                out[m.kv_cache_group_id] = plan
        return out

    def get_state_slot_ids(self, request_id: str) -> dict[int, tuple[int, ...]]:
        """Per Mamba group, the state rows the request's next forward uses, for a kernel's state
        indices: ``(running, scratch_1, ..., scratch_nspec)``. The forward reads the running row
        (after the step's pre-forward copies) and writes it and the scratch rows. ``-1`` where
        there is none: every entry of a group that holds no state for the request yet. Rows are
        state slot ids in the decoupled layout (``DecoupledLayout.mamba_states``), block ids in
        the unified one."""
        out = {}
        for m in self.mamba_managers:
            plan = m.get_state_plan(request_id)
            if plan is None:
                out[m.kv_cache_group_id] = (-1,) * (1 + m.num_speculative_blocks)
            else:
                out[m.kv_cache_group_id] = (plan.working_block_id, *plan.scratch_block_ids)
        return out
