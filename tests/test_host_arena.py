"""Host arena (mambakv.device.host_arena): the host rows mirror the device rows byte for byte,
stores and loads move exactly a page's / a slot's bytes of every raw tensor, bad plans copy
nothing. Expectations are hand-sliced from the raw tensors, not computed by the arena."""

from __future__ import annotations

import pytest
import torch

from mambakv.core.arena import SuperblockGeometry
from mambakv.core.errors import InvalidCopyPlanError, InvalidSpecError
from mambakv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from mambakv.core.transfers import BlockKind, LoadPlan, Tier, Transfer, TransferPlan
from mambakv.device import HostArena
from mambakv.device.decoupled import DecoupledLayout
from mambakv.device.layout import HybridLayout

GPU, HOST, PAGE, STATE = Tier.GPU, Tier.HOST, BlockKind.PAGE, BlockKind.STATE

# Decoupled (as tests/test_decoupled_layout.py): 64 B pages per layer, 2 layers (128 B a page
# id), 176 B of states per layer (352 B a slot), k = 3, S = 192 B per layer.
ATTN = FullAttentionSpec(2, num_kv_heads=1, head_size=8, dtype="bfloat16")
MAMBA = MambaSpec(2, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), mode="align")
P, S, K, L = 64, 192, 3, 176
PB, SB = 2 * P, 2 * L  # page_bytes, state_bytes
# Unified (as tests/test_layout.py): rows of 256 B, 2 layers: a block id costs 512 B.
U_ATTN = FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="bfloat16")
U_MAMBA = MambaSpec(4, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), page_size_padded=256)
R, UB = 256, 512


def decoupled(num_superblocks: int = 6) -> DecoupledLayout:
    geo = SuperblockGeometry(num_superblocks, K, PB, SB)
    return DecoupledLayout(KVCacheConfig(geo.num_pages, [
        KVCacheGroupSpec(["a0", "a1"], ATTN),
        KVCacheGroupSpec(["m0", "m1"], MAMBA),
        KVCacheGroupSpec(["m2", "m3"], MAMBA),
    ], geo), "cpu")


def unified(num_blocks: int = 6) -> HybridLayout:
    return HybridLayout(KVCacheConfig(num_blocks, [
        KVCacheGroupSpec(["a0", "a1"], U_ATTN),
        KVCacheGroupSpec(["m0", "m1"], U_MAMBA),
    ]), "cpu")


def randomize(raw: tuple[torch.Tensor, ...], null_bytes: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for r in raw:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
        r.view(-1)[:null_bytes] = 0


def snap(raw: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [r.clone() for r in raw]


def page(raw: torch.Tensor, p: int) -> torch.Tensor:  # decoupled page p of one raw tensor
    return raw.view(-1)[p * P:(p + 1) * P]


def slot(raw: torch.Tensor, s: int) -> torch.Tensor:  # decoupled slot s's states of one raw tensor
    return raw.view(-1)[s * S:s * S + L]


def st(src: int, dst: int, kind: BlockKind = PAGE, nbytes: int | None = None) -> Transfer:
    return Transfer(GPU, src, HOST, dst, nbytes if nbytes is not None else (PB if kind is PAGE else SB), kind, 0)


def ld(src: int, dst: int, kind: BlockKind = PAGE, nbytes: int | None = None) -> Transfer:
    return Transfer(HOST, src, GPU, dst, nbytes if nbytes is not None else (PB if kind is PAGE else SB), kind, 1)


def assert_same(a: list[torch.Tensor] | tuple[torch.Tensor, ...], b: list[torch.Tensor] | tuple[torch.Tensor, ...]):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_shapes_and_queries():
    lay = decoupled()
    host = HostArena(lay, SuperblockGeometry(5, K, PB, SB), pin_memory=False)
    assert len(host.raw) == 2 and all(r.shape == (5, S) and r.dtype == torch.uint8 and r.device.type == "cpu"
                                      for r in host.raw)
    assert all(r.count_nonzero() == 0 for r in host.raw) and not host.pinned
    assert (host.num_pages, host.num_slots, host.total_bytes) == (15, 5, 5 * 3 * PB)
    assert host.total_bytes == host.geometry.total_bytes
    assert (host.page_bytes_per_layer, host.state_bytes_per_layer, host.row_bytes) == (P, L, S)
    assert host.rows(PAGE, 1).shape == (15, P) and host.rows(STATE, 0).shape == (5, L)
    assert host.byte_range(PAGE, 7) == (7 * P, P) and host.byte_range(STATE, 4) == (4 * S, L)
    with pytest.raises(InvalidSpecError):
        host.byte_range(PAGE, 15)
    with pytest.raises(InvalidSpecError):
        host.byte_range(STATE, 5)
    uh = HostArena(unified(), SuperblockGeometry(4, 1, UB, UB), pin_memory=False)
    assert all(r.shape == (4, R) for r in uh.raw) and uh.total_bytes == 4 * UB == uh.geometry.total_bytes
    assert (uh.num_pages, uh.num_slots) == (4, 4) and uh.byte_range(STATE, 3) == (3 * R, R)
    assert "decoupled" in repr(host) and "unified" in repr(uh)


def test_decoupled_store_then_load_elsewhere():
    # device: sb0 pages 0-2, sb1 pages 3-5, sb2 slot 2, sb3 slot 3, sb4 pages 12-14, sb5 slot 5
    lay = decoupled()
    randomize(lay.raw, P)
    host = HostArena(lay, SuperblockGeometry(5, K, PB, SB), pin_memory=False)
    dev0 = snap(lay.raw)
    pages = [(4, 7), (1, 3), (5, 8)]  # device page -> host page (host sb 2, 1, 2)
    slots = [(2, 4), (3, 3)]  # device slot -> host slot
    moved = host.run_stores([st(s, d) for s, d in pages] + [st(s, d, STATE) for s, d in slots])
    assert moved == 3 * PB + 2 * SB
    assert_same(lay.raw, dev0)  # stores read the device only
    want = [torch.zeros(5, S, dtype=torch.uint8) for _ in range(2)]
    for i in range(2):
        for s, d in pages:
            page(want[i], d).copy_(page(dev0[i], s))
        for s, d in slots:
            slot(want[i], d).copy_(slot(dev0[i], s))
    assert_same(host.raw, want)  # the slot's idle tail and every other host byte stay zero
    host.check_invariants()
    for r in lay.raw:  # zero the source rows
        for s, _ in pages:
            page(r, s).zero_()
        for s, _ in slots:
            slot(r, s).zero_()
    dev1, host1 = snap(lay.raw), snap(host.raw)
    back_pages = [(7, 13), (3, 12), (8, 14)]  # host page -> another device page
    back_slots = [(4, 5), (3, 2)]  # host slot -> another device slot
    host.run_loads([ld(s, d) for s, d in back_pages] + [ld(s, d, STATE) for s, d in back_slots])
    assert_same(host.raw, host1)  # loads read the host only
    for i in range(2):
        for s, d in back_pages:
            page(dev1[i], d).copy_(page(host1[i], s))
        for s, d in back_slots:
            slot(dev1[i], d).copy_(slot(host1[i], s))
    assert_same(lay.raw, dev1)
    for i in range(2):  # end to end: device page 4 is now at page 13, slot 2 at slot 5
        assert torch.equal(page(lay.raw[i], 13), page(dev0[i], 4))
        assert torch.equal(slot(lay.raw[i], 5), slot(dev0[i], 2))


def test_unified_store_then_load_elsewhere():
    lay = unified()
    randomize(lay.raw, R, seed=1)
    host = HostArena(lay, SuperblockGeometry(5, 1, UB, UB), pin_memory=False)
    dev0 = snap(lay.raw)
    stores = [(2, 3, PAGE), (4, 1, STATE), (5, 4, PAGE)]
    assert host.run_stores([Transfer(GPU, s, HOST, d, UB, k, 0) for s, d, k in stores]) == 3 * UB
    want = [torch.zeros(5, R, dtype=torch.uint8) for _ in range(2)]
    for i in range(2):
        for s, d, _ in stores:
            want[i][d] = dev0[i][s]
    assert_same(host.raw, want)
    for r in lay.raw:
        r[[2, 4, 5]] = 0
    dev1, host1 = snap(lay.raw), snap(host.raw)
    loads = [(3, 1, PAGE), (1, 3, STATE), (4, 2, PAGE)]
    host.run_loads([Transfer(HOST, s, GPU, d, UB, k, 0) for s, d, k in loads])
    assert_same(host.raw, host1)
    for i in range(2):
        for s, d, _ in loads:
            dev1[i][d] = host1[i][s]
    assert_same(lay.raw, dev1)
    assert torch.equal(lay.raw[1][1], dev0[1][2]) and torch.equal(lay.raw[0][3], dev0[0][4])
    host.check_invariants()


def test_run_plan_stores_before_loads():
    lay = decoupled()
    randomize(lay.raw, P, seed=2)
    host = HostArena(lay, SuperblockGeometry(5, K, PB, SB), pin_memory=False)
    dev0 = snap(lay.raw)
    # a load reads the host page and slot the same plan's stores write
    plan = TransferPlan(stores=(st(4, 7), st(2, 4, STATE)),
                        loads=(LoadPlan("r0", (ld(7, 13),), PB, 2), LoadPlan("r1", (ld(4, 5, STATE),), SB, 2)))
    assert host.run(plan) == 2 * PB + 2 * SB
    for i in range(2):
        assert torch.equal(page(lay.raw[i], 13), page(dev0[i], 4))
        assert torch.equal(slot(lay.raw[i], 5), slot(dev0[i], 2))
        assert torch.equal(page(host.raw[i], 7), page(dev0[i], 4))
    assert host.run(TransferPlan((), ())) == 0 and host.run_stores([]) == 0 and host.run_loads(()) == 0


def test_state_and_kv_views_round_trip():
    lay = decoupled()
    host = HostArena(lay, SuperblockGeometry(5, K, PB, SB), pin_memory=False)
    gen = torch.Generator().manual_seed(3)
    written = {}
    for name in ("m0", "m1"):  # group 1's layers (group 2's m2, m3 share raw tensors 0, 1: one owner per slot)
        states = lay.mamba_states(name)
        for j, v in enumerate(states):
            v[2] = torch.randn(v[2].shape, generator=gen).to(v.dtype)
            written[name, j] = v[2].clone()
    kv = lay.kv_cache("a1")
    kv[4] = torch.randn(kv[4].shape, generator=gen).to(kv.dtype)
    kv_written = kv[4].clone()
    host.run_stores([st(2, 1, STATE), st(4, 10)])
    host.run_loads([ld(1, 5, STATE), ld(10, 13)])
    for (name, j), want in written.items():
        assert torch.equal(lay.mamba_states(name)[j][5], want)
    assert torch.equal(lay.kv_cache("a1")[13], kv_written)
    lay.check_invariants()
    host.check_invariants()


BAD_STORES = {
    "wrong direction": [Transfer(HOST, 4, GPU, 7, PB, PAGE, 0)],
    "gpu to gpu": [Transfer(GPU, 4, GPU, 7, PB, PAGE, 0)],
    "device page out of range": [st(18, 7)],
    "device slot out of range": [st(6, 2, STATE)],
    "host page out of range": [st(4, 15)],
    "host slot out of range": [st(2, 5, STATE)],
    "null source page": [st(0, 7)],
    "null destination page": [st(4, 0)],
    "null destination slot": [st(2, 0, STATE)],
    "destination twice": [st(4, 7), st(5, 7)],
    "slot destination twice": [st(2, 3, STATE), st(3, 3, STATE)],
    "slot over a page destination": [st(4, 7), st(2, 2, STATE)],
    "page over a slot destination": [st(2, 2, STATE), st(4, 8)],
    "page with state bytes": [st(4, 7, PAGE, SB)],
    "state with page bytes": [st(2, 3, STATE, PB)],
    "unknown kind": [Transfer(GPU, 4, HOST, 7, PB, "bogus", 0)],  # type: ignore[arg-type]
    "float id": [Transfer(GPU, 4.0, HOST, 7, PB, PAGE, 0)],  # type: ignore[arg-type]
    "bool id": [Transfer(GPU, True, HOST, 7, PB, PAGE, 0)],
    "not a transfer": [(GPU, 4, HOST)],
}


@pytest.mark.parametrize("case", sorted(BAD_STORES))
def test_bad_store_copies_nothing(case):
    lay = decoupled()
    randomize(lay.raw, P, seed=4)
    host = HostArena(lay, SuperblockGeometry(5, K, PB, SB), pin_memory=False)
    host.run_stores([st(5, 10)])
    dev0, host0 = snap(lay.raw), snap(host.raw)
    with pytest.raises(InvalidCopyPlanError):
        host.run_stores([st(1, 3), st(3, 4, STATE)] + BAD_STORES[case])
    with pytest.raises(InvalidCopyPlanError):  # the same inside a plan: its loads do not run either
        host.run(TransferPlan((st(1, 3), *BAD_STORES[case]), (LoadPlan("r", (ld(10, 13),), PB, 2),)))
    assert_same(lay.raw, dev0)
    assert_same(host.raw, host0)


BAD_LOADS = {
    "wrong direction": [st(4, 7)],
    "host page out of range": [ld(15, 13)],
    "device page out of range": [ld(10, 18)],
    "device slot out of range": [ld(1, 6, STATE)],
    "null source": [ld(0, 13)],
    "null destination slot": [ld(1, 0, STATE)],
    "destination twice": [ld(10, 13), ld(11, 13)],
    "page with state bytes": [ld(10, 13, PAGE, SB)],
}


@pytest.mark.parametrize("case", sorted(BAD_LOADS))
def test_bad_load_copies_nothing(case):
    lay = decoupled()
    randomize(lay.raw, P, seed=5)
    host = HostArena(lay, SuperblockGeometry(5, K, PB, SB), pin_memory=False)
    host.run_stores([st(5, 10), st(4, 11), st(2, 1, STATE)])
    dev0, host0 = snap(lay.raw), snap(host.raw)
    with pytest.raises(InvalidCopyPlanError):
        host.run_loads([ld(11, 12), ld(1, 3, STATE)] + BAD_LOADS[case])
    with pytest.raises(InvalidCopyPlanError):  # a bad second load plan: the stores and first plan do not run
        host.run(TransferPlan((st(1, 3),), (LoadPlan("a", (ld(11, 12),), PB, 2),
                                             LoadPlan("b", tuple(BAD_LOADS[case]), PB, 2))))
    assert_same(lay.raw, dev0)
    assert_same(host.raw, host0)


@pytest.mark.parametrize("bad", [
    [Transfer(GPU, 6, HOST, 1, UB, PAGE, 0)],  # device block out of range
    [Transfer(GPU, 2, HOST, 5, UB, STATE, 0)],  # host block out of range
    [Transfer(GPU, 2, HOST, 3, UB, PAGE, 0), Transfer(GPU, 4, HOST, 3, UB, STATE, 0)],  # one block twice
    [Transfer(GPU, 2, HOST, 3, R, PAGE, 0)],  # one row's bytes, not the block's
    [Transfer(GPU, 2, HOST, 0, UB, STATE, 0)],  # the null block
])
def test_unified_bad_store_copies_nothing(bad):
    lay = unified()
    randomize(lay.raw, R, seed=6)
    host = HostArena(lay, SuperblockGeometry(5, 1, UB, UB), pin_memory=False)
    dev0, host0 = snap(lay.raw), snap(host.raw)
    with pytest.raises(InvalidCopyPlanError):
        host.run_stores([Transfer(GPU, 1, HOST, 1, UB, PAGE, 0), *bad])
    assert_same(lay.raw, dev0)
    assert_same(host.raw, host0)


@pytest.mark.parametrize("make", [
    lambda: HostArena(decoupled(), SuperblockGeometry(5, K + 1, PB, SB)),
    lambda: HostArena(decoupled(), SuperblockGeometry(5, K, PB * 2, SB)),
    lambda: HostArena(decoupled(), SuperblockGeometry(5, K, PB, SB - 2)),
    lambda: HostArena(decoupled(), (5, K, PB, SB)),
    lambda: HostArena(unified(), SuperblockGeometry(5, 2, UB, UB)),
    lambda: HostArena(unified(), SuperblockGeometry(5, 1, R, R)),
    lambda: HostArena(unified(), SuperblockGeometry(5, 1, UB, UB - 1)),
    lambda: HostArena(object(), SuperblockGeometry(5, 1, UB, UB)),
])
def test_geometry_must_match_the_layout(make):
    with pytest.raises(InvalidSpecError):
        make()


def test_pinning():
    lay = decoupled()
    auto = HostArena(lay, SuperblockGeometry(3, K, PB, SB))
    assert auto.pinned == torch.cuda.is_available()
    assert auto.raw[0].is_pinned() == auto.pinned
    if torch.cuda.is_available():
        assert HostArena(lay, SuperblockGeometry(3, K, PB, SB), pin_memory=True).raw[1].is_pinned()
    else:  # no silent fallback to pageable memory
        with pytest.raises(InvalidSpecError, match="pin_memory=True needs CUDA"):
            HostArena(lay, SuperblockGeometry(3, K, PB, SB), pin_memory=True)
    plain = HostArena(lay, SuperblockGeometry(3, K, PB, SB), pin_memory=False)
    assert not plain.pinned and not plain.raw[0].is_pinned()


def test_check_invariants_sees_a_written_null_block():
    host = HostArena(decoupled(), SuperblockGeometry(3, K, PB, SB), pin_memory=False)
    host.raw[1].view(-1)[P:] = 7  # live pages of superblock 0 may hold anything
    host.check_invariants()
    host.raw[1].view(-1)[P - 1] = 1
    with pytest.raises(AssertionError):
        host.check_invariants()
