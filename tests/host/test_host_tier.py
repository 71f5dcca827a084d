"""The host tier through the coordinator's public calls, every number worked out by hand.

Geometry (tests/host/harness.py): 4-token pages of 128 B, a 176 B Mamba state, k = 2 pages per
superblock. A (13 tokens) leaves pages 0..2 and its checkpoint at page 2 (12 tokens); B = A + 10
tokens (23) adds pages 3, 4 and a checkpoint at page 4 (20 tokens); C, D, E: 13 tokens each,
unrelated, pages 0..2 and a checkpoint at page 2 each.
"""

from __future__ import annotations

import pytest

from mambakv import Request
from mambakv.core.errors import InvalidSpecError, LoadPendingError
from mambakv.core.host_tier import HostTierSpec
from mambakv.core.transfers import BlockKind, Tier
from tests.host.harness import B2, SB, A, B, C, E, HostHarness, full_snapshot
from tests.property.fuzz_checks import in_use

PAGE, STATE = BlockKind.PAGE, BlockKind.STATE


def kinds_bytes(transfers) -> list[tuple[str, str, str, int]]:
    return [(t.src_tier.value, t.dst_tier.value, t.kind.value, t.num_bytes) for t in transfers]


# ---------------------------------------------------------------------------- stores
def test_write_through_stores_a_freed_chain_once():
    h = HostHarness()
    c = h.coord
    assert h.run("A", A, 0.0) == 0
    plan = c.take_transfer_plan()
    # A's chain: pages 0, 1, 2 (up to its checkpoint at page 2) and the state at page 2
    assert sorted(kinds_bytes(plan.stores)) == sorted([("gpu", "host", "page", 128)] * 3 + [("gpu", "host", "state", 176)])
    assert plan.bytes_d2h == 3 * 128 + 176 == 560 and plan.loads == ()
    assert len({t.src_block for t in plan.stores if t.kind is PAGE}) == 3  # three distinct GPU pages
    s = c.host.stats
    assert (s.stores, s.stored_pages, s.stored_states, s.bytes_d2h) == (1, 3, 1, 560)
    assert plan.fence == 1
    h.land(plan)  # the engine ran the copies
    assert not c.take_transfer_plan()  # drained
    # the same prefix again: GPU hit 12, the host has the checkpoint already: nothing new
    assert h.run("A2", A, 1.0) == 12
    assert not c.take_transfer_plan()
    assert (s.stores, s.bytes_d2h) == (1, 560)
    # B: the host has pages 0..2, B adds pages 3, 4 and the state at page 4: 2 * 128 + 176 = 432 B
    assert h.run("B", B, 2.0) == 12
    plan = c.take_transfer_plan()
    assert sorted(kinds_bytes(plan.stores)) == sorted([("gpu", "host", "page", 128)] * 2 + [("gpu", "host", "state", 176)])
    assert plan.bytes_d2h == 432 and (s.stores, s.stored_pages, s.stored_states, s.bytes_d2h) == (2, 5, 2, 992)
    assert plan.fence == 2
    h.land(plan)
    h.nothing_held()


def test_write_evict_stores_at_gpu_eviction_only():
    h = HostHarness(write="evict")
    c = h.coord
    h.abcd()
    assert not c.take_transfer_plan() and c.host.stats.stores == 0  # nothing at free
    h.run("E", E, 40.0)
    assert c.units.stats.evictions == 1  # B's unit
    plan = c.take_transfer_plan()
    # B's unit stored with its whole chain (the host has none of it): pages 0..4 and the state at
    # page 4: 5 * 128 + 176 = 816 B; E's own free stores nothing
    assert sorted(kinds_bytes(plan.stores)) == sorted([("gpu", "host", "page", 128)] * 5 + [("gpu", "host", "state", 176)])
    assert plan.bytes_d2h == 816
    s = c.host.stats
    assert (s.stores, s.stored_pages, s.stored_states) == (1, 5, 1)
    c.check_invariants()
    # write 'evict': the stores read blocks E took at once; the fence holds none of them (they
    # must run before E's forward), so nothing is held once E is freed, landed or not
    h.nothing_held()
    h.land(plan)
    h.nothing_held()



# ---------------------------------------------------------------------------- a host hit
@pytest.mark.parametrize("write", ["through", "evict"])
def test_host_hit_load_complete_admit(write):
    h = HostHarness(write=write)
    c = h.coord
    h.evict_b()
    # GPU: A's state at page 2 survives (12 tokens); B's pages 3, 4 and state at page 4 are gone
    assert h.gpu_hit(B2) == 12
    # after E everything is free: 13 usable pages, 5 slot superblocks (test_units' count)
    free0 = h.free_counts()
    assert free0[:2] == (13, 5)
    req = Request("B2", B2, max_tokens=1)
    hit = c.get_computed_blocks_tiered(req, now=50.0)
    c.check_invariants()
    # host: B's chain (5 pages, state at page 4: 20 tokens) within the cap of 6 pages
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (12, 20 - 12)
    assert len(hit.blocks.blocks[0]) == 3  # the GPU part: A's 3 pages
    load = hit.load
    assert load is not None and load.request_id == "B2" and load.num_tokens == 8
    # pages 3 and 4 (128 B each), then the state at page 4 (176 B): 432 B host -> GPU
    assert kinds_bytes(load.transfers) == [("host", "gpu", "page", 128)] * 2 + [("host", "gpu", "state", 176)]
    assert load.num_bytes == 432
    assert {t.group_id for t in load.transfers if t.kind is PAGE} == {0} and load.transfers[-1].group_id == 1
    assert c.load_pending("B2")
    # the load holds A's 3 cached pages (touched) and 2 destination pages: 13 - 5 = 8 free pages;
    # one destination slot: 5 - 1 = 4; the host pins 2 pages and 1 slot
    assert h.free_counts()[:2] == (8, 4)
    assert free0[2:] == (0, 0) and h.free_counts()[2:] == (2, 1)
    plan = c.take_transfer_plan()
    assert plan.loads == (load,) and plan.bytes_h2d == 432
    # tier-unaware lookups never see the host part, before or during the load
    assert h.gpu_hit(B2) == 12
    # allocate before complete_load: refused, nothing changed
    blocks, n = c.get_computed_blocks(req)
    before = full_snapshot(c)
    with pytest.raises(LoadPendingError):
        c.allocate(req, len(B2) - n, num_new_computed_tokens=n, new_computed_blocks=blocks, now=51.0)
    assert full_snapshot(c) == before and c.now == 50.0
    c.check_invariants()
    c.complete_load("B2")
    c.check_invariants()
    assert not c.load_pending("B2")
    assert c.host.stats.loads == 1 and c.host.stats.loaded_tokens == 8 and c.host.stats.bytes_h2d == 432
    # the host unpinned: back to its free counts; the GPU hold stays until the first allocate
    assert h.free_counts() == (8, 4, 0, 0)
    # now the whole hit is a GPU hit
    assert c.get_computed_blocks(req)[1] == 20
    hits_before = c.prefix_cache_stats.host_hits
    _, got = h.prefill("B2", B2, 52.0, request=req)
    assert got == 20
    assert c.prefix_cache_stats.host_hits - hits_before == 8  # of the 20 hit tokens, 8 came from the host
    c.free("B2", now=53.0)
    c.check_invariants()
    # write-through: B2's free stores its new checkpoint, page 5 and the state at page 5 (24
    # tokens; the host has pages 0..4): 1 GPU page and 1 slot held until that plan lands.
    # write 'evict': the free stores nothing, but B2's prefill (page 5 and a state) evicted
    # another 13-token unit (the load's room-making took C's already), stored with its 3 pages
    # and its state (3 * 128 + 176 = 560 B); the fence holds none of it
    held = (1, 1) if write == "through" else (0, 0)
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == held
    plan = h.drain()
    assert plan.bytes_d2h == (128 + 176 if write == "through" else 3 * 128 + 176)
    h.nothing_held()
    assert h.gpu_hit(B2) == 24  # B2 left its own checkpoint at (26 - 1) // 4 * 4 = 24


def test_abort_load_restores_both_tiers_and_retry_works():
    h = HostHarness()
    c = h.coord
    h.evict_b()
    free0 = h.free_counts()
    req = Request("B2", B2)
    hit = c.get_computed_blocks_tiered(req, now=50.0)
    assert hit.num_host_tokens == 8
    c.abort_load("B2")
    c.check_invariants()
    assert not c.load_pending("B2") and c.host.stats.aborted_loads == 1
    assert h.free_counts() == free0  # the 3 touched pages back in the free queue, 2 + 1 dests freed, host unpinned
    assert not c.take_transfer_plan().loads  # the aborted load's plan is dropped
    assert h.gpu_hit(B2) == 12  # the destinations were never published
    with pytest.raises(LoadPendingError):
        c.abort_load("B2")  # no load any more
    # retry: the same load again
    hit = c.get_computed_blocks_tiered(req, now=51.0)
    c.check_invariants()
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load.num_bytes) == (12, 8, 432)
    c.complete_load("B2")
    c.check_invariants()
    _, got = h.prefill("B2", B2, 52.0, request=req)
    assert got == 20 and c.prefix_cache_stats.host_hits == 8
    c.free("B2", now=53.0)
    c.check_invariants()
    # B2's free stores page 5 and its state at 24 tokens (write-through): held until the next
    # plan lands (1 page, 1 slot)
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (1, 1)
    assert h.drain().bytes_d2h == 128 + 176
    h.nothing_held()


def test_free_during_load_aborts_it():
    h = HostHarness()
    c = h.coord
    h.evict_b()
    free0 = h.free_counts()
    c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    assert c.load_pending("B2")
    c.free("B2", now=51.0)
    c.check_invariants()
    assert not c.load_pending("B2") and c.host.stats.aborted_loads == 1
    assert h.free_counts() == free0 and h.gpu_hit(B2) == 12
    with pytest.raises(LoadPendingError):
        c.complete_load("B2")
    h.nothing_held()


def test_free_after_complete_releases_the_hold_and_keeps_the_gpu_hit():
    h = HostHarness()
    c = h.coord
    h.evict_b()
    free0 = h.free_counts()
    c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    c.complete_load("B2")
    c.free("B2", now=51.0)  # never allocated: the hold ends
    c.check_invariants()
    h.nothing_held()
    assert h.free_counts() == free0  # 13 pages, 5 slots free again (5 pages + 1 slot cached, free)
    assert c.host.stats.aborted_loads == 0 and c.prefix_cache_stats.host_hits == 0
    assert h.gpu_hit(B2) == 20  # the loaded chain stays on the GPU: a GPU hit now
    # a new tiered lookup finds everything on the GPU: no load
    hit = c.get_computed_blocks_tiered(Request("B3", B2), now=52.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load) == (20, 0, None)
    c.check_invariants()


def test_no_gpu_room_means_no_load_and_nothing_changed():
    h = HostHarness()
    c = h.coord
    h.evict_b()
    # X: 64 unique tokens prefilled in one chunk and kept running: 16 pages (superblock 0's page +
    # 8 page superblocks, one page spare) and 2 state slots (2 superblocks): 1 + 8 + 2 = 11 of 12.
    # What is left (1 spare page + 1 superblock) cannot hold A's 3 pages and a state, so the GPU
    # part is 0, and the load would need 5 pages + 1 slot: no room.
    h.prefill("X", list(range(1000, 1064)), 45.0)
    req = Request("B2", B2)
    before = full_snapshot(c)
    hit = c.get_computed_blocks_tiered(req, now=50.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load) == (0, 0, None)
    assert not c.load_pending("B2") and not c.take_transfer_plan().loads
    assert full_snapshot(c) == before
    c.check_invariants()
    assert c.host.units.stats.evictions == 0
    c.free("X", now=51.0)
    c.check_invariants()
    # X's stores read all 16 of its pages and both its states: held until they ran, so the GPU
    # has room for a load only once the plan landed (the next step's)
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (16, 2)
    plan = h.drain()
    assert plan.bytes_d2h == 16 * 128 + 2 * 176
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (0, 0)
    # X's write-through store: X was prefilled in chunks 0..60 (the replay boundary
    # (64 - 1) // 4 * 4) and 60..64, so its chain has 16 pages and states at pages 14 and 15. The
    # host (20 superblocks) holds A..E: 14 pages in 8 page superblocks (superblock 0's page + 7 x 2,
    # one page spare) + 5 slot superblocks; 7 free. 2 slots + 16 pages: the 7 free superblocks give
    # 2 slots + 10 pages, + the spare = 11 pages, 5 short. LRU evicts the oldest leaf, B's unit
    # (last use 10): +2 pages, +1 slot (so one more free superblock for pages): 15, still short; A's
    # unit became a leaf just now (a leaf's age starts then), so the next is C's (20): enough.
    assert c.host.units.stats.evictions == 2 and c.host.stats.skipped_stores == 0
    assert c.host.stats.stored_pages == 14 + 16 and c.host.stats.stored_states == 5 + 2
    assert h.gpu_hit(B2) == 0  # X's prefill evicted every GPU unit
    # now there is room, but only A's chain is left on the host: 12 tokens, 3 * 128 + 176 = 560 B
    hit = c.get_computed_blocks_tiered(req, now=52.0)
    c.check_invariants()
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load.num_bytes) == (0, 12, 560)
    c.abort_load("B2")
    c.check_invariants()
    h.nothing_held()


# ---------------------------------------------------------------------------- host budget
def test_host_budget_too_small_for_a_chain_skips_the_store():
    # 2 host superblocks (512 B): superblock 0 holds one usable page, superblock 1 two pages or a
    # slot; A needs 3 pages + 1 slot: it never fits
    h = HostHarness(host_superblocks=2)
    c = h.coord
    h.run("A", A, 0.0)
    assert c.host.stats.skipped_stores == 1 and c.host.stats.stores == 0
    assert not c.take_transfer_plan()
    c.check_invariants()
    h.nothing_held()


def test_host_evicts_units_to_make_room():
    # 4 host superblocks: A takes superblock 0's page + superblock 1 (pages 1, 2) + one slot
    # superblock: 3 of 4. C needs 3 pages + a slot: the 1 free superblock is short, so the host
    # evicts A's unit (its only one), freeing 3 superblocks' worth, and stores C.
    h = HostHarness(host_superblocks=4)
    c = h.coord
    h.run("A", A, 0.0)
    assert c.host.stats.stores == 1 and c.host.units.stats.evictions == 0
    h.run("C", C, 1.0)
    c.check_invariants()
    assert c.host.stats.stores == 2 and c.host.stats.skipped_stores == 0
    assert c.host.units.stats.evictions == 1
    plan = c.take_transfer_plan()
    # A's stores never ran (one plan for both frees) and its unit is gone: only C's remain
    assert plan.bytes_d2h == 3 * 128 + 176
    # the stats count what is left to run: A's 3 page stores and its state store were dropped
    assert c.host.stats.bytes_d2h == 3 * 128 + 176 and c.host.stats.dropped_stores == 4
    # until the plan lands the fence holds C's sources (3 pages, 1 state) and A's (3 pages, 1
    # state: held from A's free, released with the plan even though their stores were dropped)
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (6, 2)
    h.land(plan)
    h.nothing_held()


def test_reset_prefix_cache_clears_host_and_is_refused_during_a_load():
    h = HostHarness()
    c = h.coord
    h.evict_b()
    c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    plan = c.take_transfer_plan()
    assert len(plan.loads) == 1  # the engine takes the load to run it
    before = full_snapshot(c)
    assert c.reset_prefix_cache() is False  # a load in flight: refused, nothing changed
    assert full_snapshot(c) == before
    c.complete_load("B2")
    h.land(plan)
    assert c.reset_prefix_cache() is False  # the completed load still holds its GPU blocks
    c.free("B2", now=51.0)
    assert c.reset_prefix_cache() is True
    c.check_invariants()
    assert c.host.units.num_pages == 0 and not c.take_transfer_plan()
    # the host holds nothing: a tiered lookup finds no hit at all
    hit = c.get_computed_blocks_tiered(Request("B3", B2), now=52.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load) == (0, 0, None)
    c.check_invariants()


# ---------------------------------------------------------------------------- bad input
def test_bad_input():
    h = HostHarness()
    c = h.coord
    with pytest.raises(LoadPendingError):
        c.complete_load("nobody")
    with pytest.raises(LoadPendingError):
        c.abort_load("nobody")
    h.evict_b()
    req = Request("B2", B2)
    c.get_computed_blocks_tiered(req, now=50.0)
    before = full_snapshot(c)
    with pytest.raises(LoadPendingError):
        c.get_computed_blocks_tiered(req, now=60.0)
    assert full_snapshot(c) == before and c.now == 50.0
    c.complete_load("B2")
    with pytest.raises(LoadPendingError):
        c.complete_load("B2")  # done already
    # once complete, a second tiered lookup is the GPU part only (the whole hit now), no new load
    hit = c.get_computed_blocks_tiered(req, now=61.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load) == (20, 0, None)
    c.abort_load("B2")  # ends the completed load's hold
    c.check_invariants()
    h.nothing_held()


@pytest.mark.parametrize("kw", [dict(memory_bytes=0), dict(memory_bytes=-1), dict(memory_bytes=1.5),
                                dict(memory_bytes=SB * 4, write="sometimes"), dict(memory_bytes=SB * 4, block_bytes=0)])
def test_host_tier_spec_bad_fields(kw):
    with pytest.raises(InvalidSpecError):
        HostTierSpec(**kw)


def test_host_budget_below_two_superblocks_is_refused():
    with pytest.raises(InvalidSpecError):
        HostHarness(host_superblocks=1)


def test_tiers_of_load_transfers():
    h = HostHarness()
    h.evict_b()
    hit = h.coord.get_computed_blocks_tiered(Request("B2", B2))
    assert all(t.src_tier is Tier.HOST and t.dst_tier is Tier.GPU for t in hit.load.transfers)
    assert [t.kind for t in hit.load.transfers] == [PAGE, PAGE, STATE]
    h.coord.abort_load("B2")
