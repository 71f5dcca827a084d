"""Old module paths (mambakv 0.1) stay importable and name the same objects as the new ones."""

from __future__ import annotations

import importlib

import pytest

import mambakv

OLD_TO_NEW = {
    "mambakv.errors": ("mambakv.core.errors", "MambaKVError"),
    "mambakv.block": ("mambakv.core.block", "KVCacheBlock"),
    "mambakv.block_pool": ("mambakv.core.block_pool", "BlockPool"),
    "mambakv.kv_events": ("mambakv.core.events", "BlockStored"),
    "mambakv.hashing": ("mambakv.core.hashing", "hash_block_tokens"),
    "mambakv.request": ("mambakv.core.request", "Request"),
    "mambakv.spec": ("mambakv.core.spec", "MambaSpec"),
    "mambakv.prefix_hits": ("mambakv.hits", "KVCacheBlocks"),
    "mambakv.managers": ("mambakv.groups", "MambaManager"),
    "mambakv.managers.base": ("mambakv.groups.base", "SingleTypeKVCacheManager"),
    "mambakv.managers.mamba": ("mambakv.groups.mamba", "MambaManager"),
    "mambakv.state_pool": ("mambakv.device.state_pool", "MambaStatePool"),
    "mambakv.layout": ("mambakv.device.layout", "HybridLayout"),
}


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_old_module_path_reexports_the_new_objects(old: str) -> None:
    new, name = OLD_TO_NEW[old]
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_top_level_names_and_old_paths_agree() -> None:
    from mambakv.block_pool import BlockPool
    from mambakv.coordinator import KVCacheCoordinator
    from mambakv.sim import RequestSpec, Scheduler  # noqa: F401

    assert mambakv.BlockPool is BlockPool and mambakv.KVCacheCoordinator is KVCacheCoordinator


#: public names each 0.1 module had, defined there or imported into it (from the 0.1 sources),
#: less the ones removed on purpose (LazyMambaManager, allocate_hybrid_layout, coarse_block_hashes)
OLD_NAMES = {
    "mambakv.block_pool": ["AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "DoubleFreeError",
                           "FreeBlockQueue", "InvalidBlockError", "InvalidTokenCountError", "KVCacheBlock",
                           "KVCacheEvent", "OutOfBlocksError"],
    "mambakv.managers": ["BlockPool", "FullAttentionSpec", "InvalidSpecError", "KVCacheSpec", "MambaCacheMode",
                         "MambaManager", "MambaSpec", "SlidingWindowSpec", "make_manager"],
    "mambakv.managers.base": ["BlockHashView", "BlockPool", "HashBlockSizeMismatchError", "InvalidTokenCountError",
                              "KVCacheBlock", "KVCacheSpec", "Request", "RequestBlocks", "SingleTypeKVCacheManager",
                              "cdiv", "group_block_hashes"],
    "mambakv.managers.mamba": ["BlockPool", "InvalidDraftCountError", "InvalidTokenCountError", "KVCacheBlock",
                               "KVCacheSpec", "MambaCacheMode", "MambaManager", "MambaSpec", "Request",
                               "RequestBlocks", "SingleTypeKVCacheManager", "as_count", "cdiv", "group_block_hashes"],
    "mambakv.state_pool": ["DTYPE_SIZES", "InvalidCopyPlanError", "InvalidSpecError", "MambaSpec", "MambaStatePool",
                           "carve_state_views", "default_device", "export_block_table", "export_block_tables",
                           "torch_dtype"],
    "mambakv.layout": ["DTYPE_SIZES", "AttentionSpec", "HybridLayout", "InvalidSpecError", "KVCacheConfig",
                       "MambaSpec", "MambaStatePool", "carve_state_views", "check_uniform_page_size",
                       "default_device", "torch_dtype"],
}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_old_module_path_keeps_the_01_names(old: str) -> None:
    """``from mambakv.block_pool import FreeBlockQueue`` and the like, which 0.1 code could write."""
    module = importlib.import_module(old)
    assert [n for n in OLD_NAMES[old] if not hasattr(module, n)] == []


def test_old_managers_package_has_its_modules_as_attributes() -> None:
    """0.1's ``mambakv/managers/__init__.py`` imported its modules: ``import mambakv.managers``
    then ``mambakv.managers.mamba.MambaManager`` worked. (A fresh interpreter: in this one an
    earlier import of a submodule sets the attribute anyway.)"""
    import subprocess
    import sys

    code = ("import mambakv, mambakv.managers as m; "
            "assert m.mamba.MambaManager is mambakv.MambaManager; "
            "assert m.base.SingleTypeKVCacheManager is mambakv.SingleTypeKVCacheManager; "
            "assert m.attention.FullAttentionManager is mambakv.FullAttentionManager")
    subprocess.run([sys.executable, "-c", code], check=True)
