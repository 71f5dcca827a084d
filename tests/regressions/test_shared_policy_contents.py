"""Defect 1 of the one-path restructure: a Mamba policy shared by identical groups decided
"advance the running state in place" or "grow a new block" from its first column only.

With ``decode_checkpoints="latest"`` or ``"none"`` a 16-token prompt retired at 16 publishes the
state after 16 tokens in both Mamba groups (each group's running block). When only group 1's
copy is evicted (``block_pool.evict_blocks``), group 2's running block is still cached under the
key of 16: the next decode step must not let the forward write the state after 17 into it. The
test tracks what every state block holds (a content oracle fed by the plans) and checks that a
later request hitting 16 is handed the state after exactly 16 tokens, in both layouts.
"""

from __future__ import annotations

import pytest

from mambakv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
)
from mambakv.core.arena import SuperblockGeometry
from tests.helpers import STATE_DTYPES, STATE_SHAPES

BS = 16


class Contents:
    """What each Mamba state block holds: tokens the state has seen (-1: unknown). Fed by
    ``take_step_plan`` in device order: pre-forward copies, zeros, then the forward's writes."""

    def __init__(self, coord: KVCacheCoordinator) -> None:
        self.coord = coord
        self.mamba = {m.kv_cache_group_id for m in coord.mamba_managers}
        self.held: dict[tuple[int, int], int] = {}

    def run_step(self) -> None:
        plan = self.coord.take_step_plan()
        for g in plan.groups:
            if g.group_id not in self.mamba:
                continue
            for src, dst in g.copies:
                self.held[(g.group_id, dst)] = self.held.get((g.group_id, src), -1)
            for b in g.zeros:
                self.held[(g.group_id, b)] = 0
            for _rid, block, position in g.checkpoint_writes:
                self.held[(g.group_id, block)] = position

    def of(self, gid: int, block_id: int) -> int:
        return self.held.get((gid, block_id), -1)


def build(layout: str, checkpoints: str) -> KVCacheCoordinator:
    attn = FullAttentionSpec(BS, num_kv_heads=1, head_size=8, dtype="bfloat16")
    mamba = MambaSpec(BS, STATE_SHAPES, STATE_DTYPES, mode="align", decode_checkpoints=checkpoints)
    groups = [KVCacheGroupSpec(["a"], attn), KVCacheGroupSpec(["m1"], mamba), KVCacheGroupSpec(["m2"], mamba)]
    if layout == "unified":
        config = KVCacheConfig(40, groups)
    else:  # one page a superblock (512 B of KV per page, a 176 B state slot fits)
        geo = SuperblockGeometry(40, 1, attn.page_size_bytes, mamba.raw_page_size_bytes)
        config = KVCacheConfig(geo.num_pages, groups, geo)
    return KVCacheCoordinator(config, max_model_len=256)


@pytest.mark.parametrize("layout", ["unified", "decoupled"])
@pytest.mark.parametrize("checkpoints", ["latest", "none"])
def test_a_hit_on_a_state_evicted_in_one_group_gets_the_state_at_16(layout: str, checkpoints: str) -> None:
    coord = build(layout, checkpoints)
    oracle = Contents(coord)
    g1, g2 = 1, 2
    prompt = list(range(100, 116))  # 16 tokens: one block
    a = Request("a", prompt)
    assert coord.allocate(a, 16, num_draft_tokens=0) is not None
    oracle.run_step()
    a.num_computed_tokens = 16
    coord.retire("a", 16)  # publishes the state after 16 in both groups (their running blocks)
    key = a.block_hashes[0]
    pool = coord.state_block_pool
    s1, s2 = (pool.get_cached_block(key, [g])[0] for g in (g1, g2))  # type: ignore[index]
    assert oracle.of(g1, s1.block_id) == 16 and oracle.of(g2, s2.block_id) == 16
    pool.evict_blocks([s1.block_id])  # group 1's copy only
    a.append_output_token_ids([7])
    assert coord.allocate(a, 1, num_draft_tokens=0) is not None  # decode: 17 tokens
    plan = coord.take_step_plan()
    writes = {(g.group_id, b) for g in plan.groups for _, b, _ in g.checkpoint_writes}
    assert (g2, s2.block_id) not in writes, "the forward writes a state that is still cached"
    for g in plan.groups:  # feed the oracle the plan just taken
        for src, dst in g.copies:
            oracle.held[(g.group_id, dst)] = oracle.of(g.group_id, src)
        for _, b, p in g.checkpoint_writes:
            oracle.held[(g.group_id, b)] = p
    assert oracle.of(g2, s2.block_id) == 16
    coord.check_invariants()
    # C publishes 16 again in both groups (group 2 now has two copies under one key)
    c = Request("c", prompt + [1, 2, 3, 4])
    assert coord.get_computed_blocks(c)[1] == 0  # group 1 lacks the state: no hit
    assert coord.allocate(c, 16, num_draft_tokens=0) is not None
    oracle.run_step()
    c.num_computed_tokens = 16
    coord.retire("c", 16)
    # D hits 16 and must be handed the state after exactly 16 tokens in every Mamba group
    d = Request("d", prompt + [5, 6, 7])
    blocks, n = coord.get_computed_blocks(d)
    assert n == 16
    for gid in (g1, g2):
        hit = blocks.blocks[gid][-1]
        assert oracle.of(gid, hit.block_id) == 16, (gid, hit.block_id)
    coord.check_invariants()


def test_a_partial_state_on_another_chains_interior_node_is_dropped_at_free() -> None:
    """Defect 2: a state published in some Mamba groups only (one group's copy was evicted
    while the request held it) can never hit; when the request is freed it must go from every
    group, also where its page is an interior node of another chain. Hand count, block 16,
    decoupled: Y prefills 64 tokens of prompt P (one chunk), is retired and freed: the unit
    tree holds pages 0..3, one unit at page 3 (state at 64). A = P[:32] + 20 other tokens
    (no Mamba hit: Y's only state is at 64) prefills to 16, 32 (retiring after each: the
    states at 16 and 32 are published in both groups), then group 1's copy of the state at 32
    is evicted while A still holds it, then A prefills to 52 and retires (its slots 0..2
    retire) and is freed. A's deepest state in every group is at 16 (page 0); page 1 (the
    state at 32, group 2 only) is Y's interior node. After the free no Mamba group caches
    the state at 32, and the unit invariants hold (before the fix: "a free cached state
    without its unit")."""
    coord = build("decoupled", "every")
    prompt = list(range(300, 370))
    y = Request("y", prompt)
    assert coord.allocate(y, 64, num_draft_tokens=0) is not None
    y.num_computed_tokens = 64
    coord.retire("y", 64)
    coord.free("y")
    coord.check_invariants()
    a = Request("a", prompt[:32] + list(range(900, 920)))
    assert coord.get_computed_blocks(a)[1] == 0
    for end in (16, 32):
        assert coord.allocate(a, end - a.num_computed_tokens, num_draft_tokens=0) is not None
        a.num_computed_tokens = end
        coord.retire("a", end)
        coord.check_invariants()
    key32 = a.block_hashes[1]
    pool = coord.state_block_pool
    both = [pool.get_cached_block(key32, [g]) for g in (1, 2)]
    assert all(b is not None for b in both)
    pool.evict_blocks([both[0][0].block_id])  # type: ignore[index]  # group 1's copy, held by A
    coord.check_invariants()
    assert coord.allocate(a, 52 - 32, num_draft_tokens=0) is not None
    a.num_computed_tokens = 52
    coord.retire("a", 52)
    coord.free("a")
    assert pool.get_cached_block(key32, [1]) is None and pool.get_cached_block(key32, [2]) is None
    assert coord.units is not None and coord.units.has_page(key32) and coord.units.unit_at(key32) is None  # Y's interior node stays
    coord.check_invariants()
