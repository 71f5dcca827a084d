"""``mambakv sweep TRACE``: hit rate and prefill saved against memory, one ordinary ``trace``
run per point of a grid.

    mambakv sweep TRACE --memory-gib 20,40,60,80,120 --layout unified,decoupled --limit 3000 \\
        --host-memory-gib 0,256 --out sweep/ --plot sweep.png

The grids (a comma list, or ``START:STOP:STEP`` with STOP included when it is on the grid):
``--memory-gib``, ``--host-memory-gib`` (0: no host tier, the ``trace`` run without the flag),
``--layout``, ``--eviction`` (decoupled points only: the unified layout is vLLM's LRU, so its
points run without the flag) and ``--page-tokens`` (decoupled points only). Every other option is
``trace``'s, passed through unchanged. A point is ``mambakv trace TRACE <options> --json`` with
its grid values: its record is exactly the object that command prints.

Points run in parallel worker processes (``--workers N``, default the machine's cores) or on a
Ray cluster (``--ray [ADDRESS]``; the extra ``mambakv[ray]``; a local Ray when no address is
given). Each finished point is appended at once, as one line, to ``DIR/points.jsonl``
(``--out DIR``); ``DIR/sweep.json`` records what the points depend on (the options, the trace
file's SHA-256, the mambakv version). A sweep run again with the same ``DIR`` reuses a finished
point only when all three match, and runs the rest: an interrupted sweep resumes where it
stopped. A line is written whole or not at all (Ctrl-C, a killed worker), and a torn last line
left by a crash is dropped on resume.

The report: one row per point, the "reading the sweep" line (per line of the plot, the smallest
memory that reaches 90% of the hit rate at that line's largest memory), ``--json`` (the records),
``--csv FILE`` (the table) and ``--plot PNG`` (hit rate against GPU memory, one line per layout /
eviction / host setting, unified as the baseline; and the prefill tokens saved per second of
trace).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mambakv.cli.args import progress
from mambakv.core.errors import MambaKVError
from mambakv.models.kv_config import DEFAULT_PAGE_TOKENS, LAYOUTS

__all__ = ["Point", "SweepError", "add_sweep_arguments", "parse_grid", "read_points", "run_point", "run_sweep_command",
           "sweep_points"]

#: the share of the largest memory's hit rate the "reading the sweep" line asks for
ENOUGH = 0.9
EVICTIONS = ("reuse", "lru")


class SweepError(MambaKVError, ValueError):
    """A sweep that cannot run: a bad grid, a bad output directory, Ray missing."""


# --------------------------------------------------------------------------- the grid
def parse_grid(text: str, kind: Callable[[str], Any], what: str) -> list[Any]:
    """A grid option: ``"a,b,c"`` or ``"START:STOP:STEP"`` (numbers; STOP included when on the
    grid), each value checked by `kind`, in the order given, repeats dropped.

    Raises:
        SweepError: an empty grid, a bad value, or a range with a step <= 0 or STOP < START.
    """
    text = text.strip()
    values: list[Any]
    try:
        if ":" in text:
            parts = text.split(":")
            if len(parts) != 3:
                raise ValueError("a range is START:STOP:STEP")
            start, stop, step = (float(p) for p in parts)
            if not (math.isfinite(start) and math.isfinite(stop) and math.isfinite(step)) or step <= 0 or stop < start:
                raise ValueError("a range needs STEP > 0 and STOP >= START")
            n = int(math.floor((stop - start) / step + 1e-9)) + 1
            values = [kind(repr(round(start + i * step, 9))) for i in range(n)]
        else:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise SweepError(f"--{what} {text!r}: {e}") from None
    if not values:
        raise SweepError(f"--{what} {text!r}: an empty grid")
    return list(dict.fromkeys(values))


def _non_negative(text: str) -> float:
    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return v


def _positive(text: str) -> float:
    v = float(text)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"expected a number > 0, got {text!r}")
    return v


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def _page_tokens(text: str) -> int:
    v = int(float(text))
    if v != float(text) or v <= 0 or v % 16:
        raise ValueError(f"expected a positive multiple of 16, got {text!r}")
    return v


@dataclass(frozen=True, order=True)
class Point:
    """One point of the grid: the ``trace`` options it sets (`eviction` and `page_tokens` are
    None for a unified point: they do not apply there)."""

    layout: str
    eviction: str | None
    host_memory_gib: float
    page_tokens: int | None
    memory_gib: float

    def trace_options(self) -> list[str]:
        """The point's grid values as ``trace`` options."""
        out = ["--layout", self.layout, "--memory-gib", repr(self.memory_gib)]
        if self.host_memory_gib:
            out += ["--host-memory-gib", repr(self.host_memory_gib)]
        if self.eviction is not None:
            out += ["--eviction", self.eviction]
        if self.page_tokens is not None:
            out += ["--page-tokens", str(self.page_tokens)]
        return out

    @property
    def line(self) -> tuple[str, str | None, float, int | None]:
        """The plot line the point is on: everything but its GPU memory."""
        return self.layout, self.eviction, self.host_memory_gib, self.page_tokens

    @classmethod
    def of_record(cls, d: dict[str, Any]) -> Point:
        """The point a ``trace --json`` record ran (what it says about itself)."""
        decoupled = d["layout"] == "decoupled"
        return cls(d["layout"], d.get("eviction_policy") if decoupled else None, float(d.get("host_memory_gib") or 0.0),
                   int(d["page_tokens"]) if decoupled else None, float(d["memory_gib"]))


#: GiB a host tier's record may read below the memory asked for (whole superblocks: less than one)
HOST_SLACK_GIB = 0.125


def match_point(d: dict[str, Any], points: Iterable[Point]) -> Point | None:
    """The grid point a ``trace --json`` record ran, or None. A record gives its host tier's
    actual bytes (whole superblocks), a little below the memory asked for: the host value
    matches within ``HOST_SLACK_GIB`` below; everything else exactly."""
    got = Point.of_record(d)
    for p in points:
        if (p.layout, p.eviction, p.page_tokens, p.memory_gib) == (got.layout, got.eviction, got.page_tokens,
                                                                     got.memory_gib) and \
                0 <= p.host_memory_gib - got.host_memory_gib < (HOST_SLACK_GIB if p.host_memory_gib else 1e-9):
            return p
    return None


def sweep_points(memory: Iterable[float], host: Iterable[float], layouts: Iterable[str], evictions: Iterable[str],
                 page_tokens: Iterable[int]) -> list[Point]:
    """Every point of the grid (unified points once per memory and host setting: eviction and
    page size do not apply to them), sorted by line then memory."""
    out = set()
    for mem, h, layout in itertools.product(memory, host, layouts):
        if layout == "unified":
            out.add(Point(layout, None, float(h), None, float(mem)))
        else:
            for ev, pt in itertools.product(evictions, page_tokens):
                out.add(Point(layout, ev, float(h), int(pt), float(mem)))
    return sorted(out)


# --------------------------------------------------------------------------- one point
def run_point(trace: str, options: Sequence[str]) -> dict[str, Any]:
    """``mambakv trace TRACE <options> --json --quiet``'s object (in a worker process)."""
    from mambakv.cli.runs import run_command, trace_parser

    args = trace_parser().parse_args(["trace", trace, *options, "--json", "--quiet"])
    return run_command(args)


def _checked_trace_options(trace: str, options: Sequence[str]) -> None:
    """Parse the pass-through options as ``trace`` would, before any work (one line, exit 2 on
    a bad one)."""
    import contextlib

    from mambakv.cli.runs import trace_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = trace_parser().parse_args(["trace", trace, *options])
    except SystemExit:  # argparse's one line: raised as the sweep's, not printed twice
        message = err.getvalue().strip().removeprefix("mambakv: error: ")
        raise SweepError(message.replace("mambakv trace --help", "mambakv trace --help; mambakv sweep --help")) from None
    for flag in ("plot", "json", "save_hazard_table"):
        if getattr(args, flag, None):
            raise SweepError(f"--{flag.replace('_', '-')} is a sweep option or not one a point takes")


# --------------------------------------------------------------------------- the records
def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_points(path: Path) -> list[dict[str, Any]]:
    """The records of ``points.jsonl``; a torn last line (a crash while writing it) is dropped
    and cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    out: list[dict[str, Any]] = []
    good = 0
    for raw in data.splitlines(keepends=True):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("torn")
            out.append(json.loads(raw))
        except ValueError:
            break
        good += len(raw)
    if good != len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    """One record as one whole line (one write, flushed and synced)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- running the points
def _run_local(trace: str, jobs: list[tuple[Point, list[str]]], workers: int) -> Iterator[tuple[Point, dict[str, Any]]]:
    """Finished points in completion order, from `workers` worker processes (in this process
    when 1)."""
    if workers <= 1 or len(jobs) <= 1:
        for point, options in jobs:
            yield point, run_point(trace, options)
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    pool = cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn"))
    try:
        futures = {pool.submit(run_point, trace, options): point for point, options in jobs}
        for fut in cf.as_completed(futures):
            yield futures[fut], fut.result()
    finally:  # Ctrl-C or an error: drop what has not started, stop the workers
        pool.shutdown(wait=False, cancel_futures=True)


def _run_ray(trace: str, jobs: list[tuple[Point, list[str]]], address: str | None) -> Iterator[tuple[Point, dict[str, Any]]]:
    """Finished points in completion order, one Ray task each (``ray.init(address)``; a local
    Ray when `address` is None)."""
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'mambakv[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True)
    task = ray.remote(run_point)
    refs = {task.remote(trace, options): point for point, options in jobs}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield refs[ref], ray.get(ref)
    finally:
        for ref in pending:
            ray.cancel(ref)


# --------------------------------------------------------------------------- the report
TABLE_COLUMNS = ("layout", "eviction", "host_gib", "page_tokens", "gpu_gib", "hit_rate", "hit_rate_gpu", "hit_rate_host",
                 "prefill_saved_tokens", "preemptions", "peak_page_gib", "peak_state_gib", "mean_idle_gib")


def table_row(p: Point, d: dict[str, Any]) -> dict[str, Any]:
    """One row of the sweep's table from a point's record: the hit rate and its GPU / host split,
    the prefill tokens saved (cached tokens), preemptions, the peak bytes in attention pages (the
    attention groups' peaks) and Mamba states (decoupled: the arena's peak of states held at
    once; unified: the Mamba groups' peaks) and the mean fragmentation (decoupled: the idle bytes
    of state superblocks; 0 unified). `p`: the grid point (the memory asked for)."""
    gib = float(1 << 30)
    groups = d.get("groups") or []
    page_peak = sum(g["peak_bytes"] for g in groups if g["kind"] != "mamba") / gib
    state_peak = sum(g["peak_bytes"] for g in groups if g["kind"] == "mamba") / gib
    arena = d.get("arena")
    idle = 0.0
    if arena is not None:  # the arena's own peak of states held at once, and the idle tails
        state_peak = arena["peak_state_bytes"] / gib
        idle = arena["mean_idle_bytes"] / gib
    hit = d["hit_rate"]
    return {"layout": p.layout, "eviction": p.eviction or "lru (vLLM)", "host_gib": p.host_memory_gib,
            "page_tokens": p.page_tokens or "", "gpu_gib": p.memory_gib, "hit_rate": hit,
            "hit_rate_gpu": d.get("hit_rate_gpu", hit), "hit_rate_host": d.get("hit_rate_host", 0.0),
            "prefill_saved_tokens": d["cached_tokens"], "preemptions": d["preemptions"],
            "peak_page_gib": round(page_peak, 3), "peak_state_gib": round(state_peak, 3), "mean_idle_gib": round(idle, 3)}


def line_label(line: tuple[str, str | None, float, int | None]) -> str:
    layout, eviction, host, page = line
    label = "unified (vLLM 0.33)" if layout == "unified" else f"decoupled {eviction}, {page}-token pages"
    return label + (f" + {host:g} GiB host" if host else "")


def readings(pairs: Sequence[tuple[Point, dict[str, Any]]]) -> list[str]:
    """Per plot line: the smallest GPU memory reaching ``ENOUGH`` of the hit rate at the line's
    largest memory."""
    lines: dict[tuple[str, str | None, float, int | None], list[tuple[float, float]]] = {}
    for p, d in pairs:
        lines.setdefault(p.line, []).append((p.memory_gib, d["hit_rate"]))
    out = []
    for line, pts in sorted(lines.items(), key=lambda kv: (kv[0][0] != "unified", line_label(kv[0]))):
        pts.sort()
        top_mem, top = pts[-1]
        need = ENOUGH * top
        first = next(mem for mem, hit in pts if hit >= need - 1e-12)  # (0.9 x 0.2 is 0.18000000000000002)
        out.append(f"{line_label(line)}: {first:g} GiB reaches {ENOUGH:.0%} of its hit rate at {top_mem:g} GiB "
                   f"({top:.4f})")
    return out


def format_table(pairs: Sequence[tuple[Point, dict[str, Any]]]) -> str:
    rows = [table_row(p, d) for p, d in pairs]
    head = (f"{'layout':<10} {'eviction':<11} {'host':>6} {'page':>5} {'GPU GiB':>8} {'hit rate':>9} {'GPU':>7} "
            f"{'host':>7} {'saved tokens':>13} {'preempt':>8} {'pages':>7} {'states':>7} {'idle':>6}")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["layout"], str(r["eviction"]), r["host_gib"], str(r["page_tokens"]),
                                         r["gpu_gib"])):
        lines.append(f"{r['layout']:<10} {r['eviction']:<11} {r['host_gib']:>6g} {r['page_tokens']!s:>5} "
                     f"{r['gpu_gib']:>8g} {r['hit_rate']:>9.4f} {r['hit_rate_gpu']:>7.4f} {r['hit_rate_host']:>7.4f} "
                     f"{r['prefill_saved_tokens']:>13,} {r['preemptions']:>8,} {r['peak_page_gib']:>7.2f} "
                     f"{r['peak_state_gib']:>7.2f} {r['mean_idle_gib']:>6.2f}")
    lines.append("")
    lines.append("reading the sweep:")
    lines += ["  " + r for r in readings(pairs)]
    lines.append("(hit rate: cached / prompt tokens; GPU / host: the tier the hit came from; saved tokens: prefill "
                 "tokens not computed; pages / states: peak GiB held; idle: mean GiB idle in state superblocks)")
    return "\n".join(lines)


def write_csv(pairs: Sequence[tuple[Point, dict[str, Any]]], path: str) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=TABLE_COLUMNS)
    w.writeheader()
    for p, d in pairs:
        w.writerow(table_row(p, d))
    Path(path).write_text(buf.getvalue())


def write_sweep_plot(pairs: Sequence[tuple[Point, dict[str, Any]]], path: str, trace_seconds: float) -> None:
    """Hit rate against GPU memory, one line per layout / eviction / host setting (unified, vLLM
    0.33's layout, dashed as the baseline), every point marked; and the prefill tokens saved
    per second of trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, str | None, float, int | None], list[tuple[float, float, int]]] = {}
    for p, d in pairs:
        lines.setdefault(p.line, []).append((p.memory_gib, d["hit_rate"], d["cached_tokens"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.8))
    # colour: the layout and eviction (unified, the baseline, in black); line style: the host
    # tier (solid: none); marker: the page size. Lines that coincide stay told apart by marker.
    colours: dict[tuple[str, str | None], str] = {}
    palette = iter(["tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:cyan"])
    hosts = sorted({line[2] for line in lines})
    styles = dict(zip(hosts, ["-", "--", ":", "-."] * len(hosts)))
    pages = sorted({line[3] or 0 for line in lines})
    markers = dict(zip(pages, ["o", "s", "^", "D", "v"] * len(pages)))
    for line, pts in sorted(lines.items(), key=lambda kv: (kv[0][0] != "unified", line_label(kv[0]))):
        pts.sort()
        mem = [m for m, _, _ in pts]
        key = (line[0], line[1])
        if key not in colours:
            colours[key] = "black" if line[0] == "unified" else next(palette, "tab:gray")
        style = {"color": colours[key], "linestyle": styles[line[2]], "marker": markers[line[3] or 0],
                 "markersize": 5, "label": line_label(line)}
        ax1.plot(mem, [h for _, h, _ in pts], **style)
        ax2.plot(mem, [c / trace_seconds if trace_seconds > 0 else c for _, _, c in pts], **style)
    ax1.set_xlabel("GPU memory for KV cache and states (GiB)")
    ax1.set_ylabel("prefix-cache hit rate (cached / prompt tokens)")
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax1.set_title("hit rate against GPU memory (black: unified, vLLM 0.33's layout)")
    ax2.set_xlabel("GPU memory for KV cache and states (GiB)")
    ax2.set_ylabel("prefill tokens saved per second of trace" if trace_seconds > 0 else "prefill tokens saved")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.set_title("prefill saved")
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.05 + 0.035 * ((len(lines) - 1) // 3), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def _trace_seconds(trace: str, options: Sequence[str]) -> float:
    """The span of the swept requests' arrivals (seconds): the second panel's denominator."""
    from mambakv.cli.runs import trace_parser
    from mambakv.sim.workloads import load_trace

    args = trace_parser().parse_args(["trace", trace, *options])
    specs = load_trace(trace, limit=args.limit, skip=args.skip)
    if len(specs) < 2:
        return 0.0
    arrivals = [s.arrival_ms for s in specs]
    return (max(arrivals) - min(arrivals)) / 1000.0


# --------------------------------------------------------------------------- the command
def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="Mooncake trace file (as for `mambakv trace`)")
    p.add_argument("--memory-gib", default="20,40,60,80,120", metavar="GRID",
                   help="GPU memory grid, GiB: a,b,c or START:STOP:STEP (default 20,40,60,80,120)")
    p.add_argument("--host-memory-gib", default="0", metavar="GRID",
                   help="host-tier memory grid, GiB; 0: no host tier (default 0)")
    p.add_argument("--layout", default="unified,decoupled", metavar="GRID",
                   help=f"layouts: {', '.join(LAYOUTS)} (default both)")
    p.add_argument("--eviction", default="reuse", metavar="GRID",
                   help="decoupled eviction policies: reuse, lru (default reuse; unified points are vLLM's LRU)")
    p.add_argument("--page-tokens", default=str(DEFAULT_PAGE_TOKENS), metavar="GRID",
                   help=f"decoupled page sizes, tokens, multiples of 16 (default {DEFAULT_PAGE_TOKENS})")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes (default: the machine's cores)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the points on a Ray cluster (ADDRESS; none: a local Ray); needs mambakv[ray]")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="keep every finished point in DIR/points.jsonl and resume from it (default: none kept)")
    p.add_argument("--json", action="store_true", help="print the points' records as one JSON list")
    p.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the figure (.png, .svg or .pdf; matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_sweep_command(args: argparse.Namespace, trace_options: Sequence[str]) -> str:
    """Run ``mambakv sweep`` (`trace_options`: the options not the sweep's, for every point);
    returns what it prints.

    Raises:
        SweepError / any MambaKVError: bad grids, options, paths; before any point runs.
    """
    from mambakv import __version__
    from mambakv.cli.args import check_output_path

    memory = parse_grid(args.memory_gib, _positive, "memory-gib")
    host = parse_grid(args.host_memory_gib, _non_negative, "host-memory-gib")
    layouts = parse_grid(args.layout, _choice(LAYOUTS), "layout")
    evictions = parse_grid(args.eviction, _choice(EVICTIONS), "eviction")
    pages = parse_grid(args.page_tokens, _page_tokens, "page-tokens")
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise SweepError(f"--workers must be >= 1, got {workers}")
    trace = str(args.path)
    if not Path(trace).is_file():
        raise SweepError(f"trace {trace!r} is not a file")
    for flag in ("--layout", "--memory-gib", "--host-memory-gib", "--eviction", "--page-tokens"):
        if any(o == flag or o.startswith(flag + "=") for o in trace_options):
            raise SweepError(f"{flag} is a grid of the sweep; give it once")
    _checked_trace_options(trace, trace_options)
    for flag, out_path in (("--plot", args.plot), ("--csv", args.csv)):
        if out_path:
            check_output_path(out_path, flag)
    if args.plot:
        from mambakv.cli.plot import check_plot_path

        check_plot_path(args.plot)
    points = sweep_points(memory, host, layouts, evictions, pages)
    for p in points:  # every point's own options parse (e.g. a host tier the layout refuses is run-time)
        _checked_trace_options(trace, [*trace_options, *p.trace_options()])
    records: dict[Point, dict[str, Any]] = {}
    store: Path | None = None
    if args.out:
        store = Path(args.out)
        if store.exists() and not store.is_dir():
            raise SweepError(f"--out {args.out!r} is not a directory")
        store.mkdir(parents=True, exist_ok=True)
        manifest = {"mambakv": __version__, "trace": trace, "trace_sha256": file_sha256(trace),
                    "options": list(trace_options)}
        mpath, ppath = store / "sweep.json", store / "points.jsonl"
        old = json.loads(mpath.read_text()) if mpath.exists() else None
        if old == manifest:
            for d in read_points(ppath):
                matched = match_point(d, points)
                if matched is not None:
                    records[matched] = d
        else:
            if ppath.exists():  # another trace, version or options: nothing is reused
                ppath.replace(store / "points.jsonl.old")
            mpath.write_text(json.dumps(manifest, indent=1) + "\n")
    todo = [(p, [*trace_options, *p.trace_options()]) for p in points if p not in records]
    if todo:
        bar = progress(len(points), args.quiet)
        if bar is not None:
            bar.update(len(points) - len(todo))
        runner = _run_ray(trace, todo, args.ray or None) if args.ray is not None else _run_local(trace, todo, workers)
        try:
            for point, d in runner:
                records[point] = d
                if store is not None:
                    _append(store / "points.jsonl", d)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
    pairs = [(p, records[p]) for p in points]
    if args.csv:
        write_csv(pairs, args.csv)
    if args.plot:
        write_sweep_plot(pairs, args.plot, _trace_seconds(trace, trace_options))
        print(f"wrote {args.plot}", file=sys.stderr)
    return json.dumps([d for _, d in pairs], indent=1) if args.json else format_table(pairs)
