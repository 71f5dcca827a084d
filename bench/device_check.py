"""The GPU check of the state pool and its fused copy (issue 20): one script, a few minutes.

On a machine with a CUDA GPU (and ``pip install -e '.[test,triton]'``)::

    python bench/device_check.py                 # all steps, about 2-3 minutes on one GPU
    python bench/device_check.py --json out.json # the same, figures also written as JSON

Steps (each prints PASS / FAIL; the exit status is 1 if any failed):

1. ``tests``: the state-pool, fused-copy and layout tests with ``MAMBAKV_TEST_DEVICE=cuda``
   (pools on the GPU, the fused kernel compiled, the CUDA-only ``test_cuda_copy_matches_cpu``
   enabled: a "needs CUDA" skip fails the step).
2. ``agree``: fused vs torch on the device, byte for byte: ``n`` Qwen3-Next states (36 layers) in
   one ``copy_``, then ``zero_``; and the Qwen3-Next hybrid layout (attention + 3 GDN groups over
   12 shared raw tensors): a copy in one group leaves every other byte of the raw tensors as it
   was.
3. ``bandwidth``: the table of ``bench/bench_state_copy.py`` (torch two-pass and fused, GB/s and
   fraction of a contiguous device copy of the same bytes, Qwen3-Next and a small state) and the
   issue's target: fused >= 0.80 of a contiguous copy for Qwen3-Next with 256 pairs.
4. ``tiles``: the fused kernel alone at other tile sizes and warp counts (for tuning
   ``fused_copy.TILE_BYTES``; informative, never fails).

Without CUDA it says so and exits 0 having checked nothing; ``--cpu-dry-run`` runs every step on
the CPU at toy sizes instead (fused under Triton's interpreter) to check the script itself.
Memory on the GPU for ``--states 256``: about 20 GB of pool + 20 GB of baseline buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_state_copy as bsc  # noqa: E402

from mambakv.device import fused_copy  # noqa: E402
from mambakv.device.layout import HybridLayout  # noqa: E402
from mambakv.models import build_kv_cache_config  # noqa: E402

TARGET = 0.80


def step_tests(device: torch.device) -> tuple[bool, dict[str, Any]]:
    env = dict(os.environ, MAMBAKV_TEST_DEVICE=device.type)
    if device.type == "cuda":  # the fused tests must run the compiled kernel, not the interpreter
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "tests/test_state_pool.py", "tests/test_fused_copy.py", "tests/test_layout.py"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    print("\n".join(text.strip().splitlines()[-15:]))
    ok = out.returncode == 0
    if device.type == "cuda" and "needs CUDA" in text:
        print("FAIL: a CUDA test was skipped on a CUDA machine")
        ok = False
    if "test_fused_copy.py" in text and "could not import 'triton'" in text:
        print("FAIL: triton is not installed: pip install -e '.[test,triton]'")
        ok = False
    return ok, {"returncode": out.returncode, "seconds": time.perf_counter() - t0,
                "summary": text.strip().splitlines()[-1] if text.strip() else ""}


def _random_rows(raw: list[torch.Tensor] | tuple[torch.Tensor, ...], seed: int) -> None:
    g = torch.Generator(device=raw[0].device).manual_seed(seed)
    for r in raw:
        r[1:] = torch.randint(0, 256, r[1:].shape, generator=g, dtype=torch.uint8,
                              device=r.device)


def step_agree(device: torch.device, n: int) -> tuple[bool, dict[str, Any]]:
    if not fused_copy.triton_available():
        print("SKIP: triton is not installed")
        return device.type != "cuda", {"skipped": True}
    case = bsc.make_case("qwen3-next", n, device, fused=True)
    bsc.check_paths_agree(case)  # raises on a difference
    zero = list(range(1, 2 * n + 1, 3))
    _random_rows(case.raw, 1)
    case.pools["fused"].zero_(zero)
    fused = [r.clone() for r in case.raw]
    _random_rows(case.raw, 1)
    case.pools["torch"].zero_(zero)
    ok = all(torch.equal(a, b) for a, b in zip(fused, case.raw))
    del case, fused
    print(f"qwen3-next, {n} pairs x 36 layers: copy_ and zero_ agree: {ok}")
    # the hybrid layout: 12 raw tensors shared by 1 attention + 3 GDN groups
    blocks = 2 * n + 8
    cfg = build_kv_cache_config("qwen3-next-80b-a3b", blocks * 13_369_344)
    lays = [HybridLayout(cfg, device, copy_backend=b) for b in ("torch", "triton")]
    for lay in lays:
        _random_rows(lay.raw, 2)
    gids = lays[1].mamba_group_ids()
    pairs = [(1 + k, 1 + n + k) for k in range(min(n, (blocks - 2) // 2))]
    before = [r.clone() for r in lays[1].raw]
    for lay in lays:
        lay.state_pool(gids[1]).copy_(pairs)
        lay.state_pool(gids[1]).zero_([blocks - 1])
    same = all(torch.equal(a, b) for a, b in zip(lays[0].raw, lays[1].raw))
    page = lays[1].state_pool(gids[1]).kv_cache_spec.raw_page_size_bytes
    dst = [d for _, d in pairs] + [blocks - 1]
    others = [b for b in range(blocks) if b not in set(dst)]
    untouched = all(torch.equal(r[others], o[others]) and torch.equal(r[dst, page:], o[dst, page:])
                    for r, o in zip(lays[1].raw, before))
    print(f"hybrid layout, group {gids[1]}: fused == torch: {same}; other rows and padding "
          f"untouched: {untouched}")
    return ok and same and untouched, {"pool": ok, "layout_same": same, "untouched": untouched}


def step_bandwidth(device: torch.device, n: int) -> tuple[bool, dict[str, Any]]:
    rows = bsc.bandwidth_table(n, device)
    print(bsc.format_table(rows))
    fused = [r for r in rows if r["state"] == "qwen3-next" and r["path"] == "fused"]
    if not fused:
        print("target: not measured (fused path needs triton and CUDA)")
        return device.type != "cuda", {"rows": rows}
    frac = fused[0]["frac"]
    met = frac >= TARGET
    print(f"target fused >= {TARGET:.2f} of a contiguous copy (qwen3-next, {n} pairs): "
          f"{frac:.2f} -> {'met' if met else 'NOT met'}"
          + ("" if n == 256 else " (the target is stated for 256 pairs)"))
    return True, {"rows": rows, "target_met": met}  # a missed target is reported, not a failure


def step_tiles(device: torch.device, n: int) -> tuple[bool, dict[str, Any]]:
    if not fused_copy.triton_available():
        print("SKIP: triton is not installed")
        return True, {}
    case = bsc.make_case("qwen3-next", n, device, fused=False)
    rows = [r[:, : bsc.state_spec("qwen3-next")[0].raw_page_size_bytes] for r in case.raw]
    src, dst = [s for s, _ in case.pairs], [d for _, d in case.pairs]
    a = torch.full((case.nbytes,), 7, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    base = bsc.time_calls(lambda: b.copy_(a), device=device)
    results = []
    cpu = device.type == "cpu"  # the interpreter: one configuration, one call, for the script only
    for tile in (16384,) if cpu else (4096, 8192, 16384, 32768, 65536):
        for warps in (4, 8):
            copier = fused_copy.FusedRowCopy(rows, tile_bytes=tile, num_warps=warps)
            t = bsc.time_calls(lambda c=copier: c.copy_rows(src, dst), rounds=1 if cpu else 5,
                               warmup=0 if cpu else 2, device=device)
            results.append({"tile_bytes": tile, "num_warps": warps, "seconds": t,
                            "GBps": case.nbytes / t / 1e9, "frac": base / t})
            print(f"tile {tile:>6} B, {warps} warps: {case.nbytes / t / 1e9:8.1f} GB/s, "
                  f"{base / t:5.2f} of contiguous")
            if cpu:
                break
    return True, {"contiguous_GBps": case.nbytes / base / 1e9, "configs": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--states", type=int, default=256, help="pairs per copy_ (default 256)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: run every step on the CPU at toy sizes (checks the script)")
    ap.add_argument("--skip-tests", action="store_true", help="skip step 1 (pytest)")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, triton "
          f"{_version('triton') if fused_copy.triton_available() else 'not installed'}, "
          f"python {sys.version.split()[0]}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        print(f"device {torch.cuda.get_device_name(device)}, "
              f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB")
        n = args.states
    elif args.cpu_dry_run:
        device, n = torch.device("cpu"), 2
        print("no CUDA: CPU dry run at toy sizes (fused path under the interpreter where it runs; "
              "no GPU figure is produced)")
    else:
        print("no CUDA device: nothing checked (use --cpu-dry-run to exercise the script)")
        return 0
    steps = [("tests", lambda: step_tests(device)), ("agree", lambda: step_agree(device, n)),
             ("bandwidth", lambda: step_bandwidth(device, n)), ("tiles", lambda: step_tiles(device, n))]
    if args.skip_tests:
        steps = steps[1:]
    report: dict[str, Any] = {"device": str(device), "states": n}
    failed = []
    for name, fn in steps:
        print(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            ok, info = fn()
        except Exception as e:  # a step that crashes fails; the others still run
            ok, info = False, {"error": repr(e)}
            print(f"error: {e!r}")
        info["seconds"] = round(time.perf_counter() - t0, 1)
        report[name] = info
        print(f"{'PASS' if ok else 'FAIL'} {name} ({info['seconds']} s)")
        if not ok:
            failed.append(name)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
