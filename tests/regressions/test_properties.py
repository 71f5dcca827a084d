"""Properties, one per fault kind of this suite, each able to catch other instances of it.

Plain ``@given`` tests over random op sequences on small pools (hypothesis, deadline off); the
module runs in well under 30 s. Each property names the regression module it generalises.
Op sequences drive :class:`tests.regressions.util.Engine` (admit / schedule / process / free).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mambakv import (
    BlockPool,
    DoubleFreeError,
    FreeBlockQueue,
    InvalidBlockError,
    InvalidTokenCountError,
    KVCacheBlock,
    Request,
)
from mambakv.sim import RequestSpec, Scheduler

from .util import Engine, coordinator, fa, mamba, pool_snapshot, queue_ids, snapshot, sw, tokens

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPS = st.lists(st.one_of(
    st.tuples(st.just(0), st.integers(0, 2), st.integers(1, 40), st.integers(1, 4)),  # admit
    st.tuples(st.just(1), st.integers(0, 9), st.integers(1, 4)),                      # schedule
    st.tuples(st.just(2), st.integers(0, 9)),                                         # process
    st.tuples(st.just(3), st.integers(0, 9)),                                         # free
), max_size=40)


def hybrid(num_blocks: int, nspec: int = 0, **kw):
    """Full attention + sliding window 8 + align Mamba (nspec), all B = 4."""
    return coordinator(num_blocks, fa(4), sw(4, 8), mamba(4, nspec=nspec), **kw)


def mamba_tables(coord):
    """(manager, request id, table view) of every live Mamba table (public snapshots)."""
    for m in coord.mamba_managers:
        for rid in m.req_to_blocks:
            yield m, rid, m.describe(rid)


# ---------------------------------------------------------------- test_duplicate_free
@FAST
@given(held=st.lists(st.booleans(), min_size=6, max_size=6), ids=st.lists(st.integers(0, 6), min_size=2, max_size=8))
def test_repeated_block_lists_refused_everywhere(held, ids):
    pool = BlockPool(7)
    blocks = pool.get_new_blocks(6)
    pool.free_blocks([b for b, h in zip(blocks, held) if not h])
    chosen = [pool.blocks[i] for i in ids]
    real = [i for i in ids if i]
    before = pool_snapshot(pool)
    if len(set(real)) != len(real):
        with pytest.raises(DoubleFreeError):
            pool.free_blocks(chosen)
        with pytest.raises(InvalidBlockError):
            pool.touch(chosen)
        assert pool_snapshot(pool) == before
    else:
        pool.touch(chosen)  # distinct real blocks (nulls may repeat): fine, and undone by free
        pool.free_blocks(chosen)
    pool.check_invariants()
    qb = [KVCacheBlock(i) for i in range(7)]
    q = FreeBlockQueue(qb[:1])
    if len(set(ids)) != len(ids) or 0 in ids:  # a repeat, or block 0 (already queued)
        for call in (q.append_n, q.prepend_n):
            with pytest.raises(DoubleFreeError):
                call([qb[i] for i in ids])
            assert q.get_all_free_blocks() == [qb[0]]
            q.check_invariants()


# ---------------------------------------------------------------- test_null_block_paths
@FAST
@given(ops=OPS)
def test_null_untouched_and_every_settled_boundary_state_hits(ops):
    coord = coordinator(256, mamba(4))  # large: nothing cached is evicted
    eng = Engine(coord, 4)
    null = coord.block_pool.null_block
    for _ in eng.run(ops):
        assert null.ref_cnt == 0 and null.block_hash is None and null.prev_free_block is None
    for rid, req in eng.reqs.items():
        # The settled count is a chunk end; on a block boundary its state was published
        # (nulls before it in the table never skip it): a repeat of the request hits it.
        s = eng.settled[rid]
        want = s if s % 4 == 0 and s <= req.num_tokens - 1 else 0
        _, hit = coord.get_computed_blocks(Request(rid + "-probe", list(req.all_token_ids)))
        assert hit >= want


# ---------------------------------------------------------------- test_replay_boundary_checkpoint
@settings(max_examples=40, deadline=None)
@given(num_prompt=st.one_of(st.integers(2, 80), st.sampled_from([16, 32, 48, 64, 80])), budget=st.integers(1, 96))
def test_repeat_of_any_prompt_hits_the_last_boundary_before_its_end(num_prompt, budget):
    coord = coordinator(64, fa(16), mamba(16))
    sched = Scheduler(coord, max_num_batched_tokens=budget)
    prompt = np.arange(50, 50 + num_prompt, dtype=np.int32)
    for rid in ("first", "again"):
        sched.run([RequestSpec(rid, 0.0, num_prompt, 1, lambda: prompt.copy())], one_at_a_time=True)
    assert sched.metrics.cached_tokens == (num_prompt - 1) // 16 * 16
    coord.check_invariants()


# ---------------------------------------------------------------- test_settled_retirement
@FAST
@given(ops=OPS, over=st.integers(1, 20))
def test_window_keeps_what_unsettled_steps_read(ops, over):
    coord = coordinator(128, sw(4, 8), mamba(4))
    eng = Engine(coord, 4)
    for _ in eng.run(ops):
        for rid in eng.reqs:
            # The next unsettled step starts at the settled count s and reads [s - 7, ...).
            low = max(0, eng.settled[rid] - 8 + 1)
            table = coord.get_block_ids(rid)[0]
            assert all(table[i] != 0 for i in range(low // 4, len(table))), (rid, table, low)
    for rid, req in eng.reqs.items():
        before = snapshot(coord)
        with pytest.raises(InvalidTokenCountError):
            coord.retire(rid, req.num_computed_tokens + over)  # never scheduled
        assert snapshot(coord) == before


# ---------------------------------------------------------------- test_eagle_backoff_once
@FAST
@given(ops=OPS, probes=st.lists(st.tuples(st.integers(0, 2), st.integers(2, 60)), min_size=1, max_size=4),
       with_mamba=st.booleans())
def test_eagle_hit_is_the_fixed_point_from_one_aligned_step_below(ops, probes, with_mamba):
    coord = hybrid(256) if with_mamba else coordinator(256, fa(4), sw(4, 8))
    eng = Engine(coord, 4)
    for _ in eng.run(ops):
        pass
    for full in [Engine.prompt(f, n) for f, n in probes] + [list(r.all_token_ids) for r in eng.reqs.values()]:
        plain_blocks, plain = coord.get_computed_blocks(Request("p", full))
        coord.use_eagle = True
        eagle_blocks, eagle = coord.get_computed_blocks(Request("e", full))
        coord.use_eagle = False
        if plain == 0:
            assert eagle == 0
            continue
        # Definition: the fixed point again, without back-off, from plain - 4 (the lookup of
        # a prompt of plain - 4 + 1 tokens starts there): never a second back-off.
        ref_blocks, ref = coord.get_computed_blocks(Request("t", full[: plain - 4 + 1]))
        assert eagle == ref and eagle_blocks.get_block_ids() == ref_blocks.get_block_ids()


# ---------------------------------------------------------------- test_unhashed_first
@FAST
@given(ops=OPS)
def test_queue_is_unhashed_then_hashed(ops):
    coord = hybrid(48, nspec=1)
    pool = coord.block_pool
    for _ in Engine(coord, 4, drafts=1).run(ops):
        flags = [pool.blocks[i].block_hash is not None for i in queue_ids(pool)]
        assert flags == sorted(flags), "an unhashed free block sits behind a hashed one"


# ---------------------------------------------------------------- test_tail_first_eviction
@FAST
@given(n=st.integers(1, 8), r=st.integers(0, 3), k=st.integers(0, 8))
def test_freed_prefix_loses_its_deepest_blocks_first(n, r, k):
    # A: n * 4 - r tokens in n blocks (the last one partial, unhashed, when r > 0); pool of
    # exactly n blocks. After freeing A, k blocks of other tokens are taken: the unhashed block
    # goes first, then hashed blocks from the deep end. Full blocks f = (4n - r) // 4; evicted
    # hashed e = max(0, k - (n - f)); the repeat hits min(f - e, cap) blocks, cap = (4n - r - 1) // 4.
    k = min(k, n)
    coord = coordinator(n + 1, fa(4))
    a = Request("a", tokens(4 * n - r))
    coord.allocate(a, 4 * n - r)
    coord.free("a")
    if k:
        coord.allocate(Request("x", tokens(4 * k, start=90_000)), 4 * k)
    f = (4 * n - r) // 4
    e = max(0, k - (n - f))
    _, hit = coord.get_computed_blocks(Request("a2", tokens(4 * n - r)))
    assert hit == 4 * min(f - e, (4 * n - r - 1) // 4)


# ---------------------------------------------------------------- test_reset_with_running
@FAST
@given(ops=OPS)
def test_preempt_all_then_reset_leaves_nothing_behind(ops):
    coord = hybrid(48, nspec=1)
    eng = Engine(coord, 4, drafts=1)
    for i, _ in enumerate(eng.run(ops)):
        if i < len(ops) - 1:  # the engine runs each step's plans; the last step's are pending
            coord.take_copy_plan(), coord.take_zero_plan()
    pool = coord.block_pool
    if pool.get_num_free_blocks() < pool.num_blocks - 1:
        before = snapshot(coord)
        assert coord.reset_prefix_cache() is False
        assert snapshot(coord) == before
    live = dict(eng.reqs)
    assert sorted(coord.preempt_all()) == sorted(live)
    assert coord.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in pool.blocks)
    assert all(m.num_requests == 0 for m in coord.managers) and coord.num_running_requests == 0
    assert coord.take_copy_plan() == {} and coord.take_zero_plan() == {}
    assert all(r.num_computed_tokens == 0 for r in live.values())
    for rid, req in live.items():  # resumed: a fresh table, starting from a zeroed state
        _, hit = coord.get_computed_blocks(req)
        assert hit == 0 and coord.allocate(req, min(4, req.num_tokens)) is not None
        running = [b for b in coord.get_block_ids(rid)[2] if b][0]
        assert coord.take_zero_plan() == {2: [running]} and coord.take_copy_plan() == {}
        coord.free(rid)
    coord.check_invariants()


# ---------------------------------------------------------------- test_transactional_allocation
CHURN = st.lists(st.one_of(  # two families, whole-prompt admits, frequent frees: hits at the queue head
    st.tuples(st.just(0), st.integers(0, 1), st.sampled_from([5, 8, 9, 12, 16]), st.just(8)),
    st.tuples(st.just(3), st.integers(0, 9)),
), max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=CHURN, num_blocks=st.integers(6, 16), with_mamba=st.booleans())
def test_allocation_is_all_or_nothing_and_pins_every_hit(ops, num_blocks, with_mamba):
    # Small pools: allocations fail often, and hits sit at the queue head (no unhashed block).
    coord = hybrid(num_blocks, nspec=1) if with_mamba else coordinator(num_blocks, fa(4), sw(4, 8))
    allocate = coord.allocate

    def checked(req, n, **kw):
        before = snapshot(coord)
        out = allocate(req, n, **kw)
        if out is None:
            assert snapshot(coord) == before
            return None
        hits = kw.get("new_computed_blocks")
        for gid, hit in enumerate(hits.blocks if hits is not None else ()):
            table = coord.managers[gid].req_to_blocks[req.request_id]
            assert table[: len(hit)] == hit  # every hit is in its own table, still published
            assert all(b.is_null or (b.block_hash is not None and b.cache_group_id == gid) for b in hit)
        return out

    coord.allocate = checked
    for _ in Engine(coord, 4, drafts=1).run(ops):
        pass  # check_invariants(): ref counts == holders, no block in two groups' tables


# ---------------------------------------------------------------- test_scratch_blocks
@FAST
@given(ops=OPS, nspec=st.integers(1, 3))
def test_scratch_blocks_stay_private(ops, nspec):
    coord = coordinator(96, fa(4), mamba(4, nspec=nspec))
    eng = Engine(coord, 4, drafts=nspec)
    m = coord.managers[1]
    for _ in eng.run(ops):
        scratch = set()
        for _m, rid, st_ in mamba_tables(coord):
            tail = [coord.block_pool.blocks[i] for i in st_.block_ids[st_.running_slot + 1 :]]
            assert len(tail) == nspec
            assert all(b.ref_cnt == 1 and b.block_hash is None for b in tail)
            scratch |= {b.block_id for b in tail}
            assert not scratch & set(m.get_state_block_ids(rid))
        for req in eng.reqs.values():
            blocks, _ = coord.get_computed_blocks(Request("probe", list(req.all_token_ids)))
            assert not scratch & set(blocks.get_block_ids()[1])
    for rid in list(eng.reqs):  # fewer tokens than the table covers: a no-op (AlignStep.COVERED)
        st_ = m.describe(rid)
        if st_ is not None and st_.running_slot > 0 and not st_.had_drafts:
            before = snapshot(coord)
            assert m.allocate_new_blocks(rid, st_.running_slot * 4) == []
            assert snapshot(coord) == before


# ---------------------------------------------------------------- test_publish_before_written
@FAST
@given(ops=OPS)
def test_hits_only_on_written_states_and_reused_blocks_start_clean(ops):
    coord = coordinator(24, fa(4), mamba(4))
    eng = Engine(coord, 4)
    written: set[tuple] = set()  # prefixes whose state at their end was processed by some request
    for op in eng.run(ops):
        zero, copies = coord.take_zero_plan().get(1, []), coord.take_copy_plan().get(1, [])
        if op[0] == 2 and eng.reqs:
            for rid, req in eng.reqs.items():
                s = eng.settled[rid]
                if s % 4 == 0 and s:
                    written.add(tuple(req.all_token_ids[:s]))
        if op[0] == 0 and eng.reqs and f"r{eng.n - 1}" in eng.reqs:
            rid = f"r{eng.n - 1}"
            req, hit = eng.reqs[rid], eng.hits[rid]
            table = coord.get_block_ids(rid)[1]
            running = table[-1]
            if hit:
                assert tuple(req.all_token_ids[:hit]) in written
                assert copies == [(table[hit // 4 - 1], running)] and running not in zero
            else:
                assert zero == [running] and copies == []
