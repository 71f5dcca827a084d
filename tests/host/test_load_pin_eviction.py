"""A load in flight pins a host page whose host unit a later write-through store then evicts.

A load pins the host copies of the pages the GPU lacks (and the state, when the GPU lacks it).
When the GPU holds the hit's state but lost one of its pages (``block_pool.evict_blocks``: lost
data), the load pins that one host page and no host state, so the host unit the page belongs to
stays a free leaf: a write-through store that needs room evicts it. ``UnitIndex.prune`` then stops
at the pinned page, and the page's free ancestors stay cached with no checkpoint below them
until the load ends. Before the fix ``HostTier.check_invariants`` failed on them::

    AssertionError: a free cached page at 0 past its chain's deepest checkpoint

while the load was in flight. The chain a load reads is in use (as a running request's chain on
the GPU, exempt through ``live_keys``): ``HostTier.check_invariants`` now exempts the pinned
chains, and ``unpin`` (at ``complete_load`` / ``abort_load``) prunes from each pinned page, so
that no such page outlives the load (checked by the unexempted invariants once nothing is
pinned).
"""

from __future__ import annotations

import pytest

from mambakv import HostTierSpec, KVCacheCoordinator, Request
from mambakv.core.block import KVCacheBlock
from tests.host.harness import B2, B, HostHarness
from tests.host.test_host_layouts import UB, unified_config
from tests.property.fuzz_checks import in_use

X = [400, 401, 402, 403, 404]  # 5 tokens: page 0 and its checkpoint at page 0 (4 tokens)


def chain_keys(toks: list[int]) -> list[bytes]:
    probe = Request("keys", toks)
    probe.set_hash_block_size(4)
    return list(probe.block_hashes)


def host_nodes(coord: KVCacheCoordinator) -> list[tuple[int, bool]]:
    """The host tree: (page index, has a unit) per node."""
    return sorted((i, u is not None) for _, i, u in coord.host.units.page_entries())


def gpu_page(coord: KVCacheCoordinator, key: bytes):
    return coord.block_pool.cached_block_hash_to_block[0][key]


def end_load(coord: KVCacheCoordinator, rid: str, how: str) -> None:
    (coord.complete_load if how == "complete" else coord.abort_load)(rid)
    coord.check_invariants()  # nothing pinned: the unit rules hold unexempted


def unified_pinned_after_eviction() -> tuple[KVCacheCoordinator, HostHarness, list[bytes], KVCacheBlock]:
    """Unified GPU (16 blocks, 15 usable), host of 8 blocks of 256 B (k = 1; block 0 null: 7 usable).

    * B (23 tokens) is freed: the GPU caches pages p0..p4 (blocks 1..5) and the state at p4;
      write-through stores them: host pages p0..p4 + the state at p4, unit U(p4) (the only
      unit and leaf), 6 of 7 host blocks: 6 * 256 = 1536 B. The plan runs and lands
      (``transfers_done``): the fence releases the 6 GPU sources.
    * GPU page p4 is lost (``evict_blocks``): the GPU keeps p0..p3 and the state at p4, so its
      own hit for B2 is 0 (no state at p0..p3).
    * B2 (26 tokens, cap 6 pages): the deepest hit over both tiers is 5 pages (the state at p4
      on the GPU, p4 on the host): GPU part 0, host part 20 tokens, one transfer (host p4 -> a
      GPU page). The host pins its copy of p4 only: U(p4)'s state stays free.
    * X (5 tokens) is freed: its store needs 1 page + 1 slot, the host has 1 free block: the
      host evicts its only leaf, U(p4). Its state goes (X's state takes that slot), pruning
      stops at once at the pinned p4: host nodes p0..p4 of B's chain with no unit (p0..p3
      free, p4 pinned) and X's U(p0). The invariants must hold (before the fix: "a free cached
      page at 0 past its chain's deepest checkpoint"). X's stores (1 page + 1 state) are not
      drained yet: the fence holds their 2 GPU sources.

    Returns (coordinator, harness, B2's chain hashes, the pinned host page p4), B2's load in flight.
    """
    coord = KVCacheCoordinator(unified_config(16), max_model_len=256, host_tier=HostTierSpec(8 * UB, block_bytes=UB))
    h = HostHarness.over(coord)
    host = coord.host
    keys = chain_keys(B2)
    assert h.run("B", B, 0.0) == 0
    assert h.drain().bytes_d2h == 6 * UB
    assert host_nodes(coord) == [(0, False), (1, False), (2, False), (3, False), (4, True)]

    coord.block_pool.evict_blocks([gpu_page(coord, keys[4]).block_id])
    coord.check_invariants()
    assert h.gpu_hit(B2) == 0

    hit = coord.get_computed_blocks_tiered(Request("B2", B2, max_tokens=1), now=1.0)
    coord.check_invariants()
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (0, 20)
    assert [(t.kind.value, t.num_bytes) for t in hit.load.transfers] == [("page", UB)]
    host_p4 = host.arena.pages.cached_block_hash_to_block[0][keys[4]]
    assert host.pins == {host_p4: 1} and hit.load.transfers[0].src_block == host_p4.block_id

    assert h.run("X", X, 2.0) == 0  # check_invariants() after every call, the free's store included
    assert host.units.stats.evictions == 1 and host.stats.skipped_stores == 0
    assert host_nodes(coord) == [(0, False), (0, True), (1, False), (2, False), (3, False), (4, False)]
    assert host_p4.ref_cnt == 1 and host.pinned_chains() == set(keys[:5])
    return coord, h, keys, host_p4


@pytest.mark.parametrize("how", ["complete", "abort"])
def test_unified_load_pins_a_page_of_an_evicted_host_unit(how):
    """``unified_pinned_after_eviction``, then the load ends: unpinning p4 prunes p4, p3, p2,
    p1, p0 (5 host pages); the host keeps X's unit only. Completed: B2's GPU hit is 20 tokens
    (p0..p3 and the state kept, p4 loaded); aborted: 0 (the destination was never published).
    B2's load was never drained (complete: done; aborted: dropped), so the last plan holds X's
    stores only (1 page + 1 state, 2 * 256 B), whose GPU sources stay held until it lands."""
    coord, h, keys, host_p4 = unified_pinned_after_eviction()
    host = coord.host
    end_load(coord, "B2", how)
    assert host_nodes(coord) == [(0, True)]  # X's unit; B's chain pruned from p4 up
    assert host.pins == {} and host_p4.block_hash is None
    assert not in_use(host.arena.pages) and not in_use(host.arena.slots)
    assert h.gpu_hit(B2) == (20 if how == "complete" else 0)
    coord.free("B2", now=3.0)
    coord.check_invariants()
    assert in_use(coord.block_pool) == 2  # X's page and state (one pool: unified)
    plan = h.drain()
    assert plan.loads == () and plan.bytes_d2h == 2 * UB
    h.nothing_held()


def test_the_exemption_ends_with_the_pin():
    # The pinned chain is exempt only while pinned: released without unpin's pruning (as the
    # defect would leak them), B's free pages p0..p4 past every checkpoint fail the check.
    coord, _, _, host_p4 = unified_pinned_after_eviction()
    host = coord.host
    host.arena.pages.free_blocks([host_p4])
    host.pins.clear()
    with pytest.raises(AssertionError, match="past its chain's deepest checkpoint"):
        host.check_invariants()


@pytest.mark.parametrize("how", ["complete", "abort"])
def test_decoupled_load_pins_a_page_of_an_evicted_host_unit(how):
    """The decoupled harness (tests/host/harness.py), host of 5 superblocks (k = 2 pages).

    * B (23 tokens) is freed: the GPU and the host hold U(p4): pages p0..p4 and the state at
      p4. Host superblocks: 0 (null + p0), two of pages (p1..p4), one slot; one FREE. The
      stores run and land (``transfers_done``): the fence releases B's GPU blocks.
    * GPU p4 is lost (``evict_blocks``): the GPU's tree breaks at p4, U(p4) goes, p0..p3 are
      pruned: the GPU caches nothing of B.
    * B2 loads all of B's chain from the host (GPU 0, host 20 tokens) and completes: its GPU
      destinations are published and held until its first allocate or free. Its p4 is lost
      again (a held block: only its hash goes).
    * B3 (B2's tokens): the GPU has p0..p3 and the state at p4 (held by B2), the host p0..p4:
      a 20-token hit, GPU part 0 (no GPU state at p0..p3). One transfer: host p4 -> a GPU page;
      the host pins its copy of p4 only. B2 is freed (never admitted: no store).
    * X (5 tokens) is freed: its store needs 1 page + 1 slot, and only the FREE superblock is
      left: the host evicts its only leaf U(p4); its slot goes to X's state, the FREE
      superblock to X's page; pruning stops at the pinned p4: B's p0..p3 stay free, p4 pinned,
      no unit on the chain. The invariants must hold (before the fix: "a free cached page at 0
      past its chain's deepest checkpoint").
    * B3's load ends: unpinning p4 prunes p4..p0; the host keeps X's unit only. Completed and
      freed, B3's chain joins the GPU units (U(p4): a 20-token GPU hit); aborted, its GPU part
      has no state left on a whole chain (p4 was never published): a GPU hit of 0.
    * The last plan holds X's stores only (B2's and B3's loads were never drained: the engine
      ran them itself): 128 + 176 B; their GPU page and slot stay held until it lands.
    """
    h = HostHarness(host_superblocks=5)
    c = h.coord
    host = c.host
    keys = chain_keys(B2)
    assert h.run("B", B, 0.0) == 0
    assert h.drain().bytes_d2h == 5 * 128 + 176
    assert host_nodes(c) == [(0, False), (1, False), (2, False), (3, False), (4, True)]

    c.block_pool.evict_blocks([gpu_page(c, keys[4]).block_id])
    c.check_invariants()
    assert not c.units.num_pages and h.gpu_hit(B2) == 0
    hit = c.get_computed_blocks_tiered(Request("B2", B2, max_tokens=1), now=1.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (0, 20)
    c.complete_load("B2")
    c.check_invariants()
    c.block_pool.evict_blocks([gpu_page(c, keys[4]).block_id])
    c.check_invariants()

    req = Request("B3", B2, max_tokens=1)
    hit = c.get_computed_blocks_tiered(req, now=2.0)
    c.check_invariants()
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (0, 20)
    assert [(t.kind.value, t.num_bytes) for t in hit.load.transfers] == [("page", 128)]
    host_p4 = host.arena.pages.cached_block_hash_to_block[0][keys[4]]
    assert host.pins == {host_p4: 1}
    c.free("B2", now=3.0)
    c.check_invariants()

    assert h.run("X", X, 4.0) == 0  # check_invariants() after every call, the free's store included
    assert host.units.stats.evictions == 1 and host.stats.skipped_stores == 0
    assert host_nodes(c) == [(0, False), (0, True), (1, False), (2, False), (3, False), (4, False)]
    assert host_p4.ref_cnt == 1 and host.pinned_chains() == set(keys[:5])

    end_load(c, "B3", how)
    assert host_nodes(c) == [(0, True)]
    assert host.pins == {} and not in_use(host.arena.pages) and not in_use(host.arena.slots)
    c.free("B3", now=5.0)
    c.check_invariants()
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (1, 1)  # X's page and state
    plan = h.drain()
    assert plan.loads == () and plan.bytes_d2h == 128 + 176
    h.nothing_held()
    assert h.gpu_hit(B2) == (20 if how == "complete" else 0)
