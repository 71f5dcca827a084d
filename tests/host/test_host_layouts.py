"""The host tier over the unified layout, the refused configs, and an end-to-end byte check
through a real DecoupledLayout and HostArena (CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from mambakv import FullAttentionSpec, KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, MambaSpec, Request
from mambakv.core.arena import SuperblockGeometry
from mambakv.core.errors import InvalidSpecError
from mambakv.core.host_tier import HostTierSpec
from mambakv.core.spec import SlidingWindowSpec
from mambakv.core.transfers import BlockKind, TransferPlan
from mambakv.device import HostArena
from mambakv.device.decoupled import DecoupledLayout
from mambakv.device.layout import HybridLayout
from tests.eviction.test_units import config
from tests.host.harness import B2, HostHarness

PAGE, STATE = BlockKind.PAGE, BlockKind.STATE

# Unified (as tests/test_host_arena.py, one layer a group): an attention page is 4 tokens x 2 KV
# heads x 8 x (K, V) x 2 B = 256 B, the Mamba state padded to 256 B: one block id = 256 B.
U_ATTN = FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="bfloat16")
U_MAMBA = MambaSpec(4, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), page_size_padded=256, mode="align")
UB = 256


def unified_config(num_blocks: int = 16, mamba: MambaSpec = U_MAMBA) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["a0"], U_ATTN), KVCacheGroupSpec(["m0"], mamba)])


def run(coord: KVCacheCoordinator, rid: str, toks: list[int], now: float, request: Request | None = None) -> int:
    """Prefill `toks` and free (tests/host/harness.py), ``check_invariants()`` after every call."""
    return HostHarness.over(coord).run(rid, toks, now, request=request)


def test_unified_layout_bytes_per_block_is_256():
    assert HybridLayout(unified_config(), "cpu").bytes_per_block == UB


def test_unified_host_hit():
    # 16 blocks (15 usable), host of 8 blocks of 256 B (k = 1: a block is a page or a slot)
    coord = KVCacheCoordinator(unified_config(16), max_model_len=256, host_tier=HostTierSpec(8 * UB, block_bytes=UB))
    g = coord.host.geometry
    assert (g.num_superblocks, g.pages_per_superblock, g.page_bytes, g.state_bytes) == (8, 1, UB, UB)
    a = list(range(1, 14))  # 13 tokens: pages 0..2, a checkpoint at page 2 (12 tokens)
    assert run(coord, "a", a, 0.0) == 0
    plan = coord.take_transfer_plan()
    # write-through: 3 pages + the state at page 2, 256 B each
    assert sorted((t.kind.value, t.num_bytes) for t in plan.stores) == [("page", UB)] * 3 + [("state", UB)]
    assert plan.bytes_d2h == 4 * UB
    # the stores held their 4 GPU sources since a's free (15 - 4 = 11 free) until they ran
    assert coord.block_pool.get_num_free_blocks() == 11
    coord.transfers_done(plan.fence)
    coord.check_invariants()
    assert coord.block_pool.get_num_free_blocks() == 15
    # drop a's blocks from the GPU (every cached block id: the null block 0 excluded)
    coord.block_pool.evict_blocks(list(range(1, 16)))
    coord.check_invariants()
    nxt = a + [7, 7, 7]  # 16 tokens: cap (16 - 1) // 4 = 3 pages
    assert coord.get_computed_blocks(Request("probe", nxt))[1] == 0
    req = Request("a2", nxt, max_tokens=1)
    hit = coord.get_computed_blocks_tiered(req, now=1.0)
    coord.check_invariants()
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (0, 12)
    assert [(t.kind, t.num_bytes) for t in hit.load.transfers] == [(PAGE, UB)] * 3 + [(STATE, UB)]
    assert hit.load.num_bytes == 4 * UB and coord.load_pending("a2")
    coord.complete_load("a2")
    coord.check_invariants()
    assert run(coord, "a2", nxt, 2.0, request=req) == 12
    assert coord.prefix_cache_stats.host_hits == 12
    # a2 (16 tokens, prefilled whole) leaves a checkpoint at page 3 (16 tokens); the host has
    # pages 0..2 only, so its free stores page 3 and that state: 2 blocks held by the next plan
    # until it lands (15 - 2 = 13 free), then all 15
    assert coord.block_pool.get_num_free_blocks() == 13
    plan = HostHarness.over(coord).drain()
    assert sorted((t.kind.value, t.num_bytes) for t in plan.stores) == [("page", UB), ("state", UB)]
    assert coord.block_pool.get_num_free_blocks() == 15


def test_unified_write_evict_is_refused():
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(unified_config(), max_model_len=256,
                           host_tier=HostTierSpec(8 * UB, write="evict", block_bytes=UB))


def test_unified_without_block_bytes_is_refused():
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(unified_config(), max_model_len=256, host_tier=HostTierSpec(8 * UB))


def test_sliding_window_group_is_refused():
    swa = SlidingWindowSpec(4, 2, 8, "bfloat16", sliding_window=8)
    cfg = KVCacheConfig(16, [KVCacheGroupSpec(["a0"], U_ATTN), KVCacheGroupSpec(["s0"], swa),
                             KVCacheGroupSpec(["m0"], U_MAMBA)])
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(cfg, max_model_len=256, host_tier=HostTierSpec(8 * UB, block_bytes=UB))


def test_not_a_spec_and_no_caching_are_refused():
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(unified_config(), max_model_len=256, host_tier=8 * UB)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(unified_config(), max_model_len=256, enable_caching=False,
                           host_tier=HostTierSpec(8 * UB, block_bytes=UB))


# ---------------------------------------------------------------------------- bytes end to end
def page_bytes(lay: DecoupledLayout, p: int) -> list[torch.Tensor]:
    P = lay.page_bytes_per_layer
    return [r.view(-1)[p * P:(p + 1) * P] for r in lay.raw]


def state_bytes(lay: DecoupledLayout, s: int) -> list[torch.Tensor]:
    S, L = lay.superblock_bytes_per_layer, lay.geometry.state_bytes // lay.group_size
    return [r.view(-1)[s * S:s * S + L] for r in lay.raw]


@pytest.mark.parametrize("write", ["through", "evict"])
def test_bytes_survive_store_evict_load(write):
    # the harness geometry on a real CPU layout: one raw tensor [12, 256] (a page: 128 B, a slot:
    # the first 176 B of its superblock row); the host arena mirrors it with 20 rows
    h = HostHarness(write=write)
    c = h.coord
    lay = DecoupledLayout(config(12), "cpu")
    assert (lay.group_size, lay.page_bytes_per_layer, lay.superblock_bytes_per_layer) == (1, 128, 256)
    host = HostArena(lay, c.host.geometry, pin_memory=False)
    gen = torch.Generator().manual_seed(7)
    for r in lay.raw:  # distinct random bytes everywhere (the null page / slot rows too: never copied)
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
    # A then B (through: each store plan right after its free, as an engine would at the next step)
    stored: list = []
    originals: dict[tuple[BlockKind, int], list[torch.Tensor]] = {}

    def drain_stores() -> None:
        plan = c.take_transfer_plan()
        assert plan.loads == ()
        for t in plan.stores:  # the GPU bytes each store reads, as they are when it runs
            src = page_bytes(lay, t.src_block) if t.kind is PAGE else state_bytes(lay, t.src_block)
            originals[(t.kind, t.dst_block)] = [x.clone() for x in src]
        assert host.run(plan) == plan.bytes_d2h
        c.transfers_done(plan.fence)  # the copies ran: their GPU sources may be reused now
        c.check_invariants()
        stored.extend(plan.stores)

    h.run("A", h_A := list(range(1, 14)), 0.0)
    drain_stores()
    h.run("B", h_A + list(range(50, 60)), 10.0)
    drain_stores()
    for rid, toks, now in (("C", list(range(100, 113)), 20.0), ("D", list(range(200, 213)), 30.0)):
        h.run(rid, toks, now)
        drain_stores()
    h.run("E", list(range(300, 313)), 40.0)  # the GPU evicts B's unit (write 'evict': stores it now)
    drain_stores()
    assert c.units.stats.evictions == 1
    # B's unit left the GPU: zero every GPU page and slot row the stores read from (the evicted
    # blocks among them; E's forward would have overwritten them anyway)
    for t in stored:
        for x in (page_bytes(lay, t.src_block) if t.kind is PAGE else state_bytes(lay, t.src_block)):
            x.zero_()
    req = Request("B2", B2, max_tokens=1)
    hit = c.get_computed_blocks_tiered(req, now=50.0)
    c.check_invariants()
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (12, 8)
    plan = c.take_transfer_plan()
    assert plan.loads == (hit.load,)
    assert host.run(TransferPlan((), plan.loads)) == 2 * 128 + 176
    c.complete_load("B2")
    c.transfers_done(plan.fence)
    c.check_invariants()
    # every loaded block holds, byte for byte, what its host source was stored from
    for t in hit.load.transfers:
        got = page_bytes(lay, t.dst_block) if t.kind is PAGE else state_bytes(lay, t.dst_block)
        want = originals[(t.kind, t.src_block)]
        assert all(torch.equal(x, y) for x, y in zip(got, want)), f"{t.kind.value} {t.dst_block} differs"
        assert all(x.count_nonzero() > 0 for x in got)  # not the zeroed rows
    host.check_invariants()
    c.free("B2", now=51.0)
    c.check_invariants()
    # through: B2's free stores its checkpoint at page 5 (24 tokens) with page 5, held until
    # that plan ran; evict: nothing (an empty plan)
    drain_stores()
    h.nothing_held()


def test_host_arena_geometry_matches_the_tier():
    h = HostHarness(host_superblocks=20)
    g = h.coord.host.geometry
    assert g == SuperblockGeometry(20, 2, 128, 176)
