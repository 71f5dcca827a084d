"""The result of a fleet run (:mod:`mambakv.sim.fleet`): fleet and per-instance hit rates,
queueing delays, shares of scheduled tokens, and its ``--plot`` chart."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mambakv.sim.fleet import Fleet

__all__ = ["FleetResult", "percentile", "write_fleet_plot"]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the ``ceil(q/100 x n)``-th smallest value (0.0 for none);
    p90 of [0, 34.4] is 34.4."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@dataclass
class FleetResult:
    """A finished fleet run; ``to_dict()`` is what ``mambakv fleet --json`` prints."""

    fleet: Fleet
    settings: dict[str, Any] = field(default_factory=dict)
    rejected: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        insts = self.fleet.instances
        ms = [inst.sched.metrics for inst in insts]
        prompt = sum(m.prompt_tokens for m in ms)
        cached = sum(m.cached_tokens for m in ms)
        scheduled = sum(m.scheduled_tokens for m in ms)
        delays = [d for inst in insts for d in inst.delays_ms]
        per = []
        for inst, m in zip(insts, ms):
            per.append({
                "instance": inst.index, "requests": inst.routed, "finished": m.finished,
                "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens, "hit_rate": round(m.hit_rate, 6),
                "preemptions": m.preemptions, "peak_running": m.peak_running, "peak_waiting": inst.peak_waiting,
                "scheduled_tokens": m.scheduled_tokens,
                "scheduled_share": round(m.scheduled_tokens / scheduled, 6) if scheduled else 0.0,
                "queue_delay_ms_mean": round(sum(inst.delays_ms) / len(inst.delays_ms), 3) if inst.delays_ms else 0.0,
                "steps": m.steps, "sim_clock_ms": round(m.clock_ms, 3),
                "evictions": inst.sched.coord.block_pool.num_evictions,
            })
        return {
            **self.settings,
            "requests": sum(m.requests for m in ms) + self.rejected,
            "finished": sum(m.finished for m in ms),
            "rejected": self.rejected,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
            "preemptions": sum(m.preemptions for m in ms),
            "queue_delay_ms_mean": round(sum(delays) / len(delays), 3) if delays else 0.0,
            "queue_delay_ms_p90": round(percentile(delays, 90), 3),
            "scheduled_tokens": scheduled,
            "max_scheduled_share": max(p["scheduled_share"] for p in per),
            "sim_clock_ms": round(max(m.clock_ms for m in ms), 3),
            "wall_s": round(self.fleet.wall_s, 3),
            "per_instance": per,
            **self.extra,
        }


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
