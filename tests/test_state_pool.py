"""MambaStatePool: shapes, batched copies against a per-pair reference, validation, zeroing.

``MAMBAKV_TEST_DEVICE=cuda`` runs these tests on a GPU (``bench/device_check.py`` does); the
default is CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mambakv.core.errors import InvalidCopyPlanError, InvalidSpecError, MambaKVError
from mambakv.core.spec import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from mambakv.device import fused_copy
from mambakv.device.layout import HybridLayout
from mambakv.device.state_pool import CopyBackend, MambaStatePool, export_block_table, export_block_tables

DEVICE = torch.device(os.environ.get("MAMBAKV_TEST_DEVICE", "cpu"))

# A tiny GDN-like layer: conv (d_conv - 1 = 3, 8 channels) bf16 = 48 B, SSM (2, 4, 4) fp32 = 128 B.
SPEC = MambaSpec(16, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"))
RAW_PAGE = 3 * 8 * 2 + 2 * 4 * 4 * 4  # 176 B
# A bf16 conv of 3 x 3 = 9 elements (18 B) puts the fp32 SSM at byte 18, not a multiple of 4:
# the states cannot share one byte row, so the pool falls back to one tensor per state.
ODD_SPEC = MambaSpec(16, ((3, 3), (2, 5)), ("bfloat16", "float32"))


def filled_pool(spec: MambaSpec = SPEC, layers: int = 3, blocks: int = 10, *, seed: int = 0,
                device: torch.device | str = DEVICE, **kw) -> MambaStatePool:
    pool = MambaStatePool(spec, layers, blocks, device, **kw)
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        for i in range(pool.num_states):
            t = pool.state(layer, i)
            t[1:] = torch.randn(t[1:].shape, generator=g).to(t.dtype).to(t.device)
    pool.check_invariants()
    return pool


def snapshot(pool: MambaStatePool) -> list[torch.Tensor]:
    return [pool.state(layer, i).clone() for layer in range(pool.num_layers)
            for i in range(pool.num_states)]


def reference_copy(before: list[torch.Tensor], pairs) -> list[torch.Tensor]:
    """Sequential per-pair copies, one pair at a time (what a batched copy_ must equal)."""
    out = [t.clone() for t in before]
    for t in out:
        for src, dst in pairs:
            t[dst] = t[src]
    return out


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_shapes_dtypes_device_and_bytes():
    pool = MambaStatePool(SPEC, 3, 10, DEVICE)
    assert pool.conv_state(0).shape == (10, 3, 8) and pool.conv_state(0).dtype == torch.bfloat16
    assert pool.ssm_state(2).shape == (10, 2, 4, 4) and pool.ssm_state(2).dtype == torch.float32
    assert pool.state(1, 1) is pool.ssm_state(1)
    assert pool.device.type == DEVICE.type
    assert (pool.num_layers, pool.num_blocks, pool.num_states) == (3, 10, 2)
    assert pool.bytes_per_block == 3 * RAW_PAGE  # 528
    padded = MambaStatePool(MambaSpec(16, SPEC.shapes, SPEC.dtypes, page_size_padded=256), 3, 4)
    assert padded.bytes_per_block == 3 * 256
    pool.check_invariants()


def test_default_device():
    pool = MambaStatePool(SPEC, 1, 2)
    assert pool.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("spec", [SPEC, ODD_SPEC], ids=["raw-rows", "per-tensor"])
def test_copy_matches_per_pair_reference(spec):
    pool = filled_pool(spec)
    before = snapshot(pool)
    pairs = [(1, 4), (2, 5), (3, 9), (1, 6), (0, 7)]  # a fan-out from 1, and a copy of null 0
    pool.copy_(pairs)
    assert_same(snapshot(pool), reference_copy(before, pairs))
    # the copy really moved data: block 6 now equals block 1 in every tensor
    assert torch.equal(pool.ssm_state(2)[6], pool.ssm_state(2)[1])
    assert torch.count_nonzero(pool.conv_state(0)[7]) == 0
    pool.check_invariants()


def test_copy_over_given_views():
    base = filled_pool()
    views = [[base.state(layer, i)[:, ...] for i in range(2)] for layer in range(3)]
    pool = MambaStatePool(SPEC, 3, 10, views=views)
    assert pool.device.type == DEVICE.type and pool.ssm_state(0).data_ptr() == \
        base.ssm_state(0).data_ptr()
    before = snapshot(pool)
    pool.copy_([(2, 8), (5, 1)])
    assert_same(snapshot(pool), reference_copy(before, [(2, 8), (5, 1)]))


def test_empty_and_self_pairs_are_noops():
    pool = filled_pool()
    before = snapshot(pool)
    pool.copy_([])
    pool.copy_([(3, 3)])
    assert_same(snapshot(pool), before)


@pytest.mark.parametrize("pairs", [
    [(1, 0)],                 # the null block is never written
    [(1, 10)],                # out of range (10 blocks: ids 0..9)
    [(-1, 2)],
    [(1, 2), (3, 2)],         # a destination twice
    [(1, 2), (2, 3)],         # chain: 2 is read and written in one batched list
    [(2, 3), (1, 2)],         # same, other order
    [(1.0, 2)],               # not an int
    [(True, 2)],
    [(1, 2, 3)],              # not a pair
])
def test_invalid_pairs_raise_and_change_nothing(pairs):
    pool = filled_pool()
    before = snapshot(pool)
    with pytest.raises(InvalidCopyPlanError) as e:
        pool.copy_(pairs)
    assert isinstance(e.value, MambaKVError) and isinstance(e.value, ValueError)
    assert_same(snapshot(pool), before)
    pool.check_invariants()


def test_zero_rows():
    pool = filled_pool()
    before = snapshot(pool)
    pool.zero_([4, 2, 4])
    for t, old in zip(snapshot(pool), before):
        assert torch.count_nonzero(t[[2, 4]]) == 0
        keep = [b for b in range(10) if b not in (2, 4)]
        assert torch.equal(t[keep], old[keep])
    pool.zero_([])
    for bad in ([0], [10], [-3], [1.5]):
        with pytest.raises(InvalidCopyPlanError):
            pool.zero_(bad)
    pool.check_invariants()


def test_check_invariants_catches_written_null_row():
    pool = filled_pool()
    pool.ssm_state(1)[0, 0, 0, 0] = 1.0  # a kernel that ignored the -1 export
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_bad_construction():
    with pytest.raises(InvalidSpecError):
        MambaStatePool(SPEC, 0, 10)
    with pytest.raises(InvalidSpecError):
        MambaStatePool(SPEC, 1, 1)  # block 0 alone: nothing usable
    wrong = [[torch.zeros(10, 3, 8, dtype=torch.float32), torch.zeros(10, 2, 4, 4)]]
    with pytest.raises(InvalidSpecError):  # conv view in float32, spec says bfloat16
        MambaStatePool(SPEC, 1, 10, views=wrong)
    with pytest.raises(InvalidSpecError):  # 2 layers of views for num_layers = 1
        MambaStatePool(SPEC, 1, 10, views=wrong * 2)


@pytest.mark.parametrize("call", [
    lambda p: p.conv_state(3), lambda p: p.conv_state(5), lambda p: p.conv_state(-1),  # 3 layers: 0 .. 2
    lambda p: p.ssm_state(3), lambda p: p.layer_states(3), lambda p: p.layer_states(-4),
    lambda p: p.state(0, 2), lambda p: p.state(0, -1), lambda p: p.state(3, 0),  # 2 states: 0 .. 1
    lambda p: p.state(1.0, 0), lambda p: p.conv_state(True), lambda p: p.conv_state("0"),
])
def test_layer_or_state_index_out_of_range_raises(call):
    pool = MambaStatePool(SPEC, 3, 4, DEVICE)
    with pytest.raises(InvalidSpecError) as e:
        call(pool)
    assert isinstance(e.value, MambaKVError)  # was a bare IndexError
    # the last valid indices still work
    assert pool.conv_state(2).shape == (4, 3, 8) and pool.state(2, 1) is pool.ssm_state(2)
    assert len(pool.layer_states(2)) == 2


def test_export_block_table():
    assert export_block_table([0, 0, 7, 9]).tolist() == [-1, -1, 7, 9]
    assert export_block_table([]).dtype == torch.int32
    t = export_block_tables([[0, 3], [5], []])
    assert t.tolist() == [[-1, 3], [5, -1], [-1, -1]]
    assert export_block_tables([[1]], width=3).tolist() == [[1, -1, -1]]
    with pytest.raises(ValueError):
        export_block_tables([[1, 2]], width=1)
    assert filled_pool().block_table_tensor([[0, 2]]).tolist() == [[-1, 2]]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_valid_plans_match_reference(data):
    n = 12
    k = data.draw(st.integers(0, 5))
    dst = data.draw(st.lists(st.integers(1, n - 1), min_size=k, max_size=k, unique=True))
    # sources: any block that is not another pair's destination
    srcs = [b for b in range(n) if b not in dst]
    src = [data.draw(st.sampled_from(srcs)) for _ in dst]
    pairs = list(zip(src, dst))
    spec = data.draw(st.sampled_from([SPEC, ODD_SPEC]))
    pool = filled_pool(spec, layers=2, blocks=n, seed=data.draw(st.integers(0, 9)))
    before = snapshot(pool)
    pool.copy_(pairs)
    assert_same(snapshot(pool), reference_copy(before, pairs))
    pool.check_invariants()


def test_copy_backend_choice_without_triton(monkeypatch):
    assert MambaStatePool(SPEC, 1, 4, DEVICE).copy_backend is CopyBackend.TORCH  # the default
    cpu = MambaStatePool(SPEC, 1, 4, "cpu", copy_backend="auto")
    assert cpu.copy_backend is CopyBackend.TORCH  # auto: triton only on CUDA
    monkeypatch.setattr(fused_copy, "triton_available", lambda: False)
    for device in ("cpu", DEVICE):
        pool = MambaStatePool(SPEC, 1, 4, device, copy_backend=CopyBackend.AUTO)
        assert pool.copy_backend is CopyBackend.TORCH
        pool.copy_([(1, 2)])
        with pytest.raises(InvalidSpecError, match="mambakv\\[triton\\]"):
            MambaStatePool(SPEC, 1, 4, device, copy_backend="triton")
    for bad in ("cuda", "fused", None, 3):
        with pytest.raises(InvalidSpecError):
            MambaStatePool(SPEC, 1, 4, "cpu", copy_backend=bad)
    with pytest.raises(InvalidSpecError):
        HybridLayout(KVCacheConfig(4, [KVCacheGroupSpec(["m0"], SPEC)]), "cpu", copy_backend="fused")
    assert "copy_backend=torch" in repr(cpu)


def test_float8_states_zero_and_check():
    spec = MambaSpec(16, ((3, 3), (2, 5)), ("float8_e4m3fn", "float8_e5m2"))
    pool = MambaStatePool(spec, 2, 5, DEVICE)
    for layer in range(2):
        for t in pool.layer_states(layer):
            t.view(torch.uint8)[1:] = 0x11
    pool.copy_([(1, 3)])
    pool.zero_([2])
    assert pool.conv_state(1)[2].view(torch.uint8).count_nonzero() == 0
    assert pool.ssm_state(1)[3].view(torch.uint8).eq(0x11).all()
    pool.check_invariants()
    pool.conv_state(0)[0].view(torch.uint8)[0, 0] = 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


BACKENDS = ["torch", "auto"] + (["triton"] if fused_copy.triton_available() else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_copy_matches_cpu(backend):
    cpu = filled_pool(device="cpu")
    gpu = MambaStatePool(SPEC, 3, 10, "cuda", copy_backend=backend)
    assert gpu.copy_backend is (CopyBackend.TORCH if backend == "torch" else CopyBackend.TRITON)
    for layer in range(3):
        for i in range(2):
            gpu.state(layer, i).copy_(cpu.state(layer, i))
    pairs = [(1, 4), (2, 5), (1, 6)]
    cpu.copy_(pairs)
    gpu.copy_(pairs)
    gpu.zero_([9])
    cpu.zero_([9])
    for layer in range(3):
        for i in range(2):
            assert torch.equal(gpu.state(layer, i).cpu(), cpu.state(layer, i))
    gpu.check_invariants()
    with pytest.raises(InvalidCopyPlanError):
        gpu.copy_([(1, 0)])
