"""The ``mambakv`` command: replay workloads through the library as an engine drives it.

    mambakv replay                      # the 480,031-token prefill on Qwen3-Next-80B-A3B
    mambakv trace TRACE.jsonl --limit 2000 [--one-at-a-time] [--json]
    mambakv chat --conversations 16 --turns 4
    mambakv models

Every number printed is explained by ``mambakv <command> --help`` (REPORT_HELP below; a source
checkout has more in docs/replay.md).  Bad input (missing file, malformed trace line, unknown
model, a bad config.json, a pool too small for one request) prints one line on stderr and exits
with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mambakv import __version__
from mambakv.core.errors import MambaKVError

MIB = 1 << 20
GIB = 1 << 30
#: Above this many draft tokens per step ``--num-speculative-tokens`` gets a warning: MTP and
#: EAGLE drafters propose a handful of tokens per step; every draft costs each Mamba group one
#: more block per request, and the run is still allowed (the bound is a judgement, not a limit).
PLAUSIBLE_SPECULATIVE_TOKENS = 64
#: File types ``--plot`` writes (matplotlib picks the format from the suffix).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")

REPORT_HELP = """report: line 1 is the pool (blocks x bytes per block, memory) and the settings; the table has
one row per KV-cache group: kind, layers, block size (tokens), the most blocks its tables held
at once (and MiB), and for Mamba groups the most blocks one request held (at most 2 + speculative
tokens + steps in flight); then the pool's peak, whether every block came back, requests
finished / rejected (a prompt of max_model_len tokens or more is rejected before the run), the
prefix hit rate (cached / prompt tokens, each request counted at its first admission), for a
trace the hit tokens by cause (shared first block / next turn / branch / repeat) and the tokens
whose KV was cached where no Mamba state was (state missing), preemptions, evictions, state
copies, scheduler steps, the simulated time of the step clock
(--step-ms + --ms-per-token x scheduled tokens per step), wall time and the time spent inside
the library. --json prints the same numbers as one object."""


# --------------------------------------------------------------------------- argument types
def _number(kind: type, *, low: float, low_ok: bool, high: float | None = None) -> Any:
    """An argparse ``type=`` parser: a finite `kind` (int or float) in ``[low, high]`` (``(low, high]``
    when not `low_ok`); anything else is argparse's one-line error."""
    if kind is int:
        what = f"an int >= {low:g}" if low_ok else f"an int > {low:g}"
    elif high is not None:
        what = f"a number in [{low:g}, {high:g}]"
    else:
        what = f"a finite number {'>=' if low_ok else '>'} {low:g}"

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or v < low or (v == low and not low_ok) or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


POSITIVE_INT = _number(int, low=0, low_ok=False)
COUNT = _number(int, low=0, low_ok=True)
POSITIVE = _number(float, low=0, low_ok=False)
NON_NEGATIVE = _number(float, low=0, low_ok=True)
PROBABILITY = _number(float, low=0, low_ok=True, high=1)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``mambakv: error: ...``) and exit status 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"mambakv: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def warn(message: str) -> None:
    """One line ``mambakv: warning: ...`` on stderr."""
    print(f"mambakv: warning: {' '.join(message.split())}", file=sys.stderr)


def _add_common(p: argparse.ArgumentParser, *, in_flight: int, spec_tokens: int) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="packaged model name (see `mambakv models`); "
                     "default qwen3-next-80b-a3b")
    src.add_argument("--config", default=None, metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument("--memory-gib", type=POSITIVE, default=60.0, help="KV-cache + state memory (GiB, default 60)")
    p.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=8192,
                   help="token budget per step (default 8192)")
    p.add_argument("--max-num-seqs", type=POSITIVE_INT, default=256, help="most running requests (default 256)")
    p.add_argument("--num-speculative-tokens", type=COUNT, default=spec_tokens,
                   help=f"draft tokens per decode step (default {spec_tokens})")
    p.add_argument("--acceptance-rate", type=PROBABILITY, default=0.7,
                   help="probability in [0, 1] that each next draft token is accepted, given the previous "
                        "one was (default 0.7)")
    p.add_argument("--in-flight", type=COUNT, default=in_flight,
                   help=f"async lag: steps whose results are not processed yet (default {in_flight})")
    p.add_argument("--use-eagle", action="store_true", help="EAGLE/MTP back-off of prefix hits")
    p.add_argument("--mamba-policy", choices=("eager", "lazy", "lazy-evict"), default="eager",
                   help="Mamba state blocks: eager align (default), lazy (align_lazy: working block + private "
                        "checkpoint, spares never evict), lazy-evict (spares may evict)")
    p.add_argument("--step-ms", type=NON_NEGATIVE, default=10.0, help="step clock: fixed ms per step (default 10)")
    p.add_argument("--ms-per-token", type=NON_NEGATIVE, default=0.05,
                   help="step clock: ms per scheduled token (default 0.05)")
    p.add_argument("--seed", type=COUNT, default=0,
                   help="seed of the random prompts, outputs and draft acceptance (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write a chart of blocks in use per group against the pool's capacity and the running "
                        "hit rate, per step (.png, .svg or .pdf; needs matplotlib); checked before the run")


def build_parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0].replace("``", "")  # plain text, no RST markup
    parser = _Parser(prog="mambakv", description=description)
    parser.add_argument("--version", action="version", version=f"mambakv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = dict(epilog=REPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p = sub.add_parser("replay", help="one long prefill (default 480,031 tokens): Mamba blocks per request", **run)
    _add_common(p, in_flight=2, spec_tokens=5)
    p.add_argument("--prompt-tokens", type=POSITIVE_INT, default=480_031, help="prompt length (default 480031)")
    p.add_argument("--output-tokens", type=POSITIVE_INT, default=4, help="tokens to generate (default 4)")
    p = sub.add_parser("trace", help="a Mooncake JSONL trace: hit rate, peaks, preemptions, time", **run)
    p.add_argument("path", help="trace file (one JSON object per line)")
    _add_common(p, in_flight=0, spec_tokens=0)
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="first N requests (default: all)")
    p.add_argument("--one-at-a-time", action="store_true", help="each request alone, in arrival order")
    p.add_argument("--max-output-tokens", type=POSITIVE_INT, default=None,
                   help="cap each request's output length (default: the trace's)")
    p.add_argument("--skip", type=COUNT, default=0, metavar="N", help="start at line N+1 of the trace (default 0)")
    p.add_argument("--replay", choices=("strict", "conversation"), default="strict",
                   help="strict (default): equal hash ids = equal tokens, outputs unique; conversation: as strict, "
                        "and a next turn that is long enough begins with its parent's prompt and generated tokens")
    p = sub.add_parser("chat", help="multi-turn conversations (each turn extends the previous one)", **run)
    _add_common(p, in_flight=0, spec_tokens=0)
    p.add_argument("--conversations", type=POSITIVE_INT, default=8, help="number of chats (default 8)")
    p.add_argument("--turns", type=POSITIVE_INT, default=4, help="turns per chat (default 4)")
    p.add_argument("--one-at-a-time", action="store_true", help="each turn alone, in arrival order")
    p = sub.add_parser("models", help="the packaged model configs")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


# --------------------------------------------------------------------------- output
def format_report(d: dict[str, Any]) -> str:
    """The text report of a run (REPORT_HELP explains every number)."""
    lines = [f"model {d['model']}: {d['num_blocks']:,} blocks x {d['bytes_per_block'] / MIB:.2f} MiB "
             f"({d['memory_gib']:g} GiB); budget {d['max_num_batched_tokens']} tokens/step, "
             f"{d['num_speculative_tokens']} speculative tokens, {d['in_flight']} steps in flight"]
    header = ("group", "kind", "layers", "block", "peak blocks", "peak MiB", "Mamba blocks/request")
    rows = [header]
    for i, g in enumerate(d["groups"]):
        per_req = g["peak_mamba_blocks_per_request"]
        rows.append((str(i), g["kind"], str(g["num_layers"]), str(g["block_size"]), f"{g['peak_blocks']:,}",
                     f"{g['peak_bytes'] / MIB:,.1f}", "-" if per_req is None else str(per_req)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if c == 1 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"pool peak {d['peak_blocks']:,} blocks ({d['peak_bytes'] / MIB:,.1f} MiB); "
                 f"all blocks returned: {'yes' if d['blocks_returned'] else 'NO'}")
    rejected = f", {d['rejected']:,} rejected" if d.get("rejected") else ""
    lines.append(f"requests {d['finished']:,}/{d['requests']:,} finished{rejected}; prompt {d['prompt_tokens']:,} tokens, "
                 f"cached {d['cached_tokens']:,}, hit rate {d['hit_rate']:.4f}; output {d['output_tokens']:,} tokens")
    if "hit_tokens_by_cause" in d:
        causes = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in d["hit_tokens_by_cause"].items())
        lines.append(f"replay {d['replay']} (skip {d['skip']:,}): hit tokens by cause: {causes}; "
                     f"state missing where attention hit: {d['state_missing_tokens']:,} tokens")
    lines.append(f"preemptions {d['preemptions']:,}; evictions {d['evictions']:,}; state copies {d['state_copies']:,}")
    lines.append(f"steps {d['steps']:,}; simulated {d['sim_clock_ms'] / 1e3:,.2f} s; wall {d['wall_s']:.2f} s, "
                 f"in the library {d['library_s'] * 1e3:,.1f} ms ({d['library_us_per_step']:.1f} us/step)")
    return "\n".join(lines)


def _progress(total: int, quiet: bool) -> Any:
    if quiet or total < 2 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)


def check_plot_path(path: str | None) -> None:
    """Refuse a ``--plot`` target before the run: matplotlib missing, a suffix other than
    PLOT_SUFFIXES, a directory, or a folder that does not exist or is not writable.

    Raises:
        MambaKVError: one line naming the problem.
    """
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MambaKVError("--plot needs matplotlib: pip install 'mambakv[plot]' (or pip install matplotlib)") from None
    p = Path(path)
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise MambaKVError(f"--plot {path}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
    if p.is_dir():
        raise MambaKVError(f"--plot {path}: is a directory")
    folder = p.parent
    if not folder.is_dir():
        raise MambaKVError(f"--plot {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise MambaKVError(f"--plot {path}: not writable")


def _blocks_needed(model: Any, tokens: int, args: argparse.Namespace) -> tuple[int, int] | None:
    """``(blocks, bytes per block)`` a pool needs to run one request of `tokens` tokens alone
    with the eager policy, or None for the lazy policies (their reserved region depends on
    ``--max-num-seqs``).

    ``1 (null) + attention groups x ceil((tokens + K) / block) + Mamba groups x (2 + K)`` with K
    speculative tokens: the request's KV blocks, plus a running and a checkpoint state and K
    draft states per Mamba group (steps in flight wait instead of needing more).  Measured
    against the scheduler on Qwen3-Next (block 544, 1 + 3 groups): the 480,035-token replay runs
    in 905 blocks and not in 904 (K = 5, 2 in flight), in 890 and not 889 with K = 0 and none
    in flight.
    """
    if args.mamba_policy != "eager":
        return None
    from mambakv.models import load_model, plan_pages

    plan = plan_pages(load_model(model))
    k = args.num_speculative_tokens
    blocks = (1 + len(plan.attention_groups) * -(-(tokens + k) // plan.block_size)
              + len(plan.mamba_groups) * (2 + k))
    return blocks, plan.bytes_per_block


def plot_series(result: Any) -> tuple[list[int], list[tuple[int, ...]], list[float]]:
    """Steps, blocks per group and running hit rate of a run, through its last step.

    The scheduler samples after allocations only; a decode tail that allocates nothing, and the
    frees at the end, would be missing.  The last sample is held until the run's last step,
    where the tables' usage at the end of the run (0 when every request finished) closes it.
    """
    from mambakv.sim.metrics import group_usage

    m = result.metrics
    steps = [s[0] for s in m.series]
    usage = [tuple(s[2]) for s in m.series]
    hits = [s[3] for s in m.series]
    end_usage = tuple(group_usage(result.coord))
    if not steps or steps[-1] < m.steps or usage[-1] != end_usage:
        steps.append(max(m.steps, steps[-1] if steps else 0))
        usage.append(end_usage)
        hits.append(m.hit_rate)
    return steps, usage, hits


def merge_identical_groups(kinds: list[str], usage: list[tuple[int, ...]]) -> list[tuple[list[int], str]]:
    """Groups whose usage is equal at every sample, as ``(group ids, kind)`` bands in group order.

    Qwen3-Next's three Mamba groups hold the same number of blocks at every step: drawn apart
    they cover each other; merged, one band of 3x the height says so.
    """
    bands: dict[tuple, tuple[list[int], str]] = {}
    for gid, kind in enumerate(kinds):
        key = (kind, tuple(u[gid] for u in usage))
        bands.setdefault(key, ([], kind))[0].append(gid)
    return list(bands.values())


def write_plot(result: Any, path: str) -> None:
    """A chart for sizing memory: blocks in use (stacked by group, against the pool's capacity,
    with GiB on the right) above the running prefix-cache hit rate, per scheduler step; the
    title names the model, the pool and the settings.  The format follows the suffix of
    `path` (PLOT_SUFFIXES)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, m = result.to_dict(), result.metrics
    pool = result.coord.block_pool
    steps, usage, hits = plot_series(result)
    per_block = d["bytes_per_block"]
    gib_total = d.get("memory_gib", round(pool.num_blocks * per_block / GIB, 2))  # a bare run_workload: no settings
    fig, (ax, axh) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), height_ratios=(3, 1.3))
    bands = merge_identical_groups([g.kind for g in m.groups], usage)
    ys, labels, colors = [], [], [f"C{i}" for i in range(len(bands))]
    reserved = pool.num_reserved_blocks  # lazy scratch rows: taken from the pool, in no table
    if reserved:
        ys.append([reserved] * len(steps))
        labels.append(f"reserved scratch region (lazy): {reserved:,}")
        colors.insert(0, "lightgray")
    for gids, kind in bands:
        ys.append([sum(u[g] for g in gids) for u in usage])
        one = max(u[gids[0]] for u in usage)
        if len(gids) == 1:
            labels.append(f"group {gids[0]} ({kind}): peak {one:,}")
        else:
            labels.append(f"groups {', '.join(map(str, gids))} ({kind}, identical): peak {len(gids)} x {one:,}")
    ax.stackplot(steps, *ys, labels=labels, colors=colors, step="post", alpha=0.85)
    total = [reserved + sum(u) for u in usage]
    peak = max(total, default=0)
    at = steps[total.index(peak)] if total else 0
    ax.plot([at], [peak], marker="v", color="black", linestyle="none",
            label=f"peak: {peak:,} blocks = {peak * per_block / GIB:,.2f} GiB (step {at:,})")
    capacity = pool.num_blocks - 1
    what = f"pool capacity: {capacity:,} blocks ({gib_total:g} GiB)"
    if capacity <= 4 * peak:  # the whole pool on the chart
        ax.axhline(capacity, color="crimson", linestyle="--", linewidth=1.2, label=what)
        top = max(capacity, peak) * 1.05
    else:  # zoom on the data: at 60 GiB a small trace would be a flat line at the bottom
        ax.plot([], [], color="crimson", linestyle="--", linewidth=1.2,
                label=f"{what},\n{capacity / max(peak, 1):,.0f}x the peak: above the chart")
        top = peak * 1.15
    ax.set_ylim(0, max(top, 1))
    ax.set_ylabel("blocks held by requests (stacked)")  # cached free blocks are not counted
    gib = ax.secondary_yaxis("right", functions=(lambda b: b * per_block / GIB, lambda g: g * GIB / per_block))
    gib.set_ylabel("GiB")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize="small", frameon=False)

    axh.step(steps, hits, where="post", color="black")
    top = max(hits, default=0.0)
    axh.set_ylim(0, top * 1.25 if top > 0 else 0.01)
    axh.set_ylabel("hit rate")
    axh.set_xlabel("scheduler step")
    axh.grid(alpha=0.3)
    axh.text(1.02, 0.5, f"final hit rate {d['hit_rate']:.4f}\n{d['cached_tokens']:,} of {d['prompt_tokens']:,}\n"
             f"prompt tokens cached", transform=axh.transAxes, va="center", fontsize="small")

    rejected = f", {d['rejected']:,} rejected" if d.get("rejected") else ""
    settings = ", ".join(f"{v} {k}" for k, v in (("tokens/step", d.get("max_num_batched_tokens")),
                                                  ("speculative tokens", d.get("num_speculative_tokens")),
                                                  ("in flight", d.get("in_flight"))) if v is not None)
    policy = f"Mamba policy {d['mamba_policy']}; " if "mamba_policy" in d else ""
    fig.suptitle(f"{d.get('model', 'model')} ({d.get('workload', 'run')}): {d['num_blocks']:,} blocks x "
                 f"{per_block / MIB:.2f} MiB = {gib_total:g} GiB\n{settings}{'; ' if settings else ''}{policy}"
                 f"{d['finished']:,}/{d['requests']:,} requests finished{rejected}, "
                 f"{d['preemptions']:,} preemptions", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- commands
def _run(args: argparse.Namespace) -> dict[str, Any]:
    from mambakv.sim import DEFAULT_MODEL, conversations, load_trace, run_conversations, run_replay, run_trace
    from mambakv.sim.results import BudgetTooSmallError
    from mambakv.sim.runner import DEFAULT_MAX_MODEL_LEN

    check_plot_path(args.plot)
    if args.num_speculative_tokens > PLAUSIBLE_SPECULATIVE_TOKENS:
        warn(f"--num-speculative-tokens {args.num_speculative_tokens} is implausibly large: MTP / EAGLE drafters "
             f"propose a few tokens per step (usually 1-5), and each draft costs every Mamba group one more "
             f"block per request ({2 + args.num_speculative_tokens} each here)")
    model = args.config or args.model or DEFAULT_MODEL
    common = dict(max_num_batched_tokens=args.max_num_batched_tokens, num_speculative_tokens=args.num_speculative_tokens,
                  in_flight=args.in_flight, memory_gib=args.memory_gib, use_eagle=args.use_eagle, seed=args.seed,
                  acceptance_rate=args.acceptance_rate, step_ms=args.step_ms, ms_per_token=args.ms_per_token,
                  mamba_policy=args.mamba_policy)
    bar = None
    specs: Any = None
    try:
        if args.command == "replay":
            result = run_replay(model, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                max_num_seqs=args.max_num_seqs, **common)
        else:
            if args.command == "trace":
                specs = load_trace(args.path, limit=args.limit, max_output_tokens=args.max_output_tokens,
                                   skip=args.skip)
            else:
                specs = conversations(args.conversations, args.turns, seed=args.seed)
            bar = _progress(len(specs), args.quiet)
            on_finish = (lambda _r: bar.update(1)) if bar is not None else None
            if args.command == "trace":
                result = run_trace(args.path, model, specs=specs, limit=args.limit, max_num_seqs=args.max_num_seqs,
                                   one_at_a_time=args.one_at_a_time, on_finish=on_finish, replay=args.replay,
                                   skip=args.skip, **common)
            else:
                result = run_conversations(model, num_conversations=args.conversations, turns=args.turns, specs=specs,
                                           max_num_seqs=args.max_num_seqs, one_at_a_time=args.one_at_a_time,
                                           on_finish=on_finish, **common)
    except BudgetTooSmallError as e:
        # the longest request that runs (longer prompts are rejected), up to the length cap
        lengths = ([args.prompt_tokens + args.output_tokens] if specs is None else
                   [s.num_prompt_tokens + s.output_len for s in specs if s.num_prompt_tokens < DEFAULT_MAX_MODEL_LEN])
        longest = min(max(lengths), DEFAULT_MAX_MODEL_LEN)
        need = _blocks_needed(model, longest, args)
        if need is None:
            raise
        blocks, per_block = need
        gib = math.ceil(blocks * per_block / GIB * 100) / 100
        raise BudgetTooSmallError(f"{e}; the longest request ({longest:,} tokens) needs about {blocks:,} blocks "
                                  f"of {per_block / MIB:.2f} MiB: --memory-gib {gib:.2f} or more") from None
    finally:
        if bar is not None:
            bar.close()
    d = result.to_dict()
    if d["rejected"]:
        warn(f"{d['rejected']:,} of {d['requests']:,} requests rejected: a prompt of max_model_len "
             f"{d['max_model_len']:,} tokens or more leaves no room for an output token")
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return d


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mambakv``; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, one line already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "models":
            from mambakv.models import format_models_table, list_models, model_info

            if args.json:
                return _print(json.dumps([model_info(n).__dict__ for n in list_models()], indent=1))
            return _print(format_models_table())
        d = _run(args)
    except (MambaKVError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"mambakv: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mambakv: interrupted", file=sys.stderr)
        return 130
    return _print(json.dumps(d, indent=1) if args.json else format_report(d))


def _print(text: str) -> int:
    """Print `text` on stdout; a reader that went away (``mambakv replay | head -5``) ends the
    command quietly with status 141 (128 + SIGPIPE, what a shell reports for ``yes | head``)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        try:  # Python flushes stdout again at exit: point it at /dev/null so that cannot fail
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
