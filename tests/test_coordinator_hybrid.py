"""Hybrid prefix hits (DESIGN.md 6): the fixed point over groups, EAGLE back-off, copy plans
per Mamba group, statistics, no caching and resetting the cache with requests running."""

from __future__ import annotations

from mambakv import FullAttentionSpec, KVCacheBlocks, KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, Request
from tests.coord_helpers import coordinator, fa_spec, mamba_coordinator, prefill, snapshot, step, sw_spec, tokens
from tests.helpers import mamba_spec


def hybrid(num_blocks: int = 64, **kw):
    """Full attention block 16 (group 0) + Mamba align block 64 (group 1): alignment lcm = 64."""
    return coordinator(num_blocks, fa_spec(16), mamba_spec(64), max_model_len=1000, **kw)


def prefill_200(coord):
    """A 200-token request prefilled in chunks ending at 128, 192, 200, retiring to the computed
    tokens before each later chunk and after the last, then freed. Mamba states:
    slot 1 (state at 128 = 2 * 64) published at retire(128), freed at retire(192);
    slot 2 (192 = 3 * 64) published at retire(192), freed at retire(200);
    slot 3 (state at 200, not a boundary) never published. Returns (FA blocks, M1, M2)."""
    a = Request("a", tokens(200))
    mamba = coord.managers[1]
    step(coord, a, 128)
    m1 = mamba.req_to_blocks["a"][1]
    coord.retire("a", 128)
    step(coord, a, 64)
    m2 = mamba.req_to_blocks["a"][2]
    coord.retire("a", 192)
    step(coord, a, 8)
    coord.retire("a", 200)
    fa = list(coord.managers[0].req_to_blocks["a"])
    coord.free("a")
    coord.take_copy_plan(), coord.take_zero_plan()  # the engine ran them with a's steps
    coord.check_invariants()
    return fa, m1, m2


def test_hybrid_hits_192_128_0():
    coord = hybrid()
    fa, m1, m2 = prefill_200(coord)
    null = coord.block_pool.null_block
    assert m1.block_hash is not None and m2.block_hash is not None and m1.ref_cnt == m2.ref_cnt == 0
    # 300 tokens sharing 192: cap 299 -> 256; FA: 12 shared full blocks = 192 (aligned);
    # Mamba at <= 192: slot 2 (the state at 192) -> fixed point 192.
    b = Request("b", tokens(192) + tokens(108, 5000))
    hit, n = coord.get_computed_blocks(b)
    assert n == 192
    assert hit.blocks[0] == fa[:12] and hit.blocks[1] == [null, null, m2]
    # 200 tokens sharing 150: cap 199 -> 192; FA: 150 // 16 = 9 blocks = 144 -> aligned 128;
    # Mamba at <= 128: slot 1, the retired but still cached state at 128.
    c = Request("c", tokens(150) + tokens(50, 6000))
    hit, n = coord.get_computed_blocks(c)
    assert n == 128 and hit.blocks[0] == fa[:8] and hit.blocks[1] == [null, m1]
    # 90 tokens sharing 40: FA 2 blocks = 32 -> aligned 0.
    before = snapshot(coord)
    d = Request("d", tokens(40) + tokens(50, 7000))
    assert coord.get_computed_blocks(d) == (KVCacheBlocks(([], [])), 0)
    assert snapshot(coord) == before  # lookups pin nothing
    # b allocates with its hit: 12 FA hits touched; Mamba table [null, null, M2, null, new]
    # (running slot cdiv(300, 64) - 1 = 4), M2 copied into the new running block.
    hit, n = coord.get_computed_blocks(b)
    step(coord, b, 108, num_new_computed_tokens=192, new_computed_blocks=hit)
    assert all(blk.ref_cnt == 1 for blk in fa[:12]) and m2.ref_cnt == 1
    mamba = coord.managers[1].req_to_blocks["b"]
    assert [blk.is_null for blk in mamba] == [True, True, False, True, False]
    assert coord.take_copy_plan() == {1: [(m2.block_id, mamba[4].block_id)]}
    assert coord.take_zero_plan() == {}


def test_prefix_cache_stats():
    # admissions: a 200 tokens / hit 0 (prefill_200), b 300 / 192, c 200 / 128, d 90 / 0
    coord = hybrid()
    coord.get_computed_blocks(Request("a", tokens(200)))  # a lookup alone counts nothing
    assert coord.prefix_cache_stats.requests == 0
    prefill_200(coord)
    for req in (Request("b", tokens(192) + tokens(108, 5000)), Request("c", tokens(150) + tokens(50, 6000)),
                Request("d", tokens(40) + tokens(50, 7000))):
        blocks, hit = coord.get_computed_blocks(req)
        coord.get_computed_blocks(req)  # a retried lookup counts nothing either
        assert coord.allocate(req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        coord.free(req.request_id)
    s = coord.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (4, 790, 320)
    assert abs(s.hit_rate - 320 / 790) < 1e-12


def test_prefix_cache_stats_count_a_resumed_preemption_apart():
    # Full attention block 4: admit 12 tokens (hit 0), free (preempted), readmit the same Request:
    # its own 2 published blocks hit (12 - 1) // 4 * 4 = 8 tokens, counted as preempted, not reuse.
    coord = KVCacheCoordinator(KVCacheConfig(16, [KVCacheGroupSpec(["a"], FullAttentionSpec(4, 1, 8))]),
                               max_model_len=64)
    req = Request("r", tokens(12))
    assert coord.allocate(req, 12)
    coord.free("r")
    blocks, hit = coord.get_computed_blocks(req)
    assert coord.allocate(req, 12 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    s = coord.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 12, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 12, 8)


def non_prefix_closed(evict: bool):
    """Block 4, full attention + Mamba: a 20-token prompt prefilled to 16 in one chunk and
    retired: FA blocks 0..3 published, Mamba only the state at 16 (slot 3). Optionally drop
    FA block 3's hash."""
    coord = coordinator(32, fa_spec(4), mamba_spec(4))
    a = Request("a", tokens(20))
    step(coord, a, 16)
    coord.retire("a", 16)
    fa = list(coord.managers[0].req_to_blocks["a"])
    coord.free("a")
    if evict:
        coord.block_pool.evict_blocks([fa[3].block_id])
    coord.check_invariants()
    return coord


def test_hits_not_prefix_closed():
    # cap 19 -> 16. FA hits blocks 0..2 = 12; Mamba at <= 12: states at 4, 8, 12 were never
    # kept (interior of the chunk) -> 0; FA at 0 -> 0: fixed point 0.
    coord = non_prefix_closed(evict=True)
    assert coord.get_computed_blocks(Request("b", tokens(20)))[1] == 0
    # without the eviction both groups agree on 16
    coord = non_prefix_closed(evict=False)
    assert coord.get_computed_blocks(Request("b", tokens(20)))[1] == 16


def test_eagle_full_attention_plus_sliding_window():
    # DESIGN.md 6: block 4, FA + window 8, 20 tokens cached in both, a 21-token request.
    # Without back-off: 20 (FA [b0..b4], window needs cdiv(7, 4) = 2 blocks: [0, 0, 0, b3, b4]).
    # With EAGLE: 20 -> 16: FA [b0..b3], window [null, null, b2, b3].
    for use_eagle, expect in ((False, 20), (True, 16)):
        coord = coordinator(32, fa_spec(4), sw_spec(4, 8), use_eagle=use_eagle)
        step(coord, Request("a", tokens(20)), 20)
        fa, sw = (list(m.req_to_blocks["a"]) for m in coord.managers)
        coord.free("a")
        hit, n = coord.get_computed_blocks(Request("b", tokens(20) + [1]))
        null = coord.block_pool.null_block
        assert n == expect
        k = expect // 4
        assert hit.blocks[0] == fa[:k]
        assert hit.blocks[1] == [null] * (k - 2) + sw[k - 2 : k]


def test_eagle_single_sliding_window_group():
    # block 2, window 4, 8 cached, 9-token request: 8 without EAGLE, [null, b1, b2] = 6 with.
    for use_eagle, expect in ((False, 8), (True, 6)):
        coord = coordinator(32, sw_spec(2, 4), use_eagle=use_eagle)
        step(coord, Request("a", tokens(8)), 8)
        sw = list(coord.managers[0].req_to_blocks["a"])
        coord.free("a")
        hit, n = coord.get_computed_blocks(Request("b", tokens(8) + [1]))
        null = coord.block_pool.null_block
        assert n == expect
        assert hit.blocks[0] == ([null, null, sw[2], sw[3]] if expect == 8 else [null, sw[1], sw[2]])


def test_copy_plan_per_mamba_group():
    # FA 16 (group 0) + two Mamba align-64 groups (1, 2): every Mamba group has its own table
    # and its own copies; one lookup serves both Mamba groups (same spec).
    coord = coordinator(64, fa_spec(16), mamba_spec(64), mamba_spec(64), max_model_len=1000)
    a = Request("a", tokens(200))
    step(coord, a, 128)
    ids = coord.get_block_ids("a")
    assert coord.take_copy_plan() == {}
    assert coord.take_zero_plan() == {1: [ids[1][1]], 2: [ids[2][1]]}
    coord.retire("a", 128)
    step(coord, a, 64)
    ids = coord.get_block_ids("a")
    assert coord.take_copy_plan() == {1: [(ids[1][1], ids[1][2])], 2: [(ids[2][1], ids[2][2])]}
    assert coord.take_copy_plan() == {}  # taken
    assert not (set(ids[1]) - {0}) & (set(ids[2]) - {0})  # disjoint real blocks
    coord.retire("a", 192)
    m2 = [coord.block_pool.blocks[ids[g][2]] for g in (1, 2)]
    coord.free("a")
    hit, n = coord.get_computed_blocks(Request("b", tokens(192) + [5]))
    assert n == 192 and [h[-1] for h in hit.blocks[1:]] == m2


def test_no_prefix_caching_hybrid():
    coord = hybrid(enable_caching=False)
    prefill(coord, Request("a", tokens(200)), [128, 192, 200])
    coord.free("a")
    assert all(b.block_hash is None for b in coord.block_pool.blocks)
    assert coord.get_computed_blocks(Request("b", tokens(300))) == (KVCacheBlocks(([], [])), 0)


def test_reset_prefix_cache_with_running_requests():
    coord = hybrid()
    prefill(coord, Request("a", tokens(200)), [128, 192])
    assert coord.reset_prefix_cache() is False  # a holds blocks: nothing changed
    assert coord.get_computed_blocks(Request("x", tokens(193)))[1] == 192
    assert coord.preempt_all() == ["a"]
    assert coord.block_pool.get_num_free_blocks() == 63
    assert coord.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in coord.block_pool.blocks)
    assert coord.get_computed_blocks(Request("y", tokens(193)))[1] == 0
    coord.check_invariants()


def test_spec_decode_through_coordinator():
    # block 4, FA + Mamba (nspec 2). Prefill 8 -> sample 1 token (9 tokens). Verify step:
    # 1 + 2 drafts = 3 tokens -> 11 > 9 tokens: 2 drafts. FA publishes only full blocks within
    # the 9 real tokens (2), never block 2 (tokens 8..11, drafts). Mamba running slot
    # cdiv(11, 4) - 1 = 2, scratch at 3, 4; 2 accepted -> copy slot 2 + 2 = 4 into slot 2.
    coord = coordinator(32, fa_spec(4), mamba_spec(4, nspec=2))
    req = Request("a", tokens(8))
    step(coord, req, 8)
    req.append_output_token_ids(1)
    coord.retire("a", 8)
    coord.take_copy_plan(), coord.take_zero_plan()
    step(coord, req, 3)
    fa, mamba = (list(m.req_to_blocks["a"]) for m in coord.managers)
    assert [b.block_hash is not None for b in fa] == [True, True, False]
    assert coord.take_copy_plan() == {1: [(mamba[1].block_id, mamba[2].block_id)]}
    assert coord.accept_drafts("a", 2) == {1: [(mamba[4].block_id, mamba[2].block_id)]}
    req.append_output_token_ids([2, 3, 4])  # 2 accepted drafts + the bonus token: 12 tokens
    coord.retire("a", 11)
    # the running state holds position 9 + 2 = 11, not its boundary 12: not published
    assert mamba[2].block_hash is None and mamba[1].ref_cnt == 0
    coord.check_invariants()


def test_preempted_in_same_step_drops_pending_copies():
    # Mamba block 4, 3 free blocks. a: chunk to 4 (slot 0), then chunk to 8 queues copy
    # slot 0 -> slot 1; a is preempted before the plan is taken. b then gets a's freed
    # blocks: no stale pair of a may write into them; b's running block is only zeroed.
    coord = mamba_coordinator(4, num_blocks=4)
    a = Request("a", tokens(20))
    step(coord, a, 4)
    coord.take_copy_plan(), coord.take_zero_plan()
    step(coord, a, 4)
    coord.free("a")
    b = Request("b", tokens(20, 5000))
    step(coord, b, 8)
    running = coord.get_block_ids("b")[0][1]
    assert coord.take_copy_plan() == {}
    assert coord.take_zero_plan() == {0: [running]}
