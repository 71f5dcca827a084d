"""Rules planted on a class or an instance are always called: there is one implementation of
every step, so a subclass, a monkeypatched class or a patched instance changes what the
coordinator does (the fuzzer's teeth rely on it). Each test states the value worked out by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mambakv import BlockPool, KVCacheBlock, MambaManager, Request
from mambakv.groups import SingleTypeKVCacheManager
from tests.coord_helpers import coordinator, fa_spec, mamba_coordinator, step, tokens
from tests.helpers import mamba_spec


def _map(pool: BlockPool) -> dict:
    return {g: {h: (e.block_id if isinstance(e, KVCacheBlock) else sorted(e)) for h, e in m.items()}
            for g, m in pool.cached_block_hash_to_block.items()}


def plant_noting(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, note: Callable[..., object]) -> list:
    """Plant a rule on `cls` itself (as the teeth tests do): ``cls.name`` notes ``note(*args)``
    in the returned list, then runs the original."""
    seen: list = []
    own = getattr(cls, name)

    def noting(self, *args):  # type: ignore[no-untyped-def]
        seen.append(note(*args))
        return own(self, *args)

    monkeypatch.setattr(cls, name, noting)
    return seen


def test_a_free_planted_on_blockpool_sees_every_retire(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand count: FA 16 + Mamba 16 (nspec 0), prompt 100. Admission to 32: FA 1 2, Mamba
    [0 R=3]. Chunk to 64: FA 4 5, Mamba [0 3 0 R=6], copy 3 -> 6. Retire 64 frees the Mamba
    state at 32 (slot 1, block 3; slot 0 is null): one planted free of [3]."""
    seen = plant_noting(monkeypatch, BlockPool, "free_blocks", lambda blocks: [b.block_id for b in blocks])
    c = coordinator(40, fa_spec(16), mamba_spec(16, 0), max_model_len=2048)
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 64
    c.retire("a", 64)
    assert seen == [[3]]
    assert c.get_block_ids("a") == ([1, 2, 4, 5], [0, 0, 0, 6])
    c.check_invariants()


def test_a_state_listed_twice_is_published_once() -> None:
    """A misuse ``cache_state_blocks`` absorbs: one block given as the state of groups 0 and 1
    (both groups already have a map) is published in group 0 only (a block carries one hash
    and one group; the second entry is skipped as already hashed). Hand count, pool of 6:
    blocks 1, 2, 3 taken; 3 under Y in group 0, 2 under Z in group 1; then block 1 under X for
    groups (0, 1) -> {0: {Y: 3, X: 1}, 1: {Z: 2}}, block 1 in group 0."""
    x, y, z = b"x" * 16, b"y" * 16, b"z" * 16
    pool = BlockPool(6)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks([b[2]], [y], 0)
    pool.cache_full_blocks([b[1]], [z], 1)
    pool.cache_state_blocks([b[0], b[0]], x, (0, 1))
    assert _map(pool) == {0: {y: 3, x: 1}, 1: {z: 2}}
    assert b[0].block_hash == x and b[0].cache_group_id == 0
    pool.check_invariants()


def test_a_retire_slots_planted_on_mamba_manager_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """The teeth test ``test_fuzzer_catches_stop_at_first_null_retirement`` plants
    ``MambaManager.retire_slots`` on the class itself. Hand count: FA 16 + Mamba 16 (nspec 0),
    prompt 100: admission to 32, chunk to 64, retire 64: the Mamba group retires
    ``(64 - 1) // 16 = 3`` slots through the planted call, once."""
    seen = plant_noting(monkeypatch, MambaManager, "retire_slots", lambda table, num_slots: num_slots)
    c = coordinator(40, fa_spec(16), mamba_spec(16, 0), max_model_len=2048)
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 64
    c.retire("a", 64)
    assert seen == [3]
    c.check_invariants()


def test_a_cache_blocks_planted_on_the_base_manager_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand count: FA 16, prompt 100: admission to 32 publishes 2 blocks, the chunk to 64 two
    more: the planted call sees num_tokens 32, then 64, and the table is published to 4 blocks."""
    seen = plant_noting(monkeypatch, SingleTypeKVCacheManager, "cache_blocks", lambda request, num_tokens: num_tokens)
    c = coordinator(40, fa_spec(16), max_model_len=2048)
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.allocate(req, 32, num_draft_tokens=0)
    assert seen == [32, 64]
    view = c.describe("a")
    assert view is not None and view.tables[0].num_cached_blocks == 4


def test_a_take_copy_plan_planted_on_mamba_manager_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand count: one Mamba group (block 4, no scratch), 6-token prompt, allocate 4 then 2 more:
    the second step moves the running state to a new block (copy 1 -> 2); the planted rule
    adds (7, 7)."""
    own = MambaManager.take_copy_plan
    monkeypatch.setattr(MambaManager, "take_copy_plan", lambda self: [*own(self), (7, 7)])
    coord = mamba_coordinator(4)
    req = Request("r", tokens(6))
    step(coord, req, 4, num_draft_tokens=0)
    coord.take_copy_plan()
    step(coord, req, 2, num_draft_tokens=0)
    assert coord.take_copy_plan() == {0: [(1, 2), (7, 7)]}


def test_a_rule_planted_on_one_instance_is_called() -> None:
    """An instance's own attribute wins over its class: a coordinator's Mamba policy with a
    ``retire_slots`` that retires nothing keeps the state at 32 (slot 1, block 3) after the
    retire to 64 (hand count as above)."""
    c = coordinator(40, fa_spec(16), mamba_spec(16, 0), max_model_len=2048)
    m = c.mamba_managers[0]
    m.retire_slots = lambda table, num_slots: None  # type: ignore[method-assign]
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 64
    c.retire("a", 64)
    assert c.get_block_ids("a")[1] == [0, 3, 0, 6]
