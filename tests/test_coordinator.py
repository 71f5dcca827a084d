"""KVCacheCoordinator with full attention (DESIGN.md 3 and 6): shared prefixes, eviction
order, admission, failed allocations, stale hits, bad input and hash block sizes. Block ids
follow from the pool's queue order (1, 2, .. at start), worked out in the comments."""

from __future__ import annotations

import pytest

from mambakv import (
    HashBlockSizeMismatchError,
    InvalidTokenCountError,
    KVCacheBlocks,
    MambaKVError,
    Request,
    StaleCacheHitError,
)
from tests.coord_helpers import coordinator, fa_spec, free_queue_ids, snapshot, step, tokens

SHARED = tokens(48)


def test_shared_prefix_and_eviction_order():
    # 11 blocks (null + 1..10), block 16. Request 0 = 48 shared + 7 own = 55 tokens -> 4 blocks
    # (1, 2, 3 full and published, 4 partial). Request 1 = same 48 + 7 others: hit capped at
    # 54 -> 3 blocks (48 tokens); 1 new block: 5.
    coord = coordinator(11, fa_spec(16))
    r0 = Request("r0", SHARED + tokens(7, 5000))
    assert coord.get_computed_blocks(r0) == (KVCacheBlocks(([],)), 0)
    step(coord, r0, 55)
    assert coord.get_block_ids("r0") == ([1, 2, 3, 4],)
    r1 = Request("r1", SHARED + tokens(7, 6000))
    hit, n = coord.get_computed_blocks(r1)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)
    step(coord, r1, 7, num_new_computed_tokens=48, new_computed_blocks=hit)
    assert coord.get_block_ids("r1") == ([1, 2, 3, 5],)
    assert [coord.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    # free r0 tail-first [4, 3, 2, 1]: 4 (unhashed) -> head; 3, 2, 1 still held by r1.
    # free r1 tail-first [5, 3, 2, 1]: 5 -> head; 3, 2, 1 (hashed) -> tail in that order.
    coord.free("r0")
    assert free_queue_ids(coord) == [4, 6, 7, 8, 9, 10]
    coord.free("r1")
    assert free_queue_ids(coord) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    coord.check_invariants()
    # a 10-block request with no hit receives blocks in exactly the queue order
    r2 = Request("r2", tokens(160, 9000))
    assert coord.get_computed_blocks(r2)[1] == 0
    step(coord, r2, 160)
    assert coord.get_block_ids("r2") == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert coord.block_pool.get_num_free_blocks() == 0


def freed_prefix(num_blocks: int = 11):
    """Request a = 64 tokens -> blocks 1..4, all published; freed: queue [5..10, 4, 3, 2, 1]."""
    coord = coordinator(num_blocks, fa_spec(16))
    step(coord, Request("a", tokens(64)), 64)
    coord.free("a")
    assert free_queue_ids(coord) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    return coord


def test_admission_counts_evictable_hits():
    # b = the same 64 tokens + 106 = 170 tokens -> cdiv(170, 16) = 11 blocks: 4 hits (in the free
    # queue: touching them uses 4 of the 10 free) + 7 new = 11 > 10 free -> None.
    # (Counting only the 7 new blocks would say yes and then run out.)
    coord = freed_prefix()
    b = Request("b", tokens(64) + tokens(106, 7000))
    hit, n = coord.get_computed_blocks(b)
    assert n == 64 and hit.get_block_ids() == ([1, 2, 3, 4],)
    before = snapshot(coord, ["b"])
    assert coord.allocate(b, 106, num_new_computed_tokens=64, new_computed_blocks=hit) is None
    assert snapshot(coord, ["b"]) == before
    assert all(coord.block_pool.blocks[i].ref_cnt == 0 for i in (1, 2, 3, 4))
    assert free_queue_ids(coord) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    assert coord.get_block_ids("b") == ([],) and coord.num_running_requests == 0
    coord.check_invariants()
    # 64 + 96 = 160 tokens = 10 blocks (4 hits + 6 new) fits exactly
    c = Request("c", tokens(64) + tokens(96, 7000))
    hit, n = coord.get_computed_blocks(c)
    step(coord, c, 96, num_new_computed_tokens=64, new_computed_blocks=hit)
    assert coord.get_block_ids("c") == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],)


def test_failed_allocate_changes_nothing_for_running_requests():
    # a holds 4 blocks (64 tokens), b a new 7 blocks; 10 free at start -> 0 free after... then
    # a needs one more block for token 65 and the pool is empty -> None, nothing changed.
    coord = coordinator(11, fa_spec(16))
    a = Request("a", tokens(80))
    step(coord, a, 64)
    b = Request("b", tokens(96, 5000))
    step(coord, b, 96)
    assert coord.block_pool.get_num_free_blocks() == 0
    before = snapshot(coord, ["a", "b"])
    assert coord.allocate(a, 1) is None
    assert coord.allocate(Request("c", tokens(16, 9000)), 16) is None
    assert snapshot(coord, ["a", "b"]) == before
    coord.free("b")
    step(coord, a, 16)  # now it fits: 64 + 16 = 80 tokens = 5 blocks
    assert len(coord.get_block_ids("a")[0]) == 5


def test_stale_hit_is_refused_and_changes_nothing():
    # b looks up a's freed prefix: hits [1, 2, 3, 4] (block 4 at the head of the hashed part).
    # Before b allocates, c takes 7 blocks: 5..10 and then 4 -> block 4's hash is evicted.
    coord = freed_prefix()
    b = Request("b", tokens(64) + tokens(10, 7000))
    hit, n = coord.get_computed_blocks(b)
    assert n == 64
    c = Request("c", tokens(112, 9000))
    step(coord, c, 112)
    assert coord.get_block_ids("c") == ([5, 6, 7, 8, 9, 10, 4],)
    before = snapshot(coord, ["b", "c"])
    with pytest.raises(StaleCacheHitError):
        coord.allocate(b, 10, num_new_computed_tokens=64, new_computed_blocks=hit)
    assert issubclass(StaleCacheHitError, MambaKVError)
    assert snapshot(coord, ["b", "c"]) == before
    # looking up again gives the 3 blocks still cached
    hit, n = coord.get_computed_blocks(b)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)
    # 74 tokens = 5 blocks: 3 evictable hits + 2 new > 3 free -> None; once c is freed it fits
    assert coord.allocate(b, 26, num_new_computed_tokens=48, new_computed_blocks=hit) is None
    coord.free("c")
    step(coord, b, 26, num_new_computed_tokens=48, new_computed_blocks=hit)
    assert coord.get_block_ids("b")[0][:3] == [1, 2, 3]


@pytest.mark.parametrize("call", [
    lambda c, r: c.allocate(r, 0),
    lambda c, r: c.allocate(r, -5),
    lambda c, r: c.allocate(r, 5, num_new_computed_tokens=-1),
    lambda c, r: c.allocate(r, 5, num_lookahead_tokens=-1),
    lambda c, r: c.allocate(r, 200),  # 16 computed + 200 > max_model_len 100
    lambda c, r: c.retire("a", -1),
    lambda c, r: c.retire("a", 41),   # a has 40 tokens
])
def test_bad_input_raises_and_changes_nothing(call):
    coord = coordinator(11, fa_spec(16), max_model_len=100)
    a = Request("a", tokens(40))
    step(coord, a, 16)
    before = snapshot(coord, ["a"])
    with pytest.raises(InvalidTokenCountError):
        call(coord, a)
    assert snapshot(coord, ["a"]) == before
    assert a.num_computed_tokens == 16
    coord.check_invariants()


def test_bad_hit_list_raises_and_changes_nothing():
    coord = freed_prefix()
    b = Request("b", tokens(70))
    hit, _ = coord.get_computed_blocks(b)
    before = snapshot(coord, ["b"])
    with pytest.raises(MambaKVError):  # two group lists for a one-group config
        coord.allocate(b, 6, num_new_computed_tokens=64, new_computed_blocks=KVCacheBlocks((hit.blocks[0], [])))
    assert snapshot(coord, ["b"]) == before


def test_retire_zero_and_unknown_requests_are_noops():
    coord = coordinator(11, fa_spec(16))
    a = Request("a", tokens(40))
    step(coord, a, 40)
    before = snapshot(coord, ["a"])
    coord.retire("a", 0)
    coord.retire("ghost", 10)
    coord.free("ghost")
    assert snapshot(coord, ["a"]) == before


def test_hash_block_size_rules():
    # must divide every group's block size
    with pytest.raises(HashBlockSizeMismatchError):
        coordinator(11, fa_spec(16), hash_block_size=6)
    with pytest.raises(HashBlockSizeMismatchError):  # default 16 does not divide 24
        coordinator(11, fa_spec(16), fa_spec(24))
    assert coordinator(11, fa_spec(16), fa_spec(24), hash_block_size=8).hash_block_size == 8
    # default: the smallest block size
    coord = coordinator(11, fa_spec(16), fa_spec(32))
    assert coord.hash_block_size == 16
    r = Request("r", tokens(40))
    coord.get_computed_blocks(r)
    assert r.hash_block_size == 16  # adopted on first use
    # a request created with another size raises, nothing changed
    other = Request("o", tokens(40), hash_block_size=8)
    before = snapshot(coord, ["o"])
    with pytest.raises(HashBlockSizeMismatchError):
        coord.get_computed_blocks(other)
    with pytest.raises(HashBlockSizeMismatchError):
        coord.allocate(other, 40)
    assert snapshot(coord, ["o"]) == before


def test_finer_hash_blocks_give_the_same_hits():
    # hash block 8 under block 16: a block's key is the fine digest that ends it, so the shared
    # prefix test gives the same 48-token hit.
    coord = coordinator(11, fa_spec(16), hash_block_size=8)
    step(coord, Request("r0", SHARED + tokens(7, 5000)), 55)
    r1 = Request("r1", SHARED + tokens(7, 6000))
    hit, n = coord.get_computed_blocks(r1)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)


def test_no_prefix_caching_never_hits():
    coord = coordinator(11, fa_spec(16), enable_caching=False)
    step(coord, Request("a", tokens(64)), 64)
    coord.free("a")
    assert coord.get_computed_blocks(Request("b", tokens(80))) == (KVCacheBlocks(([],)), 0)
    assert all(b.block_hash is None for b in coord.block_pool.blocks)
    # freed tail-first [4, 3, 2, 1], all unhashed -> prepended in that order
    assert free_queue_ids(coord) == [4, 3, 2, 1, 5, 6, 7, 8, 9, 10]
