"""Growth curves (issue 32, deliverable 4): the library's time per request and its memory against
prompt length and against cache size, both memory layouts (``unified``, ``decoupled``).

* **prompt length**: the single long prefill of ``mambakv replay`` (:func:`mambakv.sim.run_replay`,
  its defaults: 4 output tokens, 5 speculative tokens, 2 steps in flight) at 30k .. 2M prompt
  tokens on one budget (``--replay-memory-gib``, default 60 GiB: the 2M prompt needs about
  46.1 GiB in both layouts, 49.5 GB of used blocks);
* **cache size**: the Mooncake conversation trace, first ``--limit`` requests one at a time,
  conversation replay (``mambakv trace PATH --limit 3000 --one-at-a-time --replay conversation``,
  :func:`mambakv.sim.run_trace`) at 30 .. 240 GiB.

Per point and layout: the library time (``library_s`` of the result, best of ``--repeat``
timing passes, the two layouts alternating within each pass), the cache's peak used bytes
(``peak_bytes``), the trace's hit rate, and the run's host memory from a separate
:mod:`tracemalloc` pass (tracemalloc slows the code, so its times are not used): ``py_peak``, the
peak of Python allocations during the run above what was allocated before it (library,
simulator, the prompts' token lists and the trace rows the conversation replay reads, together),
and ``lib_retained``, what the library's own files (``mambakv/`` outside ``mambakv/sim/``)
allocated and still hold when the run ends (the coordinator with its cached prefixes). The
trace's tracemalloc pass may run fewer requests (``--memory-limit``): it is about 10x slower.

    python bench/growth.py --quick                                  # a few points, ~1 minute
    python bench/growth.py --repeat 2 --markdown --json growth.json --plot docs/growth.png

Compare the layouts within one run: the machine drifts.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import py_ref_ms  # noqa: E402

from mambakv.sim import load_trace, run_replay, run_trace  # noqa: E402
from mambakv.sim.sim_request import BudgetTooSmallError  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
LAYOUTS = ("unified", "decoupled")
PROMPTS = (30_000, 60_000, 120_000, 240_000, 480_000, 960_000, 2_000_000)
PROMPTS_QUICK = (30_000, 240_000, 2_000_000)
CACHE_GIB = (30.0, 60.0, 120.0, 240.0)
CACHE_GIB_QUICK = (30.0, 240.0)
LIBRARY_FILES = "*/mambakv/*"
SIM_FILES = "*/mambakv/sim/*"

Run = Callable[[str], dict[str, Any]]


def host_memory(run: Run, layout: str) -> tuple[int, int]:
    """``(py_peak, lib_retained)`` in bytes of one tracemalloc pass of ``run(layout)``: the peak of
    traced Python allocations above the level before the run, and the bytes allocated by library
    files (``mambakv/`` outside ``mambakv/sim/``) still held when it returns (the result, and so
    its coordinator, is alive while the snapshot is taken)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run(layout)
        peak = tracemalloc.get_traced_memory()[1] - base
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, LIBRARY_FILES), tracemalloc.Filter(False, SIM_FILES)])
        retained = sum(stat.size for stat in snap.statistics("filename"))
        del result
    finally:
        tracemalloc.stop()
    return peak, retained


def measure(run: Run, layouts: Sequence[str], repeat: int, memory_run: Run | None = None) -> dict[str, dict[str, Any]]:
    """One point: `repeat` timing passes of `run` (the layouts alternating, the first layout
    swapping each pass), then one tracemalloc pass per layout of `memory_run` (default `run`).
    Per layout: the first timing pass's result dict with ``library_s`` the best of the passes (s,
    from the dict's ``library_ms``: ``library_s`` is rounded to 0.1 ms), ``library_s_all`` every
    pass's (s), and ``py_peak`` / ``lib_retained`` (bytes, :func:`host_memory`)."""
    best: dict[str, dict[str, Any]] = {}
    for k in range(repeat):
        for layout in (layouts if k % 2 == 0 else tuple(reversed(layouts))):
            gc.collect()
            d = run(layout)
            rec = best.setdefault(layout, {**d, "library_s_all": []})
            rec["library_s_all"].append(d["library_ms"] / 1e3)
            rec["library_s"] = min(rec["library_s_all"])
    for layout in layouts:
        best[layout]["py_peak"], best[layout]["lib_retained"] = host_memory(memory_run or run, layout)
    return best


def replay_point(prompt_tokens: int, memory_gib: float, layouts: Sequence[str] = LAYOUTS,
                 repeat: int = 1) -> list[dict[str, Any]]:
    """The long prefill of `prompt_tokens` tokens on `memory_gib` GiB, per layout: one record with
    ``library_ms`` (ms per request: the replay is one request), ``library_us_per_1k`` (us per
    1,000 prompt tokens), ``peak_bytes`` (B), ``py_peak`` / ``lib_retained`` (B), ``steps``.
    A prompt that does not fit the budget gives a record with ``fits`` False and no figures."""
    def run(layout: str) -> dict[str, Any]:
        d = run_replay(prompt_tokens=prompt_tokens, memory_gib=memory_gib, layout=layout).to_dict()
        if d["finished"] != 1 or d["preemptions"]:
            raise BudgetTooSmallError(f"{prompt_tokens:,} tokens: finished {d['finished']}, "
                                      f"preemptions {d['preemptions']} on {memory_gib} GiB")
        return d
    try:
        by_layout = measure(run, layouts, repeat)
    except BudgetTooSmallError as e:
        return [{"axis": "prompt", "prompt_tokens": prompt_tokens, "memory_gib": memory_gib, "layout": layout,
                 "fits": False, "error": str(e)} for layout in layouts]
    return [{"axis": "prompt", "prompt_tokens": prompt_tokens, "memory_gib": memory_gib, "layout": layout, "fits": True,
             "library_s": d["library_s"], "library_s_all": d["library_s_all"], "library_ms": d["library_s"] * 1e3,
             "library_us_per_1k": d["library_s"] * 1e9 / prompt_tokens, "peak_bytes": d["peak_bytes"],
             "py_peak": d["py_peak"], "lib_retained": d["lib_retained"], "steps": d["steps"],
             "num_blocks": d["num_blocks"]}
            for layout, d in by_layout.items()]


def trace_point(memory_gib: float, limit: int, path: Path = TRACE, layouts: Sequence[str] = LAYOUTS,
                repeat: int = 1, memory_limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` requests of the trace at `path`, one at a time, conversation replay, on
    `memory_gib` GiB, per layout: one record with ``library_us_per_request`` (us),
    ``hit_rate``, ``peak_bytes`` (B), and ``py_peak`` / ``lib_retained`` (B) of a tracemalloc
    pass over the first `memory_limit` requests (default `limit`; tracemalloc makes a run about
    10x slower). The specs are read before any pass (the conversation replay reads the trace's rows
again inside each run: not in ``library_s``, in ``py_peak``)."""
    specs = load_trace(path, limit=limit)
    mem_n = min(limit, memory_limit or limit)

    def runner(n: int) -> Run:
        def run(layout: str) -> dict[str, Any]:
            d = run_trace(path, specs=specs[:n], limit=n, memory_gib=memory_gib, one_at_a_time=True,
                          replay="conversation", layout=layout).to_dict()
            assert d["finished"] == n, (d["finished"], n)
            return d
        return run
    return [{"axis": "cache", "memory_gib": memory_gib, "requests": limit, "memory_requests": mem_n, "layout": layout,
             "library_s": d["library_s"], "library_s_all": d["library_s_all"],
             "library_us_per_request": d["library_s"] * 1e6 / d["finished"], "hit_rate": d["hit_rate"],
             "peak_bytes": d["peak_bytes"], "py_peak": d["py_peak"], "lib_retained": d["lib_retained"],
             "num_blocks": d["num_blocks"], "steps": d["steps"]}
            for layout, d in measure(runner(limit), layouts, repeat, runner(mem_n)).items()]


# --------------------------------------------------------------------------- output
def _pair(records: list[dict[str, Any]], key: str, value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    by = {r["layout"]: r for r in records if r[key] == value}
    return by["unified"], by["decoupled"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def prompt_table(records: list[dict[str, Any]]) -> list[str]:
    """The prompt-length table as Markdown lines (unified / decoupled in each cell)."""
    lines = ["| prompt tokens | library ms / request | ratio d/u | us per 1k tokens | peak_bytes (GB) "
             "| tracemalloc peak (MiB) | library retained (MiB) |", "|---|---|---|---|---|---|---|"]
    for n in sorted({r["prompt_tokens"] for r in records}):
        u, d = _pair(records, "prompt_tokens", n)
        if not (u["fits"] and d["fits"]):
            lines.append(f"| {n:,} | does not fit: {u.get('error') or d.get('error')} | | | | | |")
            continue
        lines.append(f"| {n:,} | {u['library_ms']:.2f} / {d['library_ms']:.2f} | {d['library_s'] / u['library_s']:.2f} "
                     f"| {u['library_us_per_1k']:.1f} / {d['library_us_per_1k']:.1f} "
                     f"| {u['peak_bytes'] / 1e9:.2f} / {d['peak_bytes'] / 1e9:.2f} "
                     f"| {_mib(u['py_peak'])} / {_mib(d['py_peak'])} | {_mib(u['lib_retained'])} / "
                     f"{_mib(d['lib_retained'])} |")
    return lines


def cache_table(records: list[dict[str, Any]]) -> list[str]:
    """The cache-size table as Markdown lines (unified / decoupled in each cell)."""
    lines = ["| cache GiB | blocks / page ids | library us / request | ratio d/u | hit rate "
             "| tracemalloc peak (MiB) | library retained (MiB) |", "|---|---|---|---|---|---|---|"]
    for gib in sorted({r["memory_gib"] for r in records}):
        u, d = _pair(records, "memory_gib", gib)
        lines.append(f"| {gib:g} | {u['num_blocks']:,} / {d['num_blocks']:,} "
                     f"| {u['library_us_per_request']:.1f} / {d['library_us_per_request']:.1f} "
                     f"| {d['library_s'] / u['library_s']:.2f} | {u['hit_rate']:.4f} / {d['hit_rate']:.4f} "
                     f"| {_mib(u['py_peak'])} / {_mib(d['py_peak'])} | {_mib(u['lib_retained'])} / "
                     f"{_mib(d['lib_retained'])} |")
    return lines


def plot(prompt: list[dict[str, Any]], cache: list[dict[str, Any]], png: str) -> bool:
    """Two panels, log x axes: library ms per request against prompt tokens, library us per
    request against cache GiB, one line per layout. False when matplotlib is not importable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for layout in LAYOUTS:
        p = sorted((r for r in prompt if r["layout"] == layout and r.get("fits")), key=lambda r: r["prompt_tokens"])
        c = sorted((r for r in cache if r["layout"] == layout), key=lambda r: r["memory_gib"])
        left.plot([r["prompt_tokens"] for r in p], [r["library_ms"] for r in p], "o-", label=layout)
        right.plot([r["memory_gib"] for r in c], [r["library_us_per_request"] for r in c], "o-", label=layout)
    left.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="library ms per request",
             title="long prefill replay")
    requests = cache[0]["requests"] if cache else 0
    right.set(xscale="log", xlabel="cache GiB", ylabel="library us per request",
              title=f"trace, {requests} requests one at a time, conversation")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def _unwritable(path: str) -> str | None:
    """Why an output file cannot be written at `path`, or None."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a directory"
    if not p.parent.is_dir():
        return f"{p.parent} is not a directory"
    return None


def bad_options(args: argparse.Namespace) -> str | None:
    """The first option this run would fail on (checked before any work: the full run takes
    about 20 minutes), or None."""
    if args.repeat < 1:
        return f"--repeat must be >= 1, got {args.repeat}"
    if args.limit < 1:
        return f"--limit must be >= 1, got {args.limit}"
    if args.memory_limit is not None and args.memory_limit < 1:
        return f"--memory-limit must be >= 1, got {args.memory_limit}"
    if not (math.isfinite(args.replay_memory_gib) and args.replay_memory_gib > 0):
        return f"--replay-memory-gib must be a finite number > 0, got {args.replay_memory_gib}"
    if args.only == "cache" and not args.trace.exists():
        return f"--only cache needs the trace: {args.trace} is absent"
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        why = _unwritable(path) if path else None
        if why:
            return f"{option}: {why}"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install -e '.[plot]')"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer points: prompts 30k / 240k / 2M, caches 30 / 240 GiB")
    ap.add_argument("--repeat", type=int, default=1, help="timing passes per point, best of (default 1)")
    ap.add_argument("--limit", type=int, default=3000, help="trace requests (default 3000)")
    ap.add_argument("--memory-limit", type=int, default=None,
                    help="trace requests of the tracemalloc pass (default: --limit; tracemalloc runs ~10x slower)")
    ap.add_argument("--trace", type=Path, default=TRACE, help="the Mooncake trace (default ../shared/traces/...)")
    ap.add_argument("--replay-memory-gib", type=float, default=60.0, help="budget of the replays (GiB, default 60)")
    ap.add_argument("--only", choices=("prompt", "cache"), default=None, help="one axis only")
    ap.add_argument("--markdown", action="store_true", help="print the two tables as Markdown")
    ap.add_argument("--json", metavar="PATH", default=None, help="write every record as JSON")
    ap.add_argument("--plot", metavar="PNG", default=None, help="two panels, log x (needs matplotlib)")
    args = ap.parse_args(argv)
    why = bad_options(args)
    if why:
        ap.error(why)  # one line, exit 2, before any work
    ref_ms = [py_ref_ms()]
    print(f"py_ref_ms {ref_ms[0]:.1f} (about 22 on a quiet machine of this kind)", flush=True)
    t0 = time.perf_counter()
    prompt: list[dict[str, Any]] = []
    cache: list[dict[str, Any]] = []
    if args.only in (None, "prompt"):
        for n in PROMPTS_QUICK if args.quick else PROMPTS:
            recs = replay_point(n, args.replay_memory_gib, repeat=args.repeat)
            prompt += recs
            print(" ".join(f"{r['layout']}={r['library_ms']:.2f}ms" if r["fits"] else f"{r['layout']}=no-fit"
                           for r in recs), f"prompt={n}", f"t={time.perf_counter() - t0:.0f}s", flush=True)
    if args.only in (None, "cache"):
        if not args.trace.exists():
            print(f"trace absent: {args.trace}; cache axis skipped")
        else:
            for gib in CACHE_GIB_QUICK if args.quick else CACHE_GIB:
                recs = trace_point(gib, args.limit, args.trace, repeat=args.repeat, memory_limit=args.memory_limit)
                cache += recs
                print(" ".join(f"{r['layout']}={r['library_us_per_request']:.1f}us/req hit={r['hit_rate']:.4f}"
                               for r in recs), f"cache={gib:g}GiB", f"t={time.perf_counter() - t0:.0f}s", flush=True)
    wall = time.perf_counter() - t0
    ref_ms.append(py_ref_ms())
    print(f"wall {wall:.0f} s; py_ref_ms {ref_ms[1]:.1f} at the end")
    if args.markdown:
        for title, lines in (("prompt length", prompt_table(prompt) if prompt else []),
                             ("cache size", cache_table(cache) if cache else [])):
            if lines:
                print(f"\n{title}:\n")
                print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "wall_s": wall, "py_ref_ms": ref_ms, "prompt": prompt,
                                               "cache": cache}, indent=1) + "\n")
    if args.plot and not plot(prompt, cache, args.plot):
        print("matplotlib not importable: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
