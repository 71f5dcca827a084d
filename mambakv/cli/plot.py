"""``--plot``: a chart of a run for sizing memory, blocks in use per KV-cache group (stacked,
against the pool's capacity, GiB on the right) above the running prefix-cache hit rate, per
scheduler step.  Needs matplotlib (``pip install 'mambakv[plot]'``), imported only here and
only when a chart is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mambakv.cli.args import check_output_path
from mambakv.cli.report import GIB, MIB
from mambakv.core.errors import MambaKVError

if TYPE_CHECKING:
    from mambakv.sim.runner import SimResult

__all__ = ["PLOT_SUFFIXES", "budget_series", "check_plot_path", "merge_identical_groups", "plot_budget", "plot_series",
           "write_fleet_plot", "write_plot"]

#: File types ``--plot`` writes (matplotlib picks the format from the suffix).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_plot_path(path: str | None) -> None:
    """Refuse a ``--plot`` target before the run: matplotlib missing, a suffix other than
    PLOT_SUFFIXES, then :func:`~mambakv.cli.args.check_output_path` (a directory, a folder that
    does not exist, a place where a test write fails: not writable, ``/proc``).

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
    check_output_path(path, "--plot")


def plot_series(result: SimResult) -> tuple[list[int], list[tuple[int, ...]], list[float]]:
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


def budget_series(result: SimResult) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Decoupled layout: steps and the budget's ``(page, state, idle)`` bytes, through the run's
    last step (both lists empty in the unified layout).

    ``byte_series`` is sampled with ``series``, after allocations only: a decode tail that
    allocates nothing would end the budget before the last step (the default replay: step 60 of
    62) while :func:`plot_series` runs to it.  As there, the last sample is held until the
    run's last step, where the arena's bytes at the end of the run (``arena.final_bytes``)
    close it, so the budget and the "held by requests" line cover the same steps.
    """
    m, arena = result.metrics, result.coord.arena
    steps = [s[0] for s in m.byte_series]
    parts = [(s[2], s[3], s[4]) for s in m.byte_series]
    if arena is None:
        return steps, parts
    b = arena.bytes
    end = (b.pages, b.states, b.idle)
    if not steps or steps[-1] < m.steps or parts[-1] != end:
        steps.append(max(m.steps, steps[-1] if steps else 0))
        parts.append(end)
    return steps, parts


def merge_identical_groups(kinds: list[str], usage: list[tuple[int, ...]]) -> list[tuple[list[int], str]]:
    """Groups whose usage is equal at every sample, as ``(group ids, kind)`` bands in group order.

    Qwen3-Next's three Mamba groups hold the same number of blocks at every step: drawn apart
    they cover each other; merged, one band of 3x the height says so.
    """
    bands: dict[tuple[str, tuple[int, ...]], tuple[list[int], str]] = {}
    for gid, kind in enumerate(kinds):
        key = (kind, tuple(u[gid] for u in usage))
        bands.setdefault(key, ([], kind))[0].append(gid)
    return list(bands.values())


def plot_budget(ax: Any, budget: tuple[list[int], list[tuple[int, int, int]]], steps: list[int],
                held: list[float]) -> None:
    """Decoupled layout: the byte budget in attention pages, states and idle state-superblock
    tails (fragmentation), stacked in GiB per step (cached and held alike; `budget` is
    :func:`budget_series`), and the GiB the requests' tables hold (a line, at `steps`)."""
    at, parts = budget
    pages, states, idle = ([s[i] / GIB for s in parts] for i in (0, 1, 2))
    ax.stackplot(at, pages, states, idle, step="post", alpha=0.85, colors=("C0", "C1", "lightgray"),
                 labels=(f"attention pages (end {pages[-1]:,.1f} GiB)", f"Mamba states (peak {max(states):,.1f} GiB)",
                         f"idle state tails = fragmentation (peak {max(idle):,.2f} GiB)"))
    ax.step(steps, held, where="post", color="black", linewidth=1,
            label=f"held by requests (peak {max(held, default=0):,.2f} GiB)")
    ax.set_ylabel("budget (GiB)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize="small", frameon=False)


def write_plot(result: SimResult, path: str) -> None:
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
    if m.byte_series:  # decoupled: blocks of two sizes; the top panel is the byte budget instead
        arena = d["arena"]
        unit = [arena["page_bytes"] if g.kind != "mamba" else arena["superblock_bytes"] for g in m.groups]
        held = [sum(n * b for n, b in zip(u, unit)) / GIB for u in usage]
        plot_budget(ax, budget_series(result), steps, held)
        title = (f"{arena['superblocks']:,} superblocks x {arena['superblock_bytes'] / MIB:.2f} MiB "
                 f"(k = {arena['pages_per_superblock']} pages of {d.get('page_tokens')} tokens)")
    else:
        plot_blocks(ax, result, steps, usage, per_block, gib_total)
        title = f"{d['num_blocks']:,} blocks x {per_block / MIB:.2f} MiB"
    plot_hits(axh, steps, hits, d)
    rejected = f", {d['rejected']:,} rejected" if d.get("rejected") else ""
    settings = ", ".join(f"{v} {k}" for k, v in (("tokens/step", d.get("max_num_batched_tokens")),
                                                  ("speculative tokens", d.get("num_speculative_tokens")),
                                                  ("in flight", d.get("in_flight"))) if v is not None)
    policy = f"Mamba policy {d['mamba_policy']}; " if "mamba_policy" in d else ""
    fig.suptitle(f"{d.get('model', 'model')} ({d.get('workload', 'run')}): {title} = {gib_total:g} GiB\n"
                 f"{settings}{'; ' if settings else ''}{policy}"
                 f"{d['finished']:,}/{d['requests']:,} requests finished{rejected}, "
                 f"{d['preemptions']:,} preemptions", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_blocks(ax: Any, result: SimResult, steps: list[int], usage: list[tuple[int, ...]], per_block: int,
                gib_total: float) -> None:
    """Unified layout: blocks held per group, stacked, against the pool's capacity."""
    m, pool = result.metrics, result.coord.block_pool
    bands = merge_identical_groups([g.kind for g in m.groups], usage)
    ys, labels, colors = [], [], [f"C{i}" for i in range(len(bands))]
    reserved = pool.num_reserved_blocks  # blocks out of circulation, in no table (none in the unified layout)
    if reserved:
        ys.append([reserved] * len(steps))
        labels.append(f"reserved blocks: {reserved:,}")
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


def plot_hits(axh: Any, steps: list[int], hits: list[float], d: dict[str, Any]) -> None:
    """The running prefix-cache hit rate."""
    axh.step(steps, hits, where="post", color="black")
    top = max(hits, default=0.0)
    axh.set_ylim(0, top * 1.25 if top > 0 else 0.01)
    axh.set_ylabel("hit rate")
    axh.set_xlabel("scheduler step")
    axh.grid(alpha=0.3)
    axh.text(1.02, 0.5, f"final hit rate {d['hit_rate']:.4f}\n{d['cached_tokens']:,} of {d['prompt_tokens']:,}\n"
             f"prompt tokens cached", transform=axh.transAxes, va="center", fontsize="small")


def write_fleet_plot(d: dict[str, Any], path: str) -> None:
    """Bars per instance: share of scheduled tokens and hit rate (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = d["per_instance"]
    x = [p["instance"] for p in per]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.8 * len(x) + 2), 3.5))
    w = 0.4
    ax.bar([i - w / 2 for i in x], [p["scheduled_share"] for p in per], w, label="share of scheduled tokens")
    ax.bar([i + w / 2 for i in x], [p["hit_rate"] for p in per], w, label="hit rate")
    ax.axhline(1 / len(x), color="grey", linestyle=":", linewidth=1, label="even share")
    ax.set_xticks(x)
    ax.set_xlabel("instance")
    ax.set_ylim(0, 1.35 * max([1 / len(x)] + [max(p["scheduled_share"], p["hit_rate"]) for p in per]))
    ax.set_title(f"{d['instances']} instances, router {d['router']}: fleet hit rate {d['hit_rate']:.4f}")
    ax.legend(fontsize="small", loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
