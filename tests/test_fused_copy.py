"""Fused Triton state copy: byte for byte against the torch path.

On CPU (CI) the kernel runs under Triton's interpreter: ``TRITON_INTERPRET=1`` is set below,
before triton is first imported.  It changes nothing for the rest of the run: no other test uses
triton, and :mod:`mambakv.device.fused_copy` picks the interpreter by tensor device (CPU) and the
compiled kernel for CUDA tensors whatever the variable says.  ``MAMBAKV_TEST_DEVICE=cuda`` runs
the same tests on a GPU with the compiled kernel (``bench/device_check.py`` does).

Shapes are small: the interpreter costs about 0.7 ms per program (one program = one tile of one
row of one layer), so a thousand pairs of one layer take about a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = os.environ.get("MAMBAKV_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mambakv.core.errors import InvalidCopyPlanError, InvalidSpecError  # noqa: E402
from mambakv.core.spec import (  # noqa: E402
    DTYPE_SIZES,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from mambakv.device.fused_copy import FusedRowCopy  # noqa: E402
from mambakv.device.layout import HybridLayout  # noqa: E402
from mambakv.device.state_pool import CopyBackend, MambaStatePool  # noqa: E402

SPEC = MambaSpec(16, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"))  # 48 + 128 = 176 B per layer
ODD_SPEC = MambaSpec(16, ((3, 3), (2, 5)), ("bfloat16", "float32"))  # fp32 at byte 18: per tensor
QWEN3_NEXT_LAYER = MambaSpec(544, ((3, 8192), (32, 128, 128)), ("bfloat16", "bfloat16"))  # DESIGN 7


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 ``[rows, bytes]`` (a view: rows of the pools here are dense)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def fill_random(pool: MambaStatePool, seed: int) -> None:
    """Random bytes in rows 1.. of every state (NaN patterns included), row 0 stays zero."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        for t in pool.layer_states(layer):
            b = as_bytes(t)
            b[1:] = torch.randint(0, 256, b[1:].shape, generator=g, dtype=torch.uint8).to(b.device)


def pool_pair(spec: MambaSpec, layers: int, blocks: int, seed: int = 0
              ) -> tuple[MambaStatePool, MambaStatePool]:
    """The same random states in a torch pool and a triton pool."""
    ref = MambaStatePool(spec, layers, blocks, DEVICE, copy_backend="torch")
    fused = MambaStatePool(spec, layers, blocks, DEVICE, copy_backend="triton")
    fill_random(ref, seed)
    fill_random(fused, seed)
    assert ref.copy_backend is CopyBackend.TORCH and fused.copy_backend is CopyBackend.TRITON
    return ref, fused


def state_bytes(pool: MambaStatePool) -> list[torch.Tensor]:
    return [as_bytes(t).cpu().clone() for layer in range(pool.num_layers)
            for t in pool.layer_states(layer)]


def assert_same_bytes(a: MambaStatePool, b: MambaStatePool) -> None:
    for x, y in zip(state_bytes(a), state_bytes(b), strict=True):
        assert torch.equal(x, y)


def run_both(ref: MambaStatePool, fused: MambaStatePool, pairs: list[tuple[int, int]],
             zero: list[int] = ()) -> None:
    before = state_bytes(ref)
    for pool in (ref, fused):
        pool.copy_(pairs)
        pool.zero_(list(zero))
    assert_same_bytes(ref, fused)
    if any(s != d for s, d in pairs):  # the copy really moved something
        assert any(not torch.equal(x, y) for x, y in zip(before, state_bytes(fused)))
    fused.check_invariants()


PAIRS = [(1, 4), (2, 5), (3, 9), (1, 6), (0, 7), (8, 8)]  # fan-out, null source, self pair


# ----------------------------------------------------------------- dtypes and row sizes
@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_spec_dtype(dtype):
    # conv (3, 5) and SSM (2, 3) of the dtype: odd element counts, 15 x size B rows
    spec = MambaSpec(16, ((3, 5), (2, 3)), (dtype, dtype))
    ref, fused = pool_pair(spec, 2, 10, seed=DTYPE_SIZES[dtype])
    run_both(ref, fused, PAIRS, zero=[2, 3, 2])


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_dtype_beside_a_bf16_conv(dtype):
    # bf16 conv of 3 x 7 (42 B) then the dtype's SSM: misaligned for 4/8-byte dtypes (per tensor)
    spec = MambaSpec(16, ((3, 7), (3, 3)), ("bfloat16", dtype))
    ref, fused = pool_pair(spec, 3, 8, seed=1)
    run_both(ref, fused, [(1, 2), (3, 4), (5, 7)], zero=[6])


@pytest.mark.parametrize("spec", [SPEC, ODD_SPEC], ids=["raw-rows", "per-tensor"])
def test_matches_torch_path(spec):
    ref, fused = pool_pair(spec, 3, 10)
    run_both(ref, fused, PAIRS, zero=[9])


@pytest.mark.parametrize("row_bytes", [1, 3, 7, 16, 17, 33, 100, 250])
@pytest.mark.parametrize("tile_bytes", [16, 64, 16384])
def test_odd_row_sizes_and_partial_tiles(row_bytes, tile_bytes):
    g = torch.Generator().manual_seed(row_bytes)
    a = torch.randint(0, 256, (9, row_bytes), generator=g, dtype=torch.uint8).to(DEVICE)
    b = torch.randint(0, 256, (9, 2 * row_bytes + 5), generator=g, dtype=torch.uint8).to(DEVICE)
    tensors = [a, b[:, 3 : 3 + row_bytes], b[:, 3 + row_bytes : 3 + 2 * row_bytes]]
    expect = [t.clone() for t in tensors]
    head, tail = b[:, :3].clone(), b[:, 3 + 2 * row_bytes :].clone()  # bytes of no tensor
    copier = FusedRowCopy(tensors, tile_bytes=tile_bytes)
    src, dst = [1, 2, 2], [5, 6, 8]
    copier.copy_rows(src, dst)
    for t, e in zip(tensors, expect):
        e[dst] = e[src]
        assert torch.equal(t, e)
    copier.zero_rows([3, 8])
    for t, e in zip(tensors, expect):
        e[[3, 8]] = 0
        assert torch.equal(t, e)
    assert torch.equal(b[:, :3], head) and torch.equal(b[:, 3 + 2 * row_bytes :], tail)


def test_rows_of_several_tiles():
    spec = MambaSpec(16, ((3, 1000), (5, 203)), ("bfloat16", "float32"))  # 6000 + 4060 B
    ref = MambaStatePool(spec, 2, 6, DEVICE)
    fused = MambaStatePool(spec, 2, 6, DEVICE, copy_backend="triton", fused_tile_bytes=1024)  # 10 tiles per row
    fill_random(ref, 3)
    fill_random(fused, 3)
    run_both(ref, fused, [(1, 3), (2, 4)], zero=[5])


def test_element_width_follows_alignment():
    pool = MambaStatePool(SPEC, 2, 4, DEVICE, copy_backend="triton")
    assert (pool.fused_copy.elem_size, pool.fused_copy.vec) == (8, 2)  # 176 B rows, 16-byte aligned
    odd = MambaStatePool(ODD_SPEC, 2, 4, DEVICE, copy_backend="triton")
    assert odd.fused_copy.elem_size == 2 and odd.fused_copy.num_entries == 4  # one entry per state
    assert FusedRowCopy([torch.zeros(4, 7, dtype=torch.uint8, device=DEVICE)]).elem_size == 1


# ----------------------------------------------------------------- numbers of pairs
def test_one_pair():
    ref, fused = pool_pair(SPEC, 4, 3)
    run_both(ref, fused, [(1, 2)])
    run_both(ref, fused, [], zero=[1])


def test_thousands_of_pairs():
    n = 1500
    spec = MambaSpec(16, ((1, 4), (1, 2)), ("bfloat16", "float32"))  # 16 B per layer
    ref, fused = pool_pair(spec, 1, 2 * n + 1, seed=5)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    pairs = [(1 + k, 1 + n + perm[k]) for k in range(n)]  # every destination once, shuffled
    run_both(ref, fused, pairs, zero=list(range(1, 2 * n + 1, 7)))


def test_plans_beyond_one_grid_launch_in_chunks():
    ref = MambaStatePool(SPEC, 2, 20, DEVICE, copy_backend="torch")
    fused = MambaStatePool(SPEC, 2, 20, DEVICE, copy_backend="triton", fused_tile_bytes=128)  # 176 B rows: 2 tiles
    fused.fused_copy.max_grid_x = 6  # 2 tiles per row: 3 pairs per launch
    fill_random(ref, 4)
    fill_random(fused, 4)
    run_both(ref, fused, [(k, 10 + k) for k in range(1, 9)], zero=[19, 18, 17, 16])


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_valid_plans(data):
    n = 12
    k = data.draw(st.integers(0, 6))
    dst = data.draw(st.lists(st.integers(1, n - 1), min_size=k, max_size=k, unique=True))
    srcs = [b for b in range(n) if b not in dst]
    pairs = [(data.draw(st.sampled_from(srcs)), d) for d in dst]
    zero = data.draw(st.lists(st.integers(1, n - 1), max_size=4))
    spec = data.draw(st.sampled_from([SPEC, ODD_SPEC]))
    ref, fused = pool_pair(spec, 2, n, seed=data.draw(st.integers(0, 9)))
    run_both(ref, fused, pairs, zero=zero)


# ----------------------------------------------------------------- plan rules
@pytest.mark.parametrize("pairs", [
    [(1, 0)], [(1, 10)], [(-1, 2)], [(1, 2), (3, 2)], [(1, 2), (2, 3)], [(2, 3), (1, 2)],
    [(1.0, 2)], [(True, 2)], [(1, 2, 3)],
])
def test_invalid_plans_raise_before_writing(pairs):
    _, fused = pool_pair(SPEC, 2, 10)
    before = state_bytes(fused)
    with pytest.raises(InvalidCopyPlanError):
        fused.copy_(pairs)
    for bad in ([0], [10], [-1], [2.0]):
        with pytest.raises(InvalidCopyPlanError):
            fused.zero_(bad)
    for x, y in zip(before, state_bytes(fused)):
        assert torch.equal(x, y)


# ----------------------------------------------------------------- hybrid layout
ATTN = FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="bfloat16")  # 256 B pages
MAMBA = MambaSpec(4, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), page_size_padded=256)


def hybrid(backend: str) -> HybridLayout:
    cfg = KVCacheConfig(12, [KVCacheGroupSpec(["a0", "a1"], ATTN),
                             KVCacheGroupSpec(["m0", "m1"], MAMBA),
                             KVCacheGroupSpec(["m2"], MAMBA)])  # one layer: raw[0] only
    lay = HybridLayout(cfg, DEVICE, copy_backend=backend)
    g = torch.Generator().manual_seed(7)
    for r in lay.raw:  # every byte of rows 1.. non-trivial: attention, states and padding
        r[1:] = torch.randint(0, 256, r[1:].shape, generator=g, dtype=torch.uint8).to(r.device)
    return lay


@pytest.mark.parametrize("group", [1, 2])
def test_hybrid_copy_touches_only_its_rows(group):
    ref, fused = hybrid("torch"), hybrid("triton")
    assert fused.state_pool(group).copy_backend is CopyBackend.TRITON
    before = [r.cpu().clone() for r in fused.raw]
    pairs, zero = [(2, 4), (3, 5), (2, 9)], [7]  # blocks 1, 6, 8, 10, 11: other groups' rows
    for lay in (ref, fused):
        lay.state_pool(group).copy_(pairs)
        lay.state_pool(group).zero_(zero)
    layers = len(fused.config.kv_cache_groups[group].layer_names)
    for i, (r, rr, old) in enumerate(zip(fused.raw, ref.raw, before)):
        r = r.cpu()
        assert torch.equal(r, rr.cpu())
        expect = old.clone()
        if i < layers:
            expect[[4, 5, 9], :176] = old[[2, 3, 2], :176]  # states only; padding 176.. kept
            expect[7, :176] = 0
        assert torch.equal(r, expect), f"raw[{i}]"


# ----------------------------------------------------------------- construction
def test_non_dense_views_are_refused_by_triton_and_kept_on_torch_by_auto():
    base = torch.zeros(6, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    ssm = torch.zeros(6, 2, 4, 4, device=DEVICE)
    views = [[base[:, :, ::2], ssm]]  # conv rows strided: not one byte run
    with pytest.raises(InvalidSpecError):
        MambaStatePool(SPEC, 1, 6, views=views, copy_backend="triton")
    assert MambaStatePool(SPEC, 1, 6, views=views, copy_backend="auto").copy_backend is CopyBackend.TORCH
    dense = MambaStatePool(SPEC, 1, 6, views=[[base[:, :, :8].contiguous(), ssm]],
                           copy_backend="triton")
    assert dense.fused_copy.num_entries == 2


def test_copier_refuses_bad_tensors():
    with pytest.raises(InvalidSpecError):
        FusedRowCopy([])
    with pytest.raises(InvalidSpecError):
        FusedRowCopy([torch.zeros(4, 8, device=DEVICE), torch.zeros(5, 8, device=DEVICE)])
    with pytest.raises(InvalidSpecError):
        FusedRowCopy([torch.zeros(4, 8, device=DEVICE)], tile_bytes=100)
    with pytest.raises(InvalidSpecError):  # overlapping rows
        FusedRowCopy([torch.zeros(64, dtype=torch.uint8, device=DEVICE).as_strided((4, 8), (4, 1))])


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU: the interpreter without TRITON_INTERPRET")
def test_interpreter_runs_without_the_environment_variable():
    code = textwrap.dedent("""
        import os, torch
        assert "TRITON_INTERPRET" not in os.environ
        from mambakv.device.fused_copy import FusedRowCopy
        t = torch.arange(40, dtype=torch.int64).view(5, 8)
        FusedRowCopy([t]).copy_rows([1], [3])
        FusedRowCopy([t]).zero_rows([4])
        assert t[3].tolist() == list(range(8, 16)) and t[4].count_nonzero() == 0
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


class _SimulatedGpu:
    """A stand-in for Triton's CUDA driver: device 0, stream 0, an sm_90 (H100 / H200) target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> object:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("spec, accesses, warps", [
    (QWEN3_NEXT_LAYER, {"ld.global.v2.b64", "st.global.v2.b64"}, 4),  # 1,097,728 B rows
    (SPEC, {"ld.global.v2.b64", "st.global.v2.b64"}, 1),    # 176 B rows, 16-byte aligned
    (ODD_SPEC, {"ld.global.b16", "st.global.b16"}, 1),      # 18 B / 40 B rows: 2-byte elements
], ids=["qwen3-next", "aligned", "unaligned"])
def test_kernel_compiles_for_the_gpu(spec, accesses, warps):
    """No GPU needed: the launches ``FusedRowCopy`` makes (its own arguments, constexprs and
    options) are compiled, not run, for sm_90 through Triton's JIT, with a simulated driver.
    Aligned rows get 16-byte loads and stores; unaligned rows no vector access at all.  This
    catches what the interpreter lets pass (it is more lenient than the compiler)."""
    import re

    try:
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        from mambakv.device._fused_copy_kernel import copy_rows
        saved = driver._active
    except (ImportError, AttributeError):  # pragma: no cover - depends on the triton version
        pytest.skip("this triton has no driver hook to compile without a GPU")
    kernel = JITFunction(copy_rows, do_not_specialize=["dst_offset", "num_tiles"])  # own cache
    compiled = []

    class CompileOnly:
        def __getitem__(self, grid: tuple[int, ...]):
            return lambda *args, **kw: compiled.append(kernel.warmup(*args, grid=grid, **kw))

    pool = MambaStatePool(spec, 2, 6, "cpu", copy_backend="triton")
    pool.fused_copy.kernel = CompileOnly()
    driver.set_active(_SimulatedGpu())
    try:
        pool.copy_([(1, 2), (3, 4)])
        pool.zero_([5])
    finally:
        driver._active = saved
    assert len(compiled) == 2
    for k in compiled:
        ops = set(re.findall(r"(?:ld|st)\.global[.\w]*", k.asm["ptx"])) - {"ld.global.b64"}
        assert ops <= accesses and "st" in "".join(ops), ops  # (the b64 loads are the table's)
        assert k.metadata.num_warps == pool.fused_copy.num_warps == warps  # short rows: fewer
