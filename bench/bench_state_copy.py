"""Batched Mamba state copy: bandwidth per copy path, as a fraction of a plain contiguous copy.

Two states, ``n`` (src, dst) pairs in one ``MambaStatePool.copy_`` (blocks 1..n -> n+1..2n):

* ``qwen3-next``: Qwen3-Next-80B-A3B, 36 GDN layers x 1,097,728 B (bf16 conv (3, 8192) + bf16
  SSM (32, 128, 128), DESIGN.md 7): 37.7 MiB per state; 256 pairs = 9.4 GiB.
* ``small``: 24 layers x 4,864 B (bf16 conv (3, 128) + fp32 SSM (4, 16, 16)): 114 KiB per state;
  here the per-call host work (plan checks, index upload, launches) weighs as much as the bytes.

Paths: ``torch`` (two-pass: per layer ``index_select`` into scratch + ``index_copy_``; every byte
read and written twice) and ``fused`` (one Triton launch, every byte read and written once; CUDA
only here: on CPU Triton runs only under its interpreter, which is for correctness tests).  Both
pools are :meth:`MambaStatePool.from_raw` over the same raw tensors, so they copy the same bytes.

Figures per row: ``GB/s`` = state bytes copied / seconds of one ``copy_`` call (host checks and
launches included; a synchronise after each call on CUDA); ``frac`` = seconds of one contiguous
``dst.copy_(src)`` of the same number of bytes on the same device / seconds of the call;
``frac_il`` = the same ratio, median over rounds that time both back to back (the figure to trust
on a shared, loaded machine).  Target (issue 20): fused ``frac`` >= 0.80 for qwen3-next with 256
pairs on a GPU; the CPU torch path is bounded by 0.5 (two passes).

Run:  ``python bench/bench_state_copy.py`` (the table), or ``python -m pytest
bench/bench_state_copy.py --benchmark-only``.  Environment: ``MAMBAKV_BENCH_STATES`` (pairs;
default 256 on CUDA, 64 on CPU), ``MAMBAKV_BENCH_DEVICE`` (default CUDA if present),
``MAMBAKV_BENCH_THREADS`` (CPU intra-op threads; 1 gives the stable CPU figure).  Memory for
``n`` qwen3-next pairs: (2n + 1) x 37.7 MiB of pool + 2 x n x 37.7 MiB of baseline buffers
(n = 64: 10 GB; n = 256: 40 GB).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mambakv.core.spec import MambaSpec
from mambakv.device import fused_copy
from mambakv.device.state_pool import MambaStatePool
from mambakv.models import load_model

DEVICE = torch.device(os.environ.get("MAMBAKV_BENCH_DEVICE")
                      or ("cuda" if torch.cuda.is_available() else "cpu"))
NUM_STATES = int(os.environ.get("MAMBAKV_BENCH_STATES") or (256 if DEVICE.type == "cuda" else 64))

if os.environ.get("MAMBAKV_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["MAMBAKV_BENCH_THREADS"]))


def _sync(device: torch.device = DEVICE) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_spec(name: str) -> tuple[MambaSpec, int]:
    """``(spec of one layer, layers)`` of the state ``name`` (``qwen3-next`` or ``small``)."""
    if name == "qwen3-next":
        model = load_model("qwen3-next-80b-a3b")
        return MambaSpec(544, model.state_shapes(), model.state_dtypes()), len(model.mamba_layers)
    if name == "small":
        return MambaSpec(16, ((3, 128), (4, 16, 16)), ("bfloat16", "float32")), 24
    raise ValueError(f"unknown state {name!r}")


def fused_supported(device: torch.device = DEVICE) -> bool:
    """Whether the fused path is measured here: triton installed and a CUDA device."""
    return device.type == "cuda" and fused_copy.triton_available()


@dataclass
class Case:
    """Raw per-layer rows of ``2n + 1`` blocks and one pool per path over them."""

    name: str
    raw: list[torch.Tensor]
    pools: dict[str, MambaStatePool]
    pairs: list[tuple[int, int]]
    nbytes: int  # state bytes one copy_ moves (each read once and written once)


def make_case(name: str, n: int = NUM_STATES, device: torch.device = DEVICE, *,
              fused: bool | None = None) -> Case:
    """Blocks 1..n hold non-zero states (sources), n+1..2n are the destinations.  ``fused``:
    build the fused pool too (default: :func:`fused_supported`; True on CPU = interpreter)."""
    spec, layers = state_spec(name)
    raw = [torch.zeros(2 * n + 1, spec.page_size_bytes, dtype=torch.uint8, device=device)
           for _ in range(layers)]
    for r in raw:  # non-zero data, so nothing is trivially skipped
        r[1 : n + 1].fill_(0x3F)
    pools = {"torch": MambaStatePool.from_raw(spec, raw, copy_backend="torch")}
    if fused_supported(device) if fused is None else fused:
        pools["fused"] = MambaStatePool.from_raw(spec, raw, copy_backend="triton")
    pairs = [(1 + k, 1 + n + k) for k in range(n)]
    return Case(name, raw, pools, pairs, n * layers * spec.raw_page_size_bytes)


def time_calls(fn: Callable[[], Any], rounds: int = 5, warmup: int = 2,
               device: torch.device = DEVICE, repeat: int = 1) -> float:
    """Median seconds of one ``fn`` call over ``rounds`` rounds of ``repeat`` calls each (one
    synchronise per call), after ``warmup`` calls (the first touches of fresh host memory fault
    pages in, and the first fused call compiles the kernel)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
            _sync(device)
        times.append((time.perf_counter() - t0) / repeat)
    return statistics.median(times)


def _repeat_for(seconds: float, at_least: float = 0.005) -> int:
    """Calls per timed round so that a round lasts ``at_least`` seconds (timer resolution)."""
    return max(1, min(1000, int(at_least / max(seconds, 1e-9)) + 1))


def measure(case: Case, rounds: int = 5, device: torch.device = DEVICE) -> list[dict[str, Any]]:
    """One row per path of ``case``: seconds, GB/s, ``frac`` and ``frac_il`` (see module doc)."""
    src = torch.full((case.nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    base = time_calls(lambda: dst.copy_(src), rounds, device=device)
    base = time_calls(lambda: dst.copy_(src), rounds, device=device, repeat=_repeat_for(base))
    rows = []
    for path, pool in case.pools.items():
        t = time_calls(lambda pool=pool: pool.copy_(case.pairs), rounds, device=device)
        reps = _repeat_for(t)
        t = time_calls(lambda pool=pool: pool.copy_(case.pairs), rounds, device=device, repeat=reps)
        ratios = []
        for _ in range(rounds):
            tb = time_calls(lambda: dst.copy_(src), rounds=1, warmup=0, device=device,
                            repeat=_repeat_for(base))
            tc = time_calls(lambda pool=pool: pool.copy_(case.pairs), rounds=1, warmup=0,
                            device=device, repeat=reps)
            ratios.append(tb / tc)
        rows.append({"state": case.name, "path": path, "pairs": len(case.pairs),
                     "bytes": case.nbytes, "seconds": t, "GBps": case.nbytes / t / 1e9,
                     "contiguous_GBps": case.nbytes / base / 1e9, "frac": base / t,
                     "frac_il": statistics.median(ratios)})
    return rows


def check_paths_agree(case: Case) -> None:
    """The fused copy leaves the same bytes as the torch copy (raises AssertionError)."""
    if "fused" not in case.pools:
        return
    first_dst = case.pairs[0][1]  # destinations are the rows from here on
    for r in case.raw:
        r[first_dst:].zero_()
    case.pools["fused"].copy_(case.pairs)
    fused = [r[first_dst:].clone() for r in case.raw]
    for r in case.raw:
        r[first_dst:].zero_()
    case.pools["torch"].copy_(case.pairs)
    assert all(torch.equal(a, r[first_dst:]) for a, r in zip(fused, case.raw)), "fused != torch"
    assert any(bool(r[first_dst:].any()) for r in case.raw), "nothing was copied"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    head = f"{'state':<11} {'path':<6} {'pairs':>5} {'MiB':>9} {'ms':>9} {'GB/s':>8} " \
           f"{'contig GB/s':>11} {'frac':>6} {'frac_il':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['state']:<11} {r['path']:<6} {r['pairs']:>5} {r['bytes'] / 2**20:>9.1f} "
                     f"{r['seconds'] * 1e3:>9.3f} {r['GBps']:>8.1f} {r['contiguous_GBps']:>11.1f} "
                     f"{r['frac']:>6.2f} {r['frac_il']:>7.2f}")
    return "\n".join(lines)


def bandwidth_table(n: int = NUM_STATES, device: torch.device = DEVICE,
                    states: tuple[str, ...] = ("qwen3-next", "small")) -> list[dict[str, Any]]:
    """Measure every path for every state (checking first that the paths agree)."""
    rows = []
    for name in states:
        case = make_case(name, n, device)
        check_paths_agree(case)
        rows += measure(case, device=device)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("path", ["torch", "fused"])
def test_state_copy_qwen3_next(benchmark, path):
    if path == "fused" and not fused_supported():
        pytest.skip("fused path: needs triton and CUDA")
    case = make_case("qwen3-next")
    pool = case.pools[path]

    def run() -> None:
        pool.copy_(case.pairs)
        _sync()

    benchmark.pedantic(run, rounds=5, warmup_rounds=2, iterations=1)
    info = {k: v for k, v in measure(case)[list(case.pools).index(path)].items()}
    benchmark.extra_info.update(info)
    print("\n" + format_table([info]))
    n = len(case.pairs)
    assert torch.equal(pool.ssm_state(35)[n + 1], pool.ssm_state(35)[1])
    pool.check_invariants()


if __name__ == "__main__":
    print(f"device {DEVICE}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"fused path {'measured' if fused_supported() else 'not measured (needs triton and CUDA)'}")
    print(format_table(bandwidth_table()))
