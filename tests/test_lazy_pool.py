"""A pool's cost grows with what is used (issue 31, item 2): blocks are made on first use, and
every id still reads as in an eagerly built pool. The free-queue order is checked against a plain
list model of DESIGN.md section 3 (pop from the head; freed unhashed blocks to the head, hashed
ones to the tail; a hit revives a block from anywhere; evict_blocks moves a free one to the head)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

import mambakv.core.block_pool as block_pool
from mambakv import BlockPool, InvalidSpecError, InvalidTokenCountError
from mambakv.core.arena import SuperblockArena, SuperblockGeometry


class ListModel:
    """The free queue as a list of block ids, head first."""

    def __init__(self, num_blocks: int) -> None:
        self.queue = list(range(1, num_blocks))

    def pop(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def free(self, ids: list[int], hashed: set[int]) -> None:
        self.queue = [i for i in ids if i not in hashed] + self.queue + [i for i in ids if i in hashed]


def test_queue_order_matches_an_eager_pool() -> None:
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randrange(2, 60)
        pool, model = BlockPool(n), ListModel(n)
        held: list = []
        hashed: set[int] = set()
        for step in range(80):
            r = rng.random()
            free = pool.get_num_free_blocks()
            if r < 0.35 and free:
                k = rng.randrange(1, free + 1)
                got = pool.get_new_blocks(k)
                assert [b.block_id for b in got] == model.pop(k)
                for b in got:
                    hashed.discard(b.block_id)  # a popped cached block is evicted
                held += got
            elif r < 0.6 and held:
                rng.shuffle(held)
                k = rng.randrange(1, len(held) + 1)
                out, held = held[:k], held[k:]
                for b in out:
                    if b.block_hash is None and rng.random() < 0.5:
                        pool.cache_full_blocks([b], [bytes([step % 256, b.block_id % 256]) * 8], 0)
                        hashed.add(b.block_id)
                pool.free_blocks(out)
                model.free([b.block_id for b in out], hashed)
            elif r < 0.7 and hashed:
                bid = rng.choice(sorted(hashed))
                b = pool.blocks[bid]
                if b.ref_cnt == 0:
                    pool.touch([b])
                    model.queue.remove(bid)
                    held.append(b)
            elif r < 0.8 and hashed:
                bid = rng.choice(sorted(hashed))
                pool.evict_blocks([bid])
                hashed.discard(bid)
                if bid in model.queue:
                    model.queue.remove(bid)
                    model.queue.insert(0, bid)
            else:  # read an arbitrary id: it exists and holds its place
                bid = rng.randrange(n)
                assert pool.blocks[bid].block_id == bid and pool.blocks[bid] is pool.blocks[bid]
            pool.check_invariants()
            assert pool.get_num_free_blocks() == len(model.queue)
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == model.queue
        pool.check_invariants()


def test_blocks_reads_as_an_eager_list() -> None:
    pool = BlockPool(10)
    assert len(pool.blocks) == 10
    assert pool.blocks[-1].block_id == 9 and pool.blocks[3].block_id == 3
    assert [b.block_id for b in pool.blocks[2:5]] == [2, 3, 4]
    assert [b.block_id for b in pool.blocks] == list(range(10))
    assert pool.blocks[0] is pool.null_block and pool.blocks[0].is_null
    with pytest.raises(IndexError):
        pool.blocks[10]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    pool.check_invariants()


def test_ten_million_blocks_cost_next_to_nothing_until_used() -> None:
    """Building 10^7 blocks makes two objects (the null block and the queue's marker), not 10^7:
    well under 1 MB; taking 1,000 blocks makes 1,000 (about 136 B each)."""
    tracemalloc.start()
    try:
        pool = BlockPool(10**7)
        built, _ = tracemalloc.get_traced_memory()
        pool.get_new_blocks(1000)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built < 1 << 20, built
    assert used - built < 1000 * 400
    assert pool.get_num_free_blocks() == 10**7 - 1 - 1000
    pool.check_invariants()


def test_an_arena_makes_a_superblock_when_it_lends_it() -> None:
    """10^6 superblocks of 4 pages: the arena keeps 16 B per page (a block slot, a free-time
    stamp) and about 48 B per superblock (the same for its state slot, two lent flags, its
    kind, its place on the FREE stack), and a superblock's blocks exist once it is lent."""
    tracemalloc.start()
    try:
        arena = SuperblockArena(SuperblockGeometry(10**6, 4, 1024, 3000))
        built, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built < 10**6 * (4 * 16 + 56), built
    arena.make_room(8, 2)
    pages = arena.pages.get_new_blocks(8)
    slots = arena.slots.get_new_blocks(2)
    assert len({b.block_id // 4 for b in pages}) >= 2 and all(s.block_id for s in slots)
    arena.check_invariants()
    assert arena.pages.blocks[4 * 999_999 + 3].ref_cnt == 1  # a withdrawn superblock's page, made on reading
    arena.check_invariants()


def test_absurd_sizes_are_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidSpecError, match="int32"):
        BlockPool(2**31)
    with pytest.raises(InvalidTokenCountError):
        BlockPool(1)
    monkeypatch.setattr(block_pool, "physical_memory_bytes", lambda: 1 << 20)  # a 1 MiB machine
    with pytest.raises(InvalidSpecError, match="larger blocks or pages"):
        BlockPool(10**6)  # 16 MB of bookkeeping
    assert BlockPool(1000).num_blocks == 1000
