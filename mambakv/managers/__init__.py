"""One manager per KV-cache group; the spec's type picks the manager class."""

from __future__ import annotations

from mambakv.block_pool import BlockPool
from mambakv.errors import InvalidSpecError
from mambakv.managers.attention import FullAttentionManager, SlidingWindowManager
from mambakv.managers.base import RequestBlocks, SingleTypeKVCacheManager, cdiv
from mambakv.managers.mamba import MambaManager, MambaRequestBlocks, running_slot
from mambakv.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

_MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for `spec`. Raises InvalidSpecError for an unknown spec type."""
    for spec_type, cls in _MANAGER_FOR_SPEC.items():
        if type(spec) is spec_type:
            return cls
    raise InvalidSpecError(f"no manager for spec type {type(spec).__name__}")


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0) -> SingleTypeKVCacheManager:
    """Build the manager of one group."""
    return manager_class_for(spec)(spec, block_pool, enable_caching=enable_caching,  # type: ignore[arg-type]
                                   kv_cache_group_id=kv_cache_group_id)


__all__ = [
    "FullAttentionManager", "MambaManager", "MambaRequestBlocks", "RequestBlocks", "SingleTypeKVCacheManager",
    "SlidingWindowManager", "cdiv", "make_manager", "manager_class_for", "running_slot",
]
