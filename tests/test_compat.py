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
