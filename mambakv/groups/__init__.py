"""One manager per KV-cache group; the spec's kind (:class:`GroupKind`) picks the manager class."""

from __future__ import annotations

from mambakv.core.block_pool import BlockPool
from mambakv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec
from mambakv.groups.attention import FullAttentionManager, SlidingWindowManager
from mambakv.groups.base import (
    BlockHashView,
    BlockTable,
    RequestBlocks,
    SingleTypeKVCacheManager,
    cdiv,
    group_block_hashes,
)
from mambakv.groups.kinds import GroupKind
from mambakv.groups.lazy_state import StatePlan
from mambakv.groups.mamba import AlignStep, MambaManager, MambaRequestBlocks, MambaTable, running_slot
from mambakv.groups.mamba_lazy import LazyMambaManager

_MANAGER_FOR_KIND: dict[GroupKind, type[SingleTypeKVCacheManager]] = {
    GroupKind.FULL_ATTENTION: FullAttentionManager,
    GroupKind.SLIDING_WINDOW: SlidingWindowManager,
    GroupKind.MAMBA: MambaManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for `spec` (a MambaSpec in mode ALIGN_LAZY gets LazyMambaManager).
    Raises InvalidSpecError for an unknown spec type."""
    if isinstance(spec, MambaSpec) and spec.mode is MambaCacheMode.ALIGN_LAZY:
        return LazyMambaManager
    return _MANAGER_FOR_KIND[GroupKind.of(spec)]


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0, max_num_seqs: int = 256,
                 spare_may_evict: bool = False) -> SingleTypeKVCacheManager:
    """Build the manager of one group. `max_num_seqs` and `spare_may_evict` matter to lazy
    Mamba groups only (their scratch region and spare policy, see mamba_lazy.py)."""
    cls = manager_class_for(spec)
    if cls is LazyMambaManager:
        return LazyMambaManager(spec, block_pool, enable_caching=enable_caching,  # type: ignore[arg-type]
                                kv_cache_group_id=kv_cache_group_id, max_num_seqs=max_num_seqs,
                                spare_may_evict=spare_may_evict)
    return cls(spec, block_pool, enable_caching=enable_caching, kv_cache_group_id=kv_cache_group_id)


__all__ = [
    "AlignStep", "BlockHashView", "BlockTable", "FullAttentionManager", "GroupKind", "LazyMambaManager",
    "MambaManager", "MambaRequestBlocks", "MambaTable", "RequestBlocks", "SingleTypeKVCacheManager",
    "SlidingWindowManager", "StatePlan", "cdiv", "group_block_hashes", "make_manager", "manager_class_for",
    "running_slot",
]
