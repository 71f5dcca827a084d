"""One manager per KV-cache group; the spec's kind (:class:`GroupKind`) picks the manager class."""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.block_pool import BlockPool
from mambakv.core.spec import KVCacheSpec
from mambakv.groups.attention import FullAttentionManager, SlidingWindowManager
from mambakv.groups.base import (
    BlockHashView,
    BlockTable,
    SingleTypeKVCacheManager,
    cdiv,
    group_block_hashes,
)
from mambakv.groups.kinds import GroupKind
from mambakv.groups.mamba import MambaManager
from mambakv.groups.mamba_table import AlignStep, MambaTable, running_slot

__all__ = [
    "AlignStep", "BlockHashView", "BlockTable", "FullAttentionManager", "GroupKind", "MambaManager", "MambaTable",
    "SingleTypeKVCacheManager", "SlidingWindowManager", "cdiv", "group_block_hashes", "make_manager",
    "manager_class_for", "running_slot", "share_identical_policies",
]

_MANAGER_FOR_KIND: dict[GroupKind, type[SingleTypeKVCacheManager]] = {
    GroupKind.FULL_ATTENTION: FullAttentionManager,
    GroupKind.SLIDING_WINDOW: SlidingWindowManager,
    GroupKind.MAMBA: MambaManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for `spec`. Raises InvalidSpecError for an unknown spec type."""
    return _MANAGER_FOR_KIND[GroupKind.of(spec)]


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0, spare_may_evict: bool = False) -> SingleTypeKVCacheManager:
    """Build the manager of one group. `spare_may_evict`: Mamba groups with
    ``decode_checkpoints="latest"`` may evict a cached block for a decode checkpoint (a benchmark knob)."""
    m = manager_class_for(spec)(spec, block_pool, enable_caching=enable_caching, kv_cache_group_id=kv_cache_group_id)
    if isinstance(m, MambaManager):
        m.spare_may_evict = spare_may_evict
    return m


def share_identical_policies(managers: Sequence[SingleTypeKVCacheManager]) -> tuple[SingleTypeKVCacheManager, ...]:
    """Let Mamba groups with an identical spec share one policy (the first one's): their
    tables evolve in lockstep, so per-request work is done once for every block column (a
    Qwen3-Next step does it once, not three times). Returns the managers that run a policy,
    config order. Attention groups keep one policy each. Only managers of exactly
    :class:`MambaManager` share (a subclass keeps its own rules)."""
    leaders: dict[object, list[MambaManager]] = {}
    for m in managers:
        if type(m) is MambaManager:
            leaders.setdefault(m.kv_cache_spec, []).append(m)
    for same in leaders.values():
        if len(same) > 1:
            same[0].share_policy(same[1:])
    return tuple(m for m in managers if not m.is_follower)
