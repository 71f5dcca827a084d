"""SuperblockArena / ArenaPool (issue 14), worked out by hand on tiny geometries."""

from __future__ import annotations

import copy
import random

import pytest

from mambakv import KVCacheCoordinator, Request
from mambakv.core.arena import FREE, PAGES, SLOT, ArenaBytes, SuperblockArena, SuperblockGeometry
from mambakv.core.errors import OutOfBlocksError
from tests.test_decoupled_layout import small_config


def arena(num_superblocks: int = 4, k: int = 3) -> SuperblockArena:
    return SuperblockArena(SuperblockGeometry(num_superblocks, k, 10, 25))


def free_superblocks(pool) -> list[int]:
    """Every all-free superblock of `pool`, in the arena's walk order."""
    return [sb for sb, _ in pool.find_free_superblocks(len(pool.lent))]


def test_freeing_the_null_block_never_frees_superblock_0():
    """Mamba tables (and sliding-window ones) hold the null block; freeing them must not make
    superblock 0 look free: the page pool would convert the null page's superblock into a
    state slot."""
    a = arena()
    a.slots.free_blocks([a.slots.null_block] * 3)
    a.pages.free_blocks([a.pages.null_block])
    a.check_invariants()
    assert not a.pages.superblock_is_free(0) and not a.slots.superblock_is_free(0)
    assert 0 not in free_superblocks(a.pages)
    b = arena(2)
    b.make_room(0, 1)
    assert b.slots.get_new_blocks(1)[0].block_id == 1  # the one FREE superblock became slot 1
    b.pages.free_blocks([b.pages.null_block])
    assert not b.can_supply(0, 1)  # superblock 0 holds the null page: it never converts
    b.check_invariants()


# ---------------------------------------------------------------------- helpers
def ids(pool) -> list[int]:
    """The free queue, head (next popped) first."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def full_arena() -> tuple[SuperblockArena, list, list]:
    """4 superblocks of k = 3: superblock 1 a SLOT (slot 1), 0, 2 and 3 PAGES; every block held
    and hashed. Returns (arena, the 8 pages by superblock order, [slot 1])."""
    a = arena()
    a.make_room(0, 1)
    slot = a.slots.get_new_blocks(1)
    a.make_room(8, 0)
    pages = sorted(a.pages.get_new_blocks(8), key=lambda b: b.block_id)
    assert [b.block_id for b in pages] == [1, 2, 6, 7, 8, 9, 10, 11]
    a.pages.cache_full_blocks(pages, [b"p%d" % b.block_id for b in pages], 0)
    a.slots.cache_full_blocks(slot, [b"s1"], 0)
    assert a.kind == [PAGES, SLOT, PAGES, PAGES] and a.num_free_superblocks == 0
    assert a.bytes == ArenaBytes(90, 25, 5, 0, 120) and a.usage == 1.0
    assert not a.can_supply(1, 0) and not a.can_supply(0, 1)
    a.check_invariants()
    return a, pages, slot


def cached(pool) -> set[bytes]:
    return {b.block_hash for b in pool.blocks if b.block_hash is not None}


# ---------------------------------------------------------------------- by hand
def test_initial_state():
    a = arena()
    assert a.kind == [PAGES, FREE, FREE, FREE] and a.num_free_superblocks == 3 and a.num_conversions == 0
    assert ids(a.pages) == [1, 2] and ids(a.slots) == []  # only superblock 0 lent: k - 1 free pages
    assert a.pages.num_reserved_blocks == 9 and a.slots.num_reserved_blocks == 3
    assert a.bytes == ArenaBytes(pages=30, states=0, idle=0, free=90, total=120)
    assert a.usage == 0.0
    assert a.can_supply(2 + 3 * 3, 0) and not a.can_supply(12, 0)
    assert a.can_supply(0, 3) and not a.can_supply(0, 4)  # slot 0 is null: 3 slots at most
    assert a.can_supply(2, 3) and not a.can_supply(3, 3)
    a.check_invariants()


def test_a_slot_need_converts_a_free_superblock():
    a = arena()
    a.make_room(0, 1)
    assert a.kind == [PAGES, SLOT, FREE, FREE] and ids(a.slots) == [1] and a.num_conversions == 1
    assert a.bytes == ArenaBytes(30, 25, 5, 60, 120)
    a.check_invariants()
    (s,) = a.slots.get_new_blocks(1)
    assert s.block_id == 1 and not a.slots.superblock_is_free(1)
    assert a.usage == 30 / 110  # one held slot costs its whole superblock (idle tail included)
    a.make_room(0, 0)  # nothing needed: nothing converts
    assert a.num_conversions == 1
    a.check_invariants()


def test_a_page_need_takes_free_pages_first_then_a_free_superblock():
    a = arena()
    a.make_room(2, 0)  # the two free pages of superblock 0 suffice
    assert a.kind == [PAGES, FREE, FREE, FREE] and a.num_conversions == 0
    a.make_room(3, 0)
    assert a.kind == [PAGES, PAGES, FREE, FREE] and a.num_conversions == 1
    assert ids(a.pages) == [3, 4, 5, 1, 2]  # the lent superblock's pages at the head
    assert free_superblocks(a.pages) == [1]
    got = a.pages.get_new_blocks(3)
    assert [b.block_id for b in got] == [3, 4, 5] and free_superblocks(a.pages) == []
    a.check_invariants()
    a.pages.free_blocks(got[:2])
    assert free_superblocks(a.pages) == []  # page 5 still held
    a.pages.free_blocks(got[2:])
    assert a.pages.find_free_superblocks(1) == [(1, a.pages.clock.now)]  # aged by its newest page
    a.check_invariants()


def test_page_need_when_full_older_cached_slot_converts():
    a, pages, slot = full_arena()
    a.slots.free_blocks(slot)  # tick 1: the slot is the LRU memory
    a.pages.free_blocks(pages[:2])  # tick 2: pages 1, 2 (superblock 0: never converted)
    a.check_invariants()
    assert a.slots.freed_at[1] < a.pages.freed_at[1]
    assert a.can_supply(2 + 3, 0) and not a.can_supply(6, 0)
    a.make_room(1, 0)
    assert a.kind == [PAGES, PAGES, PAGES, PAGES] and a.num_conversions == 4
    assert cached(a.slots) == set() and cached(a.pages) == {b"p%d" % i for i in (1, 2, 6, 7, 8, 9, 10, 11)}
    assert a.pages.get_new_blocks(1)[0].block_id == 3  # the converted superblock's first page
    a.check_invariants()


def test_page_need_when_full_older_cached_page_is_evicted():
    a, pages, slot = full_arena()
    a.pages.free_blocks(pages[:2])  # tick 1: pages 1, 2 are the LRU memory
    a.slots.free_blocks(slot)  # tick 2
    a.make_room(1, 0)
    assert a.kind == [PAGES, SLOT, PAGES, PAGES] and a.num_conversions == 3
    assert a.pages.get_new_blocks(1)[0].block_id == 1 and b"p1" not in cached(a.pages)
    assert cached(a.slots) == {b"s1"}
    a.check_invariants()


def test_page_need_an_unhashed_free_slot_yields_to_older_cached_pages():
    """An unhashed free slot is compared by its free time too: cached pages freed before it are
    evicted first (turning a just-freed running state into pages churns superblocks)."""
    a, pages, slot = full_arena()
    a.pages.free_blocks(pages[:2])  # tick 1: older than the slot
    a.slots.evict_blocks([1])  # the slot loses its hash while held
    a.slots.free_blocks(slot)  # tick 2, unhashed
    a.make_room(1, 0)
    assert a.kind == [PAGES, SLOT, PAGES, PAGES] and a.num_conversions == 3
    assert a.pages.get_new_blocks(1)[0].block_id == 1 and b"p1" not in cached(a.pages)
    a.check_invariants()
    a.make_room(2, 0)  # page 2 (tick 1) is evicted; then the slot (tick 2) converts
    assert a.kind == [PAGES, PAGES, PAGES, PAGES] and a.num_conversions == 4
    assert [b.block_id for b in a.pages.get_new_blocks(2)] == [3, 4]
    assert b"p2" in cached(a.pages)
    a.check_invariants()


def test_page_need_converts_an_older_unhashed_free_slot():
    a, pages, slot = full_arena()
    a.slots.evict_blocks([1])
    a.slots.free_blocks(slot)  # tick 1, unhashed: older than every cached page
    a.pages.free_blocks(pages[:2])  # tick 2
    a.make_room(1, 0)
    assert a.kind == [PAGES, PAGES, PAGES, PAGES]
    assert cached(a.pages) == {b"p%d" % i for i in (1, 2, 6, 7, 8, 9, 10, 11)}
    a.check_invariants()


def test_page_need_keeps_the_free_slot_this_step_needs():
    a, pages, slot = full_arena()
    a.slots.free_blocks(slot)  # tick 1: older, but this step pops it as its slot
    a.pages.free_blocks(pages[:2])  # tick 2
    assert a.can_supply(1, 1) and a.can_supply(2, 1) and not a.can_supply(3, 1)
    a.make_room(1, 1)
    assert a.kind == [PAGES, SLOT, PAGES, PAGES]
    assert a.slots.get_new_blocks(1)[0].block_id == 1 and a.pages.get_new_blocks(1)[0].block_id == 1
    a.check_invariants()


def test_slot_need_when_full_older_page_superblock_converts():
    a, pages, slot = full_arena()
    sb3 = [b for b in pages if b.block_id // 3 == 3]
    a.pages.free_blocks(sb3)  # tick 1: superblock 3 all free, the LRU memory
    a.slots.free_blocks(slot)  # tick 2
    assert free_superblocks(a.pages) == [3]
    assert a.can_supply(0, 2) and not a.can_supply(0, 3) and not a.can_supply(1, 2)
    a.make_room(0, 1)
    assert a.kind == [PAGES, SLOT, PAGES, SLOT] and a.num_conversions == 4
    assert cached(a.slots) == {b"s1"} and not {b"p9", b"p10", b"p11"} & cached(a.pages)
    assert a.slots.get_new_blocks(1)[0].block_id == 3
    a.check_invariants()


def test_slot_need_when_full_older_cached_slot_is_evicted():
    a, pages, slot = full_arena()
    a.slots.free_blocks(slot)  # tick 1: the slot is the LRU memory
    a.pages.free_blocks([b for b in pages if b.block_id // 3 == 3])  # tick 2
    a.make_room(0, 1)
    assert a.kind == [PAGES, SLOT, PAGES, PAGES] and a.num_conversions == 3
    assert a.slots.get_new_blocks(1)[0].block_id == 1 and cached(a.slots) == set()
    assert {b"p9", b"p10", b"p11"} <= cached(a.pages)
    a.check_invariants()


def test_slot_need_does_not_convert_the_pages_this_step_needs():
    a, pages, slot = full_arena()
    a.pages.free_blocks([b for b in pages if b.block_id // 3 == 3])  # tick 1: older
    a.slots.free_blocks(slot)  # tick 2
    a.make_room(1, 1)  # converting superblock 3 would leave no page: the slot is evicted
    assert a.kind == [PAGES, SLOT, PAGES, PAGES]
    a.slots.get_new_blocks(1), a.pages.get_new_blocks(1)
    a.check_invariants()


def test_a_slot_converts_back_only_when_free():
    a, pages, slot = full_arena()
    a.pages.free_blocks(pages)  # everything but the slot is free and cached
    assert sorted(free_superblocks(a.pages)) == [2, 3]
    assert not a.can_supply(9, 0)  # 8 pages: the held slot never converts
    assert a.can_supply(8, 0)
    a.make_room(8, 0)
    assert a.kind == [PAGES, SLOT, PAGES, PAGES]
    a.check_invariants()


def test_free_hit_blocks_count_in_can_supply():
    a, pages, slot = full_arena()
    a.pages.free_blocks(pages)  # tick 1: superblocks 2, 3 convertible
    a.slots.free_blocks(slot)
    hit = [b for b in pages if b.block_id == 6]  # a hit page of superblock 2: it is touched, not popped
    assert a.can_supply(0, 2) and a.can_supply(0, 3)  # slot 1 + superblocks 2 and 3
    assert a.can_supply(1, 2, hit) and not a.can_supply(1, 3, hit)  # superblock 2 holds the hit
    assert a.can_supply(11, 0, hit) and not a.can_supply(12, 0, hit)  # the free slot converts too
    assert a.can_supply(8, 1, slot) and not a.can_supply(9, 1, slot)  # the hit slot is not converted
    assert a.can_supply(1, 2, slot + hit) and not a.can_supply(1, 3, slot + hit)  # superblock 3 only
    for n_p, n_s, hits in ((11, 0, hit), (8, 1, slot), (1, 2, slot + hit)):
        assert supplies(a, n_p, n_s, hits)
    for n_p, n_s, hits in ((12, 0, hit), (9, 1, slot), (1, 3, slot + hit)):
        assert not supplies(a, n_p, n_s, hits)
    a.check_invariants()


def supplies(a: SuperblockArena, num_pages: int, num_slots: int, hits=()) -> bool:
    """The ground truth can_supply claims, on a copy: touch the free hits, make_room for the
    rest, pop it; True iff nothing raised (and the copy's invariants hold)."""
    c = copy.deepcopy((a, list(hits)))
    b, hs = c
    hp = [h for h in hs if not h.ref_cnt and not h.is_null and h.pool_id == b.pages.pool_id]
    hs_ = [h for h in hs if not h.ref_cnt and not h.is_null and h.pool_id == b.slots.pool_id]
    b.pages.touch(hp)
    b.slots.touch(hs_)
    try:
        b.make_room(num_pages - len(hp), num_slots - len(hs_))
        got_p = b.pages.get_new_blocks(num_pages - len(hp))
        got_s = b.slots.get_new_blocks(num_slots - len(hs_))
    except (OutOfBlocksError, ValueError, AssertionError):
        return False
    assert len(got_p) == num_pages - len(hp) and len(got_s) == num_slots - len(hs_)
    b.check_invariants()
    return True


@pytest.mark.parametrize("seed", range(40))
def test_can_supply_is_exact(seed):
    """On random reachable states (k = 3, 4 superblocks; blocks held, hashed, freed at random
    ticks), can_supply(p, s, hits) == the copy's make_room + pops succeed, for every p <= 13,
    s <= 4 and a random choice of free hit blocks."""
    rnd = random.Random(seed)
    a = arena()
    held: list = []
    n = 0
    for _ in range(rnd.randrange(3, 25)):
        if held and rnd.random() < 0.45:
            rnd.shuffle(held)
            cut = rnd.randrange(1, len(held) + 1)
            gone, held[:] = held[:cut], held[cut:]
            for pool in (a.pages, a.slots):
                pool.free_blocks([b for b in gone if b.pool_id == pool.pool_id])
        else:
            n_p, n_s = rnd.randrange(0, 5), rnd.randrange(0, 2)
            if not a.can_supply(n_p, n_s):
                continue
            a.make_room(n_p, n_s)
            for pool, m in ((a.pages, n_p), (a.slots, n_s)):
                got = pool.get_new_blocks(m)
                fresh = [b for b in got if rnd.random() < 0.7]
                pool.cache_full_blocks(fresh, [b"h%d" % (n + i) for i in range(len(fresh))], 0)
                n += len(fresh)
                held += got
        a.check_invariants()
    free_cached = [b for pool in (a.pages, a.slots) for b in pool.blocks
                   if b.block_hash is not None and not b.ref_cnt]
    for trial in range(3):
        hits = [] if trial == 0 else [b for b in free_cached if rnd.random() < 0.4]
        hp = sum(1 for b in hits if b.pool_id == a.pages.pool_id)
        hs = len(hits) - hp
        for n_p in range(hp, 14):
            for n_s in range(hs, 5):
                assert a.can_supply(n_p, n_s, hits) == supplies(a, n_p, n_s, hits), (n_p, n_s, [b.block_id for b in hits])
                if not hits:  # a running request's step (no hits: the fast path)
                    assert a.can_supply(n_p, n_s) == supplies(a, n_p, n_s), (n_p, n_s)
    a.check_invariants()


# ---------------------------------------------------------------------- through the coordinator
def arena_snapshot(coord: KVCacheCoordinator) -> tuple:
    """Every piece of both pools and the arena an allocate may touch."""
    arena_ = coord.arena
    assert arena_ is not None
    pools = []
    for pool in (arena_.pages, arena_.slots):
        pools.append((
            tuple((b.ref_cnt, b.block_hash, b.cache_group_id) for b in pool.blocks), ids(pool),
            {gid: dict(m) for gid, m in pool.cached_block_hash_to_block.items()},
            tuple(pool.freed_at), tuple(pool.lent), tuple(pool.find_free_superblocks(len(pool.lent))),
            pool.num_reserved_blocks, pool.get_num_free_blocks(), pool.clock.now))
    tables = {rid: coord.get_block_ids(rid) for rid in coord.request_ids}
    return (pools, tuple(arena_.kind), arena_.bytes, arena_.num_conversions, arena_.num_free_superblocks,
            tables, coord.usage)


@pytest.mark.parametrize("seed", range(8))
def test_a_failed_allocate_changes_nothing(seed):
    """Requests with shared prefixes on a 5-superblock decoupled config until allocations fail;
    every None leaves pools, arena and tables exactly as they were, and can_allocate agrees
    with allocate beforehand."""
    coord = KVCacheCoordinator(small_config(5), max_model_len=128)
    rnd = random.Random(seed)
    base = [rnd.randrange(1, 40) for _ in range(60)]
    live: list[Request] = []
    failed = 0
    for n in range(80):
        if live and rnd.random() < 0.25:
            coord.free(live.pop(rnd.randrange(len(live))).request_id)
            coord.check_invariants()
            continue
        toks = base[:rnd.randrange(4, 60)] + [rnd.randrange(40, 80) for _ in range(rnd.randrange(0, 8))]
        req = Request(f"r{n}", toks)
        hit, num_hit = coord.get_computed_blocks(req)
        num_new = len(toks) - num_hit
        expect = coord.can_allocate(req, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hit)
        before = arena_snapshot(coord)
        out = coord.allocate(req, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hit)
        assert (out is not None) == expect
        coord.check_invariants()
        if out is None:
            failed += 1
            assert arena_snapshot(coord) == before
            continue
        req.num_computed_tokens = len(toks)
        coord.retire(req.request_id, len(toks))
        coord.take_copy_plan(), coord.take_zero_plan()
        live.append(req)
        coord.check_invariants()
    assert failed > 0
