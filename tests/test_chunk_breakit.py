"""Bugs found by trying to break the chunk-path / one-pass pool change (a2cd9b5..): each test
states the expected value worked out by hand and fails on the code before its fix."""

from __future__ import annotations

import pytest

from mambakv import BlockPool, KVCacheBlock
from mambakv.core.pool_fused import cache_then_free, free_then_get, get_then_cache

H = [bytes([i]) * 16 for i in range(8)]


def _map(pool: BlockPool) -> dict:
    return {g: {h: (e.block_id if isinstance(e, KVCacheBlock) else sorted(e)) for h, e in m.items()}
            for g, m in pool.cached_block_hash_to_block.items()}


def plant_noting(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, note) -> list:  # type: ignore[no-untyped-def]
    """Plant a rule on `cls` itself (as the teeth tests do): ``cls.name`` notes ``note(*args)``
    in the returned list, then runs the original."""
    seen: list = []
    own = getattr(cls, name)

    def noting(self, *args):  # type: ignore[no-untyped-def]
        seen.append(note(*args))
        return own(self, *args)

    monkeypatch.setattr(cls, name, noting)
    return seen


def test_fused_forms_make_the_two_calls_when_blockpool_itself_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A teeth test plants its rule on BlockPool itself (tests/property/test_teeth.py:
    ``monkeypatch.setattr(BlockPool, "free_blocks", ...)``); the one-pass forms must then make
    the ordinary (planted) calls. Hand count, pool of 6: block 1 taken; ``free_then_get([1],
    1)`` frees 1 through the planted call (to the head) and pops it back. Blocks 2, 3 taken;
    ``cache_then_free([2], H0, (0,), [3])`` publishes 2 and frees 3 through the planted call.
    ``get_then_cache`` declines (None): the caller makes the two calls. (fused_calls compared
    the class against BlockPool itself, so a rule planted on BlockPool was never seen.)"""
    seen = plant_noting(monkeypatch, BlockPool, "free_blocks", lambda blocks: [b.block_id for b in blocks])
    pool = BlockPool(6)
    assert not pool.fused_calls
    b1 = pool.get_new_blocks(1)
    got = free_then_get(pool, b1, 1)
    assert got is not None and [b.block_id for b in got] == [1]
    assert seen == [[1]]
    held = pool.get_new_blocks(2)
    assert [b.block_id for b in held] == [2, 3]
    cache_then_free(pool, [held[0]], H[0], (0,), [held[1]])
    assert seen == [[1], [3]]
    assert _map(pool) == {0: {H[0]: 2}}
    assert get_then_cache(pool, 2, H[1:3], 0) is None
    pool.check_invariants()


def test_fused_calls_still_true_for_a_plain_pool_after_a_patch_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as mp:
        mp.setattr(BlockPool, "get_new_blocks", lambda self, n: [])
        assert not BlockPool(4).fused_calls
    assert BlockPool(4).fused_calls


def test_cache_then_free_with_a_state_listed_twice_equals_cache_state_blocks() -> None:
    """A misuse the two calls absorb: one block given as the state of groups 0 and 1 (both
    groups already have a map). ``cache_state_blocks`` publishes it in group 0 only (a block
    carries one hash and one group; the second entry is skipped as already hashed). The
    inlined map insert of ``cache_then_free`` used to map it in group 1 as well and move its
    group to 1: group 0's map then held a block of group 1 (check_invariants: mapped wrongly).
    Hand count, pool of 6: blocks 1, 2, 3 taken; 3 under Y in group 0, 2 under Z in group 1;
    then block 1 under X for groups (0, 1) -> {0: {Y: 3, X: 1}, 1: {Z: 2}}, block 1 in group 0."""
    x, y, z = b"x" * 16, b"y" * 16, b"z" * 16
    maps = []
    for fused in (True, False):
        pool = BlockPool(6)
        b = pool.get_new_blocks(3)
        pool.cache_full_blocks([b[2]], [y], 0)
        pool.cache_full_blocks([b[1]], [z], 1)
        if fused:
            cache_then_free(pool, [b[0], b[0]], x, (0, 1), [])
        else:
            pool.cache_state_blocks([b[0], b[0]], x, (0, 1))
        assert _map(pool) == {0: {y: 3, x: 1}, 1: {z: 2}}, fused
        assert b[0].block_hash == x and b[0].cache_group_id == 0
        pool.check_invariants()
        maps.append(_map(pool))
    assert maps[0] == maps[1]


def test_chunk_path_honours_a_rule_planted_on_mamba_manager_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The teeth test ``test_fuzzer_catches_stop_at_first_null_retirement`` plants
    ``MambaManager.retire_slots`` on the class itself; the chunk retire (which stands in for
    ``retire_slots``) must then step aside, as for a subclass. Hand count: FA 16 + Mamba 16
    (nspec 0), prompt 100: admission to 32, chunk to 64, retire 64: the Mamba group retires
    ``(64 - 1) // 16 = 3`` slots through the planted call, once. (``chunks`` compared the class
    with MambaManager itself: True, and the chunk retire bypassed the planted rule.)"""
    from mambakv import Request
    from mambakv.groups import MambaManager
    from tests.coord_helpers import coordinator, fa_spec
    from tests.helpers import mamba_spec

    seen = plant_noting(monkeypatch, MambaManager, "retire_slots", lambda table, num_slots: num_slots)
    c = coordinator(40, fa_spec(16), mamba_spec(16, 0), max_model_len=2048)
    assert not any(m.chunks for m in c.mamba_managers)
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 64
    c.retire("a", 64)
    assert seen == [3]
    c.check_invariants()


def test_chunk_path_honours_a_rule_planted_on_the_base_manager_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for an attention policy: a rule planted on SingleTypeKVCacheManager's
    ``allocate_new_blocks`` turns the attention chunk path off."""
    from mambakv.groups.base import SingleTypeKVCacheManager
    from tests.coord_helpers import coordinator, fa_spec

    own = SingleTypeKVCacheManager.allocate_new_blocks
    monkeypatch.setattr(SingleTypeKVCacheManager, "allocate_new_blocks",
                        lambda self, *a, **k: own(self, *a, **k))
    c = coordinator(40, fa_spec(16), max_model_len=2048)
    assert not any(m.chunks for m in c.managers)


def test_chunk_path_honours_a_planted_attention_cache_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cache_blocks`` is one of the general-path steps the attention chunk stands in for
    (``get_then_cache`` publishes without it, and the coordinator no longer calls it when every
    policy returned its counts), so a rule planted on it must turn the chunk path off. Hand
    count: FA 16, prompt 100: admission to 32 publishes 2 blocks, the chunk to 64 two more:
    the planted call sees num_tokens 32, then 64, and the table is published to 4 blocks."""
    from mambakv import Request
    from mambakv.groups.base import SingleTypeKVCacheManager
    from tests.coord_helpers import coordinator, fa_spec

    seen = plant_noting(monkeypatch, SingleTypeKVCacheManager, "cache_blocks", lambda request, num_tokens: num_tokens)
    c = coordinator(40, fa_spec(16), max_model_len=2048)
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.allocate(req, 32, num_draft_tokens=0)
    assert seen == [32, 64]
    view = c.describe("a")
    assert view is not None and view.tables[0].num_cached_blocks == 4


def test_the_coordinator_copy_drain_calls_a_take_copy_plan_planted_on_mambamanager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator drains the Mamba managers' copy lists itself while they keep
    MambaManager's own ``take_copy_plan``; a rule planted on the class must still be called.
    Hand count: one Mamba group (block 4, no scratch), 6-token prompt, allocate 4 then 2 more:
    the second step moves the running state to a new block (copy 1 -> 2); the planted rule
    adds (7, 7)."""
    from mambakv import MambaManager, Request
    from tests.coord_helpers import mamba_coordinator, step, tokens

    own = MambaManager.take_copy_plan
    monkeypatch.setattr(MambaManager, "take_copy_plan", lambda self: [*own(self), (7, 7)])
    coord = mamba_coordinator(4)
    req = Request("r", tokens(6))
    step(coord, req, 4, num_draft_tokens=0)
    coord.take_copy_plan()
    step(coord, req, 2, num_draft_tokens=0)
    assert coord.take_copy_plan() == {0: [(1, 2), (7, 7)]}
