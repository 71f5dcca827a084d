"""What the coordinator hands the engine: blocks per group, and the per-step plans of device work.

All plan types are immutable named tuples. A step's plan is drained with
``KVCacheCoordinator.take_step_plan()``; ``take_copy_plan()`` / ``take_zero_plan()`` /
``take_checkpoint_writes()`` drain one part each, with the 0.1 shapes::

    StepPlan.groups[g] = GroupPlan(group_id=g,
        new_block_ids=(17, 18),            blocks the group's tables gained (allocation order)
        copies=((4, 17),),                 (src, dst) state copies to run before the forward
        zeros=(),                          running states with no initial state: zero them
        checkpoint_writes=())              (request id, block id, position) boundary writes
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn, SupportsIndex

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import ReadOnlyResultError
from mambakv.core.transfers import LoadPlan

__all__ = ["EMPTY_STEP_PLAN", "GroupPlan", "KVCacheBlocks", "RequestView", "SharedEmptyList", "StatePlan", "StepPlan",
           "TableView", "TieredHit"]


class SharedEmptyList(list[KVCacheBlock]):
    """A group's list in the shared empty result (``KVCacheBlocks.shared_empty``): it reads as
    an empty list; every change that could add a block raises ReadOnlyResultError, since every
    caller holds the same object (a decode step that takes no block allocates nothing). Its
    copies (``list(x)``, ``copy.copy``, ``copy.deepcopy``, pickling) are plain lists."""

    __slots__ = ()

    def __init__(self, *items: Iterable[KVCacheBlock]) -> None:
        if items:  # (``x.__init__(blocks)`` would refill it)
            self._refuse()
        super().__init__()

    def _refuse(self) -> NoReturn:
        raise ReadOnlyResultError("this empty block list is shared by every caller (a step that took no block, "
                                  "a miss): change a copy of it, list(result.blocks[g])")

    def append(self, item: KVCacheBlock, /) -> NoReturn:
        self._refuse()

    def extend(self, items: Iterable[KVCacheBlock], /) -> NoReturn:
        self._refuse()

    def insert(self, index: SupportsIndex, item: KVCacheBlock, /) -> NoReturn:
        self._refuse()

    def __setitem__(self, key: Any, value: Any, /) -> NoReturn:
        self._refuse()

    # (mypy checks ``+=`` against list's overloaded ``+``, which no plain method matches)
    def __iadd__(self, items: Iterable[KVCacheBlock], /) -> SharedEmptyList:  # type: ignore[override,misc]
        self._refuse()

    def __imul__(self, n: SupportsIndex, /) -> SharedEmptyList:
        self._refuse()

    def __copy__(self) -> list[KVCacheBlock]:
        return []

    def __deepcopy__(self, memo: dict[int, Any]) -> list[KVCacheBlock]:
        return []

    def __reduce__(self) -> tuple[type[list[KVCacheBlock]], tuple[()]]:
        return list, ()


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks per KV-cache group, in config order: ``blocks[g]`` is group g's list. Frozen (a
    result is never rebound). Read the lists; to change one, copy it first: the coordinator's
    step plan (``take_step_plan``) reads the same lists for the step's new block ids, and the
    shared empty result's lists refuse additions (``shared_empty``).

    ``table_appends[g]`` (``allocate``'s results): what an append-only worker table of group g
    gains in the step, the table's new suffix beyond its length before the step, null padding
    and relocated scratch blocks included (for a new or resumed request, its whole table, hits
    first). ``blocks`` keeps its meaning: the blocks the step took from the pool. The worker's
    rule: append ``table_appends[g]`` to the request's table of group g (start a new one for a
    request it does not know or that was preempted); its table then has ``get_block_ids``'
    length and agrees with it at every slot where ``get_block_ids`` is not null (a slot the
    coordinator nulled, retired or relocated, is never read again)::

        Mamba, block 16, nspec 1:  before [0 R S]          a chunk to 64 tokens (GROW)
        get_block_ids after        [0 R 0 S N]             S relocated to the new running slot 3
        blocks                     [N]                     taken from the pool
        table_appends              [S N]                   worker: [0 R S] + [S N] = [0 R S S N]

    Exact for every group kind with ``decode_checkpoints="every"`` (vLLM's rule); under
    ``latest`` / ``none`` a decode step moves the running block down the table (ADVANCE), which
    an append-only table cannot follow: such a worker re-reads ``get_block_ids``. Every result
    of the coordinator sets it (a lookup's: its ``blocks``); None only in a result built without
    it, where ``get_table_append_ids`` reads ``blocks``."""

    blocks: tuple[list[KVCacheBlock], ...]
    table_appends: tuple[list[KVCacheBlock], ...] | None = field(default=None, compare=False)

    @classmethod
    def shared_empty(cls, num_groups: int) -> KVCacheBlocks:
        """The one empty result a coordinator hands every caller (a step that takes no block,
        a miss): its lists refuse additions (:class:`SharedEmptyList`)."""
        empty = tuple(SharedEmptyList() for _ in range(num_groups))
        return cls(empty, empty)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_table_append_ids(self) -> tuple[list[int], ...]:
        """``table_appends`` as block ids (null = 0), per group (``blocks``' when None)."""
        appends = self.blocks if self.table_appends is None else self.table_appends
        return tuple([b.block_id for b in group] for group in appends)

    def __len__(self) -> int:
        return len(self.blocks)


class GroupPlan(NamedTuple):
    """The device work of one group since the last drain (see the module docstring)."""

    group_id: int
    new_block_ids: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    zeros: tuple[int, ...] = ()
    checkpoint_writes: tuple[tuple[str, int, int], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.new_block_ids or self.copies or self.zeros or self.checkpoint_writes)


class StepPlan(NamedTuple):
    """Every group's :class:`GroupPlan` (only the groups with work)."""

    groups: tuple[GroupPlan, ...] = ()

    def group(self, group_id: int) -> GroupPlan:
        """The plan of `group_id` (an empty one when it has no work)."""
        for g in self.groups:
            if g.group_id == group_id:
                return g
        return GroupPlan(group_id)


#: the one shared result when nothing happened since the last drain
EMPTY_STEP_PLAN = StepPlan()


class StatePlan(NamedTuple):
    """Where a request's states live now (``get_state_plan``), for kernels that prefer named
    blocks to the table. ``take_checkpoint_writes`` gives the same blocks per planned step.

    Attributes:
        working_block_id: the running state block.
        checkpoint_block_id, checkpoint_position: 0 (the 0.x ALIGN_LAZY private checkpoint is
            gone; kept so that 0.x callers still unpack the tuple).
        spare_block_id: ``latest``'s checkpoint waiting for its ``retire`` (a copy made at
            verify, see :mod:`mambakv.groups.decode_checkpoints`), 0 when none.
        scratch_block_ids: draft states, ``scratch_block_ids[k]`` = state after draft ``k + 1``.
        write_target: None (no forward writes a checkpoint block any more; kept for 0.x callers).
    """

    working_block_id: int
    checkpoint_block_id: int
    checkpoint_position: int
    spare_block_id: int
    scratch_block_ids: tuple[int, ...]
    write_target: tuple[int, int] | None


class TableView(NamedTuple):
    """A read-only snapshot of one request's table in one group (``describe``).

    ``running_slot`` is -1 and the Mamba fields are empty for attention groups."""

    group_id: int
    block_ids: tuple[int, ...]
    num_cached_blocks: int
    retired_below: int
    running_slot: int = -1
    num_tokens: int = 0
    positions: tuple[tuple[int, int], ...] = ()          # (slot, position) of unsettled states
    verify_steps: tuple[tuple[int, int, int], ...] = ()  # (slot, tokens, drafts) awaiting accept_drafts
    verified: tuple[tuple[int, int], ...] = ()           # (position, slot) of verified states above their slot
    had_drafts: bool = False                             # a step with drafts was ever scheduled


class RequestView(NamedTuple):
    """A read-only snapshot of one live request (``KVCacheCoordinator.describe``).

    Attributes:
        request_id, num_tokens: the request's id and prompt + output tokens.
        num_scheduled: the most tokens any ``allocate`` covered (``retire`` may not pass it).
        tables: one :class:`TableView` per group, config order.
    """

    request_id: str
    num_tokens: int
    num_scheduled: int
    tables: tuple[TableView, ...]


class TieredHit(NamedTuple):
    """A prefix hit over both tiers (``get_computed_blocks_tiered``).

    Attributes:
        blocks: the GPU part, per group (what ``get_computed_blocks`` returns).
        num_gpu_tokens: its tokens.
        num_host_tokens: tokens past it that the host tier supplies (whole units only: every page
            up to the hit and the state at it); 0 when the host adds nothing or no GPU room is free.
        load: the load that brings them to the GPU (None when ``num_host_tokens`` is 0). The
            request is ready only after ``complete_load``; then ``get_computed_blocks`` returns
            the whole hit.
    """

    blocks: KVCacheBlocks
    num_gpu_tokens: int
    num_host_tokens: int
    load: LoadPlan | None

    @property
    def num_computed_tokens(self) -> int:
        return self.num_gpu_tokens + self.num_host_tokens
