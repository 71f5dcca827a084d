"""Batched Mamba state copy: 64 Qwen3-Next-80B-A3B states (36 GDN layers) in one ``copy_``.

Run:  ``python -m pytest bench/bench_state_copy.py --benchmark-only``  (or ``python
bench/bench_state_copy.py`` without pytest-benchmark).  Environment:
``MAMBAKV_BENCH_STATES`` (default 64), ``MAMBAKV_BENCH_DEVICE`` (default CUDA if present),
``MAMBAKV_BENCH_THREADS`` (CPU intra-op threads; default torch's).  On a small shared CPU
machine the 2-thread gather/scatter suffers far more from other processes than a plain copy;
1 thread gives the stable figure (about 0.5: gather + scatter move every byte twice).

Bandwidth is reported as a fraction of one contiguous ``Tensor.copy_`` of the same number of
bytes on the same device (target >= 0.30); ``fraction_interleaved_median`` times both in the
same round, which is the figure to trust on a shared, loaded machine.  Bytes per call: 64 x 36 x 1,097,728 B = 2.53 GB
(bf16 conv + SSM of DESIGN.md 7).  Host memory: pool (2 x 64 + 1 blocks) ~5.1 GB + baseline
buffers 2 x 2.53 GB.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from mambakv.core.spec import MambaSpec
from mambakv.device.state_pool import MambaStatePool
from mambakv.models import load_model

NUM_STATES = int(os.environ.get("MAMBAKV_BENCH_STATES", "64"))
DEVICE = torch.device(os.environ.get("MAMBAKV_BENCH_DEVICE")
                      or ("cuda" if torch.cuda.is_available() else "cpu"))


if os.environ.get("MAMBAKV_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["MAMBAKV_BENCH_THREADS"]))


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_case(n: int = NUM_STATES):
    """A 36-layer Qwen3-Next pool with blocks 1..n as sources and n+1..2n as destinations."""
    model = load_model("qwen3-next-80b-a3b")
    spec = MambaSpec(544, model.state_shapes(), model.state_dtypes())
    layers = len(model.mamba_layers)  # 36
    pool = MambaStatePool(spec, layers, 2 * n + 1, DEVICE)
    for layer in range(layers):  # non-zero data, so nothing is trivially skipped
        for i in range(pool.num_states):
            pool.state(layer, i)[1:].fill_(0.5 + i)
    pairs = [(1 + k, 1 + n + k) for k in range(n)]
    nbytes = n * layers * spec.raw_page_size_bytes
    return pool, pairs, nbytes


def time_calls(fn, rounds: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``rounds`` after ``warmup`` calls (the first touches of
    fresh host memory fault pages in and can be 10x slower than the steady state)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def contiguous_baseline(nbytes: int, rounds: int = 5) -> float:
    """Median seconds of one contiguous ``dst.copy_(src)`` of ``nbytes`` bytes."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), rounds)
    return t


def interleaved_fraction(pool: MambaStatePool, pairs, nbytes: int, rounds: int = 5) -> float:
    """Median over rounds of ``t(contiguous copy) / t(copy_)``, both timed in the same round,
    so that load from other processes on a shared machine affects both alike."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ratios = []
    for r in range(rounds + 2):  # the first two rounds warm both up
        t_base = time_calls(lambda: dst.copy_(src), rounds=1, warmup=0)
        t_copy = time_calls(lambda: pool.copy_(pairs), rounds=1, warmup=0)
        if r >= 2:
            ratios.append(t_base / t_copy)
    return statistics.median(ratios)


def report(t_copy: float, t_base: float, nbytes: int, fraction: float) -> dict:
    return {
        "device": str(DEVICE), "threads": torch.get_num_threads(), "states": NUM_STATES,
        "bytes": nbytes,
        "state_copy_s": t_copy, "contiguous_copy_s": t_base,
        "state_copy_GBps": nbytes / t_copy / 1e9, "contiguous_GBps": nbytes / t_base / 1e9,
        "fraction_of_contiguous": t_base / t_copy,
        "fraction_interleaved_median": fraction,
    }


def test_state_copy_64_qwen3_next(benchmark):
    pool, pairs, nbytes = make_case()

    def run() -> None:
        pool.copy_(pairs)
        _sync()

    benchmark.pedantic(run, rounds=5, warmup_rounds=2, iterations=1)
    t_copy = benchmark.stats.stats.median
    t_base = contiguous_baseline(nbytes)
    info = report(t_copy, t_base, nbytes, interleaved_fraction(pool, pairs, nbytes))
    benchmark.extra_info.update(info)
    print("\n" + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in info.items()))
    assert torch.equal(pool.ssm_state(35)[NUM_STATES + 1], pool.ssm_state(35)[1])
    pool.check_invariants()


if __name__ == "__main__":
    pool, pairs, nbytes = make_case()
    t_copy = time_calls(lambda: pool.copy_(pairs))
    info = report(t_copy, contiguous_baseline(nbytes), nbytes,
                  interleaved_fraction(pool, pairs, nbytes))
    print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in info.items()))
