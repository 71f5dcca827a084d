"""BlockPool: null block, free-queue order, ref counts, prefix-cache map, events (DESIGN.md section 3).

Queue orders below are worked out by hand from the rules: block 0 is taken out at construction;
``get_new_blocks`` pops from the head; ``free_blocks`` puts blocks that reach ref 0 back, unhashed
ones at the head (in the order given) and hashed ones at the tail (in the order given).
"""

from __future__ import annotations

import pytest

from mambakv import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    DoubleFreeError,
    InvalidBlockError,
    InvalidTokenCountError,
    MambaKVError,
    OutOfBlocksError,
)


def h(i: int) -> bytes:
    """A 16-byte stand-in digest."""
    return bytes([i]) * 16


def queue(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def snapshot(pool: BlockPool):
    """Everything a failed call must leave unchanged."""
    maps = {
        gid: {k: sorted(e) if isinstance(e, dict) else [e.block_id] for k, e in m.items()}
        for gid, m in pool.cached_block_hash_to_block.items()
    }
    return (
        pool.get_num_free_blocks(),
        [b.ref_cnt for b in pool.blocks],
        queue(pool),
        [(b.block_hash, b.cache_group_id) for b in pool.blocks],
        maps,
    )


def blk(pool: BlockPool, *block_ids: int):
    return [pool.blocks[i] for i in block_ids]


def test_construction_null_block_and_id_order():
    pool = BlockPool(11)
    pool.check_invariants()
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null and pool.null_block.block_id == 0
    assert not any(b.is_null for b in pool.blocks[1:])
    assert pool.get_num_free_blocks() == 10
    assert queue(pool) == list(range(1, 11))
    assert pool.usage == 0.0
    assert [b.block_id for b in pool.blocks] == list(range(11))


@pytest.mark.parametrize("n", [0, 1, -3])
def test_too_small_pool_raises(n):
    with pytest.raises(MambaKVError):
        BlockPool(n)


def test_get_new_blocks_never_hands_out_null_and_usage():
    pool = BlockPool(11)
    got = pool.get_new_blocks(5)
    pool.check_invariants()
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.usage == pytest.approx(5 / 10)  # used / (num_blocks - 1); the null block is not counted
    rest = pool.get_new_blocks(5)
    pool.check_invariants()
    assert [b.block_id for b in rest] == [6, 7, 8, 9, 10]
    assert pool.usage == 1.0 and pool.get_num_free_blocks() == 0
    with pytest.raises(OutOfBlocksError):
        pool.get_new_blocks(1)  # only the null block is left, and it is never allocated
    assert pool.null_block.ref_cnt == 0
    assert pool.get_new_blocks(0) == []
    pool.check_invariants()


def test_null_block_skipped_by_touch_free_and_cache():
    pool = BlockPool(11)
    null = pool.null_block
    before = snapshot(pool)
    pool.touch([null, null])
    pool.check_invariants()
    assert null.ref_cnt == 0, "touch must skip the null block"
    pool.free_blocks([null])
    pool.check_invariants()
    assert snapshot(pool) == before
    assert null.ref_cnt == 0 and null.prev_free_block is None and null.next_free_block is None

    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([null, b1, null, b2], [h(1), h(2), h(3), h(4)], 0)
    pool.check_invariants()
    assert null.block_hash is None
    assert (b1.block_hash, b2.block_hash) == (h(2), h(4))
    assert pool.get_cached_block(h(1), [0]) is None and pool.get_cached_block(h(3), [0]) is None
    assert pool.get_cached_block(h(2), [0]) == [b1]

    # a table with null entries (a sliding-window or Mamba table) is freed without touching null
    pool.touch([null, b1])
    pool.check_invariants()
    assert null.ref_cnt == 0 and b1.ref_cnt == 2
    pool.free_blocks([null, b1, null])
    pool.check_invariants()
    assert null.ref_cnt == 0 and b1.ref_cnt == 1
    assert pool.usage == pytest.approx(2 / 10)
    pool.evict_blocks([0])
    pool.check_invariants()


def test_free_order_unhashed_first_hashed_lru():
    pool = BlockPool(11)
    b = pool.get_new_blocks(4)  # 1 2 3 4; queue 5..10
    pool.cache_full_blocks(b[:2], [h(1), h(2)], 0)  # blocks 1, 2 hashed
    pool.check_invariants()
    pool.free_blocks(reversed(b))  # a request frees its table in reverse: 4 3 2 1
    pool.check_invariants()
    # unhashed [4, 3] prepended in that order; hashed [2, 1] appended in that order
    assert queue(pool) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    assert all(x.ref_cnt == 0 for x in b)

    # a second request: 3 blocks, the deepest hashed, freed later -> goes behind 2 and 1
    c = pool.get_new_blocks(3)  # 4 3 5
    assert [x.block_id for x in c] == [4, 3, 5]
    pool.cache_full_blocks(c, [h(7), h(8), h(9)], 0)
    pool.free_blocks([c[2], c[1], c[0]])  # 5 3 4, all hashed -> tail in that order
    pool.check_invariants()
    assert queue(pool) == [6, 7, 8, 9, 10, 2, 1, 5, 3, 4]
    # freeing a never-hashed block now still puts it before every hashed block
    d = pool.get_new_blocks(1)  # 6
    pool.free_blocks(d)
    assert queue(pool) == [6, 7, 8, 9, 10, 2, 1, 5, 3, 4]
    pool.check_invariants()

    # reuse: the 5 unhashed blocks come out first and evict nothing
    got = pool.get_new_blocks(5)
    assert [x.block_id for x in got] == [6, 7, 8, 9, 10]
    assert all(pool.get_cached_block(h(i), [0]) is not None for i in (1, 2, 7, 8, 9))
    # then hashed blocks oldest-first: 2 (hash 2), then 1 (hash 1)
    (e,) = pool.get_new_blocks(1)
    assert e.block_id == 2 and e.block_hash is None
    assert pool.get_cached_block(h(2), [0]) is None
    assert pool.get_cached_block(h(1), [0]) == [pool.blocks[1]]
    (e,) = pool.get_new_blocks(1)
    assert e.block_id == 1 and pool.get_cached_block(h(1), [0]) is None
    assert queue(pool) == [5, 3, 4]
    assert pool.num_evictions == 2
    pool.check_invariants()


def test_touch_revives_cached_block_out_of_the_queue():
    pool = BlockPool(11)
    b = pool.get_new_blocks(3)  # 1 2 3
    pool.cache_full_blocks(b, [h(1), h(2), h(3)], 0)
    pool.free_blocks(b)  # hashed -> tail: 4..10 1 2 3
    assert queue(pool) == [4, 5, 6, 7, 8, 9, 10, 1, 2, 3]
    (hit,) = pool.get_cached_block(h(2), [0])
    assert hit is pool.blocks[2]
    pool.touch([hit])
    pool.check_invariants()
    assert hit.ref_cnt == 1 and hit.block_hash == h(2)
    assert queue(pool) == [4, 5, 6, 7, 8, 9, 10, 1, 3]
    assert pool.get_num_free_blocks() == 9
    pool.touch([hit])  # a second table shares it: no queue change
    assert hit.ref_cnt == 2 and queue(pool) == [4, 5, 6, 7, 8, 9, 10, 1, 3]
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and queue(pool) == [4, 5, 6, 7, 8, 9, 10, 1, 3]
    pool.free_blocks([hit])  # back to the tail, most recently used
    assert queue(pool) == [4, 5, 6, 7, 8, 9, 10, 1, 3, 2]
    pool.check_invariants()


def test_get_new_blocks_evicts_cached_free_block_from_map():
    pool = BlockPool(3)  # blocks 1, 2
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1], [h(5)], 0)
    pool.free_blocks([b1, b2])  # unhashed 2 at head, hashed 1 at tail
    assert queue(pool) == [2, 1]
    assert pool.get_cached_block(h(5), [0]) == [b1]
    assert pool.get_new_blocks(1) == [b2]
    assert pool.get_cached_block(h(5), [0]) == [b1]
    assert pool.get_new_blocks(1) == [b1]
    pool.check_invariants()
    assert b1.block_hash is None and b1.ref_cnt == 1
    assert pool.get_cached_block(h(5), [0]) is None


def test_reset_prefix_cache_refuses_while_in_use():
    pool = BlockPool(6)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, [h(1), h(2), h(3)], 0)
    pool.free_blocks(b[1:])
    pool.check_invariants()
    before = snapshot(pool)
    assert pool.reset_prefix_cache() is False  # block 1 is still held
    assert snapshot(pool) == before
    assert pool.get_cached_block(h(2), [0]) == [b[1]]
    pool.free_blocks(b[:1])
    order = queue(pool)
    assert pool.reset_prefix_cache() is True
    pool.check_invariants()
    assert all(x.block_hash is None for x in pool.blocks)
    assert all(pool.get_cached_block(h(i), [0]) is None for i in (1, 2, 3))
    assert queue(pool) == order  # only the hashes are dropped
    assert pool.get_num_free_blocks() == 5


def test_reset_prefix_cache_refuses_after_a_hit_touch():
    pool = BlockPool(4)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, [h(1)], 0)
    pool.free_blocks(b)
    pool.touch(b)  # a hit revived it
    assert pool.reset_prefix_cache() is False
    assert b[0].block_hash == h(1)
    pool.free_blocks(b)
    assert pool.reset_prefix_cache() is True
    pool.check_invariants()


def _pool_with_state() -> tuple[BlockPool, list]:
    """Pool(11): blocks 1..4 held (1, 2 hashed), 3 also touched (ref 2); 5 hashed then freed."""
    pool = BlockPool(11)
    b = pool.get_new_blocks(5)
    pool.cache_full_blocks(b[:2] + b[4:], [h(1), h(2), h(5)], 0)
    pool.touch([b[2]])
    pool.free_blocks([b[4]])
    pool.check_invariants()
    assert queue(pool) == [6, 7, 8, 9, 10, 5]
    return pool, b


def test_double_free_same_block_twice_in_one_call():
    pool, b = _pool_with_state()
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError) as e:
        pool.free_blocks([b[0], b[0]])  # b1 at ref 1
    assert isinstance(e.value, MambaKVError)
    assert snapshot(pool) == before
    # the bad block listed after a good one: the good one is not freed either
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b[1], b[3], b[3]])
    assert snapshot(pool) == before
    pool.check_invariants()


def test_double_free_block_at_ref_zero():
    pool, b = _pool_with_state()
    before = snapshot(pool)
    for bad in ([b[4]], [b[0], b[4]], [b[2], b[1], pool.blocks[9]]):  # b5 and b9 are free (ref 0)
        with pytest.raises(DoubleFreeError):
            pool.free_blocks(bad)
        assert snapshot(pool) == before
        pool.check_invariants()
    pool.free_blocks([b[3]])  # a legal free still works afterwards: unhashed 4 -> head
    assert queue(pool) == [4, 6, 7, 8, 9, 10, 5]
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b[3]])
    pool.check_invariants()


def test_get_new_blocks_beyond_free_or_negative_changes_nothing():
    pool, _ = _pool_with_state()  # 6 free
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError) as e:
        pool.get_new_blocks(7)
    assert isinstance(e.value, MambaKVError)
    assert snapshot(pool) == before
    with pytest.raises(InvalidTokenCountError) as e2:
        pool.get_new_blocks(-1)
    assert isinstance(e2.value, MambaKVError)
    assert snapshot(pool) == before
    assert pool.get_cached_block(h(5), [0]) == [pool.blocks[5]]
    got = pool.get_new_blocks(6)  # exactly all: evicts the cached block 5 last
    assert [x.block_id for x in got] == [6, 7, 8, 9, 10, 5]
    assert pool.get_cached_block(h(5), [0]) is None
    pool.check_invariants()


def test_several_blocks_share_one_hash():
    pool = BlockPool(11)
    b = pool.get_new_blocks(3)  # 1 2 3
    pool.cache_full_blocks(b[:1], [h(9)], 0)
    pool.cache_full_blocks(b[1:2], [h(9)], 0)  # a second table computed the same prefix
    pool.cache_full_blocks(b[2:], [h(9)], 0)
    pool.check_invariants()
    (hit,) = pool.get_cached_block(h(9), [0])
    assert hit in b
    pool.free_blocks(b)  # all hashed -> tail: 4..10 1 2 3
    assert queue(pool) == [4, 5, 6, 7, 8, 9, 10, 1, 2, 3]
    pool.get_new_blocks(8)  # 4..10 and block 1: evicts one of the three
    pool.check_invariants()
    (hit,) = pool.get_cached_block(h(9), [0])
    assert hit in (b[1], b[2])
    pool.evict_blocks([2])  # drop block 2's hash; block 3 is still findable
    pool.check_invariants()
    assert pool.get_cached_block(h(9), [0]) == [b[2]]
    assert queue(pool) == [2, 3]  # block 2, now unhashed, moves to the head (it already is)
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h(9), [0]) is None
    pool.check_invariants()


def test_get_cached_block_needs_every_group():
    pool = BlockPool(11)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.cache_full_blocks([b1], [h(1)], 0)
    pool.cache_full_blocks([b2], [h(1)], 1)
    pool.cache_full_blocks([b3], [h(2)], 1)
    pool.check_invariants()
    assert pool.get_cached_block(h(1), [0, 1]) == [b1, b2]
    assert pool.get_cached_block(h(1), [1, 0]) == [b2, b1]
    assert pool.get_cached_block(h(1), [0]) == [b1]
    assert pool.get_cached_block(h(1), [0, 2]) is None  # group 2 has nothing
    assert pool.get_cached_block(h(2), [0, 1]) is None  # group 0 lacks hash 2
    assert pool.get_cached_block(h(2), [1]) == [b3]
    pool.evict_blocks([b2.block_id])
    pool.check_invariants()
    assert pool.get_cached_block(h(1), [0, 1]) is None
    assert pool.get_cached_block(h(1), [0]) == [b1]


def test_evict_blocks_held_and_free():
    pool = BlockPool(11)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, [h(1), h(2), h(3)], 0)
    pool.free_blocks([b[2]])
    assert queue(pool) == [4, 5, 6, 7, 8, 9, 10, 3]
    pool.evict_blocks([1, 3, 4, 0])  # held hashed, free hashed, unhashed, null
    pool.check_invariants()
    assert b[0].block_hash is None and b[0].ref_cnt == 1
    assert b[2].block_hash is None and b[2].ref_cnt == 0
    assert b[1].block_hash == h(2)
    assert pool.get_cached_block(h(1), [0]) is None and pool.get_cached_block(h(3), [0]) is None
    # free block 3 lost its hash: it goes to the head like any unhashed freed block (DESIGN.md 3),
    # so the queue is 3, 4, ..., 10.
    assert queue(pool) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert pool.num_evictions == 2


def test_cache_full_blocks_skips_same_hash_refuses_another_and_disabled_caching():
    pool = BlockPool(11)
    (b, c) = pool.get_new_blocks(2)
    pool.cache_full_blocks([b], [h(1)], 0)
    pool.cache_full_blocks([b], [h(1)], 0)  # already published under this hash (a hit): skipped
    assert b.block_hash == h(1) and pool.get_cached_block(h(1), [0]) == [b]
    before = (c.block_hash, dict(pool.cached_block_hash_to_block[0]))
    for hashes, group in (([h(3), h(2)], 0), ([h(3), h(1)], 1)):  # another hash / another group for b
        with pytest.raises(InvalidBlockError):
            pool.cache_full_blocks([c, b], hashes, group)
        assert (c.block_hash, dict(pool.cached_block_hash_to_block[0])) == before  # c was not published either
    assert b.block_hash == h(1) and pool.get_cached_block(h(2), [0]) is None
    pool.check_invariants()

    off = BlockPool(11, enable_caching=False, enable_kv_cache_events=True)
    (c,) = off.get_new_blocks(1)
    off.cache_full_blocks([c], [h(1)], 0)
    assert c.block_hash is None and off.get_cached_block(h(1), [0]) is None
    assert off.take_events() == []
    off.check_invariants()


def test_kv_events_only_when_enabled():
    for enabled in (False, True):
        pool = BlockPool(4, enable_kv_cache_events=enabled)  # blocks 1, 2, 3
        b = pool.get_new_blocks(2)
        pool.cache_full_blocks([pool.null_block, *b], [h(0), h(1), h(2)], 0, parent_block_hash=h(7),
                               token_ids=list(range(12)), block_size=4, lora_id=3)
        pool.free_blocks(b)  # hashed -> tail: 3 1 2
        assert queue(pool) == [3, 1, 2]
        pool.get_new_blocks(2)  # 3, then 1: evicts hash 1
        pool.evict_blocks([2])
        pool.check_invariants()
        events = pool.take_events()
        if not enabled:
            assert events == []
            continue
        assert len(events) == 3
        stored, removed1, removed2 = events
        assert isinstance(stored, BlockStored)
        assert stored.block_hashes == [h(1), h(2)]  # the null entry is not published
        assert stored.parent_block_hash == h(0)  # so the run's parent is the null slot's key
        assert stored.token_ids == list(range(4, 12))  # the tokens of slots 1 and 2 only
        assert stored.block_size == 4 and stored.lora_id == 3
        assert isinstance(removed1, BlockRemoved) and removed1.block_hashes == [h(1)]
        assert isinstance(removed2, BlockRemoved) and removed2.block_hashes == [h(2)]
        assert pool.take_events() == []  # drained


def test_kv_event_all_blocks_cleared():
    pool = BlockPool(4, enable_kv_cache_events=True)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, [h(1)], 0, block_size=4)
    assert pool.reset_prefix_cache() is False
    assert [type(e) for e in pool.take_events()] == [BlockStored]  # a refused reset emits nothing
    pool.free_blocks(b)
    assert pool.reset_prefix_cache() is True
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]
    pool.check_invariants()

    quiet = BlockPool(4)
    assert quiet.reset_prefix_cache() is True
    assert quiet.take_events() == []


def test_holds_cached_is_true_only_for_this_pools_blocks_under_their_keys() -> None:
    """``holds_cached``: blocks 1, 2 cached under h(1), h(2) in group 0 hold; any block that is
    not (another pool's block with the same id and hash, another group, a shorter key list, the
    null block, an evicted block) makes it False."""
    pool, other = BlockPool(8), BlockPool(8)
    b = pool.get_new_blocks(2)
    o = other.get_new_blocks(2)
    pool.cache_full_blocks(b, [h(1), h(2)], 0)
    other.cache_full_blocks(o, [h(1), h(2)], 0)
    assert [x.block_id for x in b] == [x.block_id for x in o] == [1, 2]
    assert pool.holds_cached(b, [h(1), h(2)], 0)
    assert pool.holds_cached([], [], 0)
    assert not pool.holds_cached(o, [h(1), h(2)], 0)  # same ids and hashes, other objects
    assert not pool.holds_cached(b, [h(1), h(2)], 1)
    assert not pool.holds_cached(b, [h(1)], 0)
    assert not pool.holds_cached(b, [h(2), h(1)], 0)
    assert not pool.holds_cached([pool.null_block], [h(1)], 0)
    pool.free_blocks(b)
    pool.evict_blocks([2])
    assert not pool.holds_cached(b, [h(1), h(2)], 0)
    assert pool.holds_cached(b[:1], [h(1), h(2)], 0)
    pool.check_invariants()
