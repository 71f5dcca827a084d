"""Regressions found while writing tests/host."""

from __future__ import annotations

import pytest

from mambakv import HostTierSpec, InvalidSpecError, Request
from tests.eviction.test_units import config
from tests.host.harness import B2, A, HostHarness


def test_completed_load_is_not_handed_out_again():
    # An engine that runs hit.load.transfers itself (the documented alternative to
    # take_transfer_plan().loads) still drains take_transfer_plan() for its stores. A load it
    # completed (and whose hold ended at free) must not come back in a later plan: its GPU
    # destinations (2 pages, 1 slot) are free blocks by then, and rerunning it would overwrite
    # whatever they hold next. Before the fix the completed load stayed queued, even across a
    # successful reset_prefix_cache (which does clear the queued stores).
    h = HostHarness()
    c = h.coord
    h.evict_b()  # E's stores drained and landed
    hit = c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    assert hit.load is not None  # the engine runs these copies itself
    c.complete_load("B2")
    assert c.take_transfer_plan().loads == ()
    c.check_invariants()


def test_reset_after_a_released_load_leaves_no_plan():
    h = HostHarness()
    c = h.coord
    h.evict_b()  # E's stores drained and landed
    c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    c.complete_load("B2")
    c.free("B2", now=51.0)
    assert c.reset_prefix_cache() is True
    assert not c.take_transfer_plan()  # no stores, no loads into blocks the reset freed
    c.check_invariants()


def test_one_plan_never_writes_a_host_block_twice():
    # 4 host superblocks; A and C are freed in one step (the engine drains the plan once per
    # step). A's store takes superblock 0's page, one page superblock and one slot superblock
    # (3 of 4); C's store (3 pages + a slot) makes the host evict A's unit and reuse its blocks
    # before A's copies ever ran. Before the fix the plan held A's 4 stores and C's 4 into the
    # same host blocks: HostArena.run refuses a batch with overlapping destinations
    # (InvalidCopyPlanError), and a batched copy with duplicates is ill-defined anyway. A's
    # stores are dead (their unit is gone): only C's remain, 3 * 128 + 176 = 560 B.
    import torch

    from mambakv.device import HostArena
    from mambakv.device.decoupled import DecoupledLayout
    from tests.eviction.test_units import config
    from tests.host.harness import A, C

    h = HostHarness(host_superblocks=4)
    c = h.coord
    h.run("A", A, 0.0)
    h.run("C", C, 1.0)
    assert c.host.units.stats.evictions == 1
    plan = c.take_transfer_plan()
    dsts = [(t.kind, t.dst_block) for t in plan.stores]
    assert len(set(dsts)) == len(dsts)
    assert plan.bytes_d2h == 560
    lay = DecoupledLayout(config(12), "cpu")
    gen = torch.Generator().manual_seed(3)
    for r in lay.raw:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
    host = HostArena(lay, c.host.geometry, pin_memory=False)
    assert host.run(plan) == 560
    for t in plan.stores:  # C's bytes, byte for byte, where the host tier says they are
        rows = (lambda raw, i: raw.view(-1)[i * 128:(i + 1) * 128]) if t.kind.value == "page" else (
            lambda raw, i: raw.view(-1)[i * 256:i * 256 + 176])
        assert torch.equal(rows(host.raw[0], t.dst_block), rows(lay.raw[0], t.src_block))
    c.check_invariants()


def test_abort_after_the_load_evicted_the_gpu_part_state():
    # After A..E (B's unit evicted from the GPU), C, D and E run again (GPU hits, touched at 41..43),
    # so A's unit (a leaf since 40) is the oldest. B2's load needs 2 pages + 1 slot and the GPU has
    # no free superblock: LRU evicts A's unit (its pages 0..2 are held by the load, only its state
    # slot goes), then C's (3 pages). The GPU part's state is gone meanwhile, so a tier-unaware
    # lookup finds nothing. Aborting the load frees pages 0..2: cached pages with no checkpoint
    # left on their chain. Before the fix the abort freed them without telling the unit index
    # (check_invariants: "a free cached page ... past its chain's deepest checkpoint").
    from tests.host.harness import C, D, E

    h = HostHarness()
    c = h.coord
    h.evict_b()
    for rid, toks, now in (("C2", C, 41.0), ("D2", D, 42.0), ("E2", E, 43.0)):
        assert h.run(rid, toks, now) == 12
    hit = c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (12, 8)
    c.check_invariants()
    assert h.gpu_hit(B2) == 0  # A's state went to make room for the load
    c.abort_load("B2")
    c.check_invariants()
    h.nothing_held()
    assert h.gpu_hit(B2) == 0
    # a retry loads everything from the host: pages 0..4 and the state at page 4
    hit = c.get_computed_blocks_tiered(Request("B2", B2), now=51.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens, hit.load.num_bytes) == (0, 20, 5 * 128 + 176)
    c.complete_load("B2")
    c.free("B2", now=52.0)
    c.check_invariants()
    h.nothing_held()


def test_free_after_a_loaded_page_was_lost():
    # The load completes; then the GPU loses one of its loaded pages (evict_blocks: its data was
    # lost). Freeing the never-admitted request ends the hold; before the fix the chain it gave
    # the unit index was looked up by hash and had None for the lost page: AttributeError.
    h = HostHarness()
    c = h.coord
    h.evict_b()
    hit = c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    c.complete_load("B2")
    first_loaded_page = hit.load.transfers[0].dst_block  # page 3 of the chain
    c.block_pool.evict_blocks([first_loaded_page])
    c.check_invariants()
    c.free("B2", now=51.0)
    c.check_invariants()
    h.nothing_held()
    assert h.gpu_hit(B2) == 12  # back to A's state: page 3 is gone, page 4 unreachable


def test_unpin_after_the_host_lost_the_loaded_unit():
    # Found by tests/property/test_fuzz_host.py (shrunk): a load pins the host copies of the
    # pages missing on the GPU and the state, not the hit's pages the GPU has. A write-through
    # store for another request then reuses such an unpinned host page (a fallback pop: the
    # host arena is 5 superblocks of one page), which takes its subtree, the loaded unit
    # included, out of the host's tree while its state and pages are pinned. Before the fix the
    # abort unpinned them as cached blocks without a unit ("a free cached state without its unit").
    import tests.property.conftest  # noqa: F401  (the hypothesis profiles the machine module reads)
    from tests.property.test_fuzz_host import HostFuzzConfig, HostFuzzMachine

    m = HostFuzzMachine()
    m.setup(cfg=HostFuzzConfig(2, ("full", "mamba"), (19, 1), 0, 5, "through", "lru", "lru",
                               ((1, 1) + (1,) * 22, (1, 2) + (1,) * 22)))
    steps = [("add", dict(cut=7, max_tokens=1, src=1, tail=[])), ("admit", dict(chunk=4, i=0)),
             ("add", dict(cut=7, max_tokens=1, src=0, tail=[])), ("admit", dict(chunk=6, i=0)),
             ("finish", dict(i=1, preempt=True)),
             # the engine's next step runs the preempted request's write-through stores, which
             # hold its GPU blocks until they land (the fence)
             ("drain_plan", {}), ("land", dict(every=True, probe=1)),
             ("add", dict(cut=0, max_tokens=1, src=0, tail=[1, 1, 1])),
             ("admit", dict(chunk=4, i=0)), ("admit", dict(chunk=4, i=0)),
             ("add", dict(cut=0, max_tokens=1, src=0, tail=[])), ("add", dict(cut=7, max_tokens=1, src=0, tail=[])),
             ("admit", dict(chunk=4, i=0)), ("tiered", dict(i=0))]
    for name, kw in steps:
        for r in m.reqs.values():
            r.looked = True  # as in the shrunk run (admissions then needed no tiered lookup first)
        getattr(m, name)(**kw)
        m.consistent()
    assert m.reqs["h4"].status == "loading"
    m.teardown()  # frees h0..h3 (their stores evict on the host), then h4: its load aborts


def test_host_hits_count_only_at_a_first_admission():
    # B2 is admitted (A's 12 tokens hit), preempted, and resumed through a host load (20 tokens:
    # B's chain, the GPU part 12 + the host's 8). The resumed admission is counted in the
    # preempted_* fields, so its 8 host tokens must not be counted in host_hits (hits - host_hits
    # would count tokens hits never had; hit_rate_gpu could go below zero).
    h = HostHarness()
    c = h.coord
    h.evict_b()  # E's stores drained and landed
    hits0 = c.prefix_cache_stats.hits  # B's 12 tokens earlier
    req = Request("B2", B2, max_tokens=1)
    blocks, n = c.get_computed_blocks(req)
    assert n == 12
    assert c.allocate(req, 4, num_new_computed_tokens=n, new_computed_blocks=blocks, num_draft_tokens=0, now=50.0)
    assert c.prefix_cache_stats.hits == hits0 + 12 and c.prefix_cache_stats.host_hits == 0
    assert c.preempt_all() == ["B2"]
    c.check_invariants()
    hit = c.get_computed_blocks_tiered(req, now=51.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (12, 8)
    c.complete_load("B2")
    blocks, n = c.get_computed_blocks(req)
    assert n == 20
    assert c.allocate(req, len(B2) - n, num_new_computed_tokens=n, new_computed_blocks=blocks, num_draft_tokens=0,
                      now=52.0)
    c.check_invariants()
    stats = c.prefix_cache_stats
    assert (stats.hits - hits0, stats.preempted_hits, stats.host_hits) == (12, 20, 0)
    assert stats.hit_rate_gpu == stats.hit_rate


@pytest.mark.parametrize("complete", [False, True])
def test_preempt_all_aborts_loads_so_reset_succeeds(complete):
    # docs/engine-integration.md: preempt_all() then reset_prefix_cache() with requests running.
    # A load in flight (or complete, not yet allocated) holds GPU blocks and pins host ones:
    # before the fix preempt_all left it, and the reset returned False.
    h = HostHarness()
    c = h.coord
    h.evict_b()  # E's stores drained and landed
    hit = c.get_computed_blocks_tiered(Request("B2", B2), now=50.0)
    assert hit.load is not None
    if complete:
        c.complete_load("B2")
    assert c.preempt_all() == ["B2"]
    c.check_invariants()
    assert not c.load_pending("B2") and c.take_transfer_plan().loads == ()
    assert c.reset_prefix_cache()
    c.check_invariants()
    assert c.host.units.num_pages == 0 and c.get_computed_blocks(Request("B3", B2))[1] == 0


def test_host_spec_refusals():
    from mambakv.core.host_spec import MAX_HOST_BLOCKS
    from mambakv.core.spec import KVCacheConfig

    geo = config(12).superblocks
    assert isinstance(config(12), KVCacheConfig) and geo is not None
    with pytest.raises(InvalidSpecError, match="unified"):  # decoupled: the sizes come from the config
        HostTierSpec(1 << 20, block_bytes=100).geometry(geo)
    # 256 B superblocks of 2 pages: MAX_HOST_BLOCKS pages is MAX_HOST_BLOCKS // 2 superblocks
    HostTierSpec(MAX_HOST_BLOCKS // 2 * 256).geometry(geo)
    with pytest.raises(InvalidSpecError, match="at most"):  # before: built 2**69 blocks without end
        HostTierSpec(1 << 70).geometry(geo)


def test_host_arena_run_needs_a_transfer_plan():
    from mambakv.core.errors import InvalidCopyPlanError
    from mambakv.device import HostArena
    from mambakv.device.decoupled import DecoupledLayout

    h = HostHarness()
    arena = HostArena(DecoupledLayout(h.coord.kv_cache_config, device="cpu"), h.coord.host.geometry)
    for bad in (None, [1, 2], ((), ())):
        with pytest.raises(InvalidCopyPlanError, match="TransferPlan"):
            arena.run(bad)  # type: ignore[arg-type]


def test_pinned_blocks_a_loss_cut_off_leave_the_tree_and_a_store_refills_it():
    # A's unit on the host: pages 0..2, the state at 2 (write-through). A load pins page 2 and the
    # state (as one whose GPU part holds pages 0..1 would); then the host loses page 0 (evict_blocks,
    # as a fallback pop would): its subtree goes, but the pinned page 2 and state stay cached, held.
    # Before the fix they stayed cached outside the tree: the next store of A's chain saw the state
    # "on the host", stored nothing, and the host kept no unit of A (the fuzzer also hit a KeyError
    # when such a page sat past the bisected host prefix, and a new node on an orphan state).
    h = HostHarness()
    c = h.coord
    h.run("A", A, 0.0)
    host = c.host
    probe = Request("q", A, max_tokens=1)
    probe.set_hash_block_size(4)
    keys = probe.block_hashes
    assert [u.index for u in host.units.live_units()] == [2]
    pages, slots = host.pin(keys, [2], 2)
    page0 = host.arena.pages.cached_block_hash_to_block[0][keys[0]]
    host.arena.pages.evict_blocks([page0.block_id])
    c.check_invariants()  # the pinned page and state left the tree and lost their hashes
    assert not host.units.num_pages and not host.host_state(keys[2]) and not host.host_page(keys[2])
    assert host.store_chain(keys, [2], now=1.0)  # A's chain is still on the GPU: stored again
    assert [u.index for u in host.units.live_units()] == [2]
    c.check_invariants()
    host.unpin([b for _, _, b in pages], [b for _, b in slots])
    c.check_invariants()
    assert host.pins == {} and host.host_state(keys[2])
