"""One manager per KV-cache group; the spec's type picks the manager class."""

from __future__ import annotations

from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import FullAttentionSpec, KVCacheSpec, MambaCacheMode, MambaSpec, SlidingWindowSpec
from mambakv.groups.attention import FullAttentionManager, SlidingWindowManager
from mambakv.groups.base import RequestBlocks, SingleTypeKVCacheManager, cdiv
from mambakv.groups.lazy_state import StatePlan
from mambakv.groups.mamba import MambaManager, MambaRequestBlocks, running_slot
from mambakv.groups.mamba_lazy import LazyMambaManager

_MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for `spec` (a MambaSpec in mode ALIGN_LAZY gets LazyMambaManager).
    Raises InvalidSpecError for an unknown spec type."""
    if type(spec) is MambaSpec and spec.mode is MambaCacheMode.ALIGN_LAZY:
        return LazyMambaManager
    for spec_type, cls in _MANAGER_FOR_SPEC.items():
        if type(spec) is spec_type:
            return cls
    raise InvalidSpecError(f"no manager for spec type {type(spec).__name__}")


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
    return cls(spec, block_pool, enable_caching=enable_caching,  # type: ignore[arg-type]
                                   kv_cache_group_id=kv_cache_group_id)


__all__ = [
    "FullAttentionManager", "LazyMambaManager", "MambaManager", "MambaRequestBlocks", "RequestBlocks", "SingleTypeKVCacheManager",
    "SlidingWindowManager", "StatePlan", "cdiv", "make_manager", "manager_class_for", "running_slot",
]
