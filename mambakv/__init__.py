"""mambakv: a KV-cache and Mamba-state block manager for LLM inference engines.

The core (blocks .. coordinator) does not import torch; ``MambaStatePool`` (which does) is
imported lazily on first access.
"""

from __future__ import annotations

from typing import Any

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.block import FreeBlockQueue, KVCacheBlock
from mambakv.core.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from mambakv.core.engine_request import EngineRequest
from mambakv.core.errors import (
    BlockNotFreeError,
    DoubleFreeError,
    HashBlockSizeMismatchError,
    InvalidBlockError,
    InvalidClockError,
    InvalidCopyPlanError,
    InvalidDraftCountError,
    InvalidFenceError,
    InvalidHashError,
    InvalidRequestError,
    InvalidSpecError,
    InvalidTokenCountError,
    LoadPendingError,
    MambaKVError,
    ModelConfigError,
    OutOfBlocksError,
    ReadOnlyResultError,
    StaleCacheHitError,
    TraceFormatError,
    UnsupportedEngineError,
)
from mambakv.core.hashing import hash_block_tokens, init_none_hash
from mambakv.core.host_tier import HostTierSpec, HostWrite
from mambakv.core.request import Request
from mambakv.core.spec import (
    DecodeCheckpoints,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from mambakv.core.transfers import BlockKind, LoadPlan, Tier, Transfer, TransferPlan
from mambakv.groups import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from mambakv.hits import PrefixCacheStats
from mambakv.plans import KVCacheBlocks, StatePlan, TieredHit

__version__ = "0.1.0"

_LAZY = {"MambaStatePool": "mambakv.device.state_pool", "CopyBackend": "mambakv.device.state_pool"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mambakv' has no attribute {name!r}")


__all__ = [
    "AllBlocksCleared", "BlockKind", "BlockNotFreeError", "BlockPool", "BlockRemoved", "BlockStored", "CopyBackend", "DoubleFreeError",
    "EngineRequest",
    "FreeBlockQueue", "FullAttentionManager", "FullAttentionSpec", "HashBlockSizeMismatchError", "HostTierSpec", "HostWrite",
    "InvalidBlockError", "InvalidClockError", "InvalidCopyPlanError", "InvalidDraftCountError", "InvalidFenceError",
    "InvalidHashError", "InvalidRequestError", "InvalidSpecError", "InvalidTokenCountError", "KVCacheBlock", "KVCacheBlocks",
    "LoadPendingError", "LoadPlan",
    "DecodeCheckpoints", "KVCacheConfig", "KVCacheCoordinator", "KVCacheGroupSpec", "KVCacheSpec", "MambaCacheMode",
    "MambaKVError",
    "MambaManager", "MambaSpec", "MambaStatePool", "ModelConfigError", "OutOfBlocksError", "PrefixCacheStats", "ReadOnlyResultError",
    "Request", "SingleTypeKVCacheManager", "SlidingWindowManager", "SlidingWindowSpec", "StaleCacheHitError", "StatePlan",
    "Tier", "TieredHit", "TraceFormatError", "Transfer", "TransferPlan", "UnsupportedEngineError", "hash_block_tokens", "init_none_hash",
]
