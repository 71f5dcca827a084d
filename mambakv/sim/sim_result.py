"""SimResult: a finished simulator run (coordinator, metrics, settings) and its ``to_dict()``,
the record ``mambakv ... --json`` prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mambakv.coordinator import KVCacheCoordinator
from mambakv.sim.metrics import SimMetrics

__all__ = ["SimResult"]


@dataclass
class SimResult:
    """A finished run: the coordinator (for inspection), the scheduler's metrics, the settings.

    ``rejected``: requests refused before the run because they cannot fit ``max_model_len``
    (see :func:`run_workload`); ``to_dict()["requests"]`` counts them, ``"finished"`` does not.
    ``extra``: more results of the workload (a trace's ``hit_tokens_by_cause``), last in ``to_dict()``.
    ``build_s``: seconds spent building the coordinator (its pools); ``to_dict()["wall_s"]``
    includes them, ``"build_s"`` gives them apart.
    """

    coord: KVCacheCoordinator
    metrics: SimMetrics
    settings: dict[str, Any] = field(default_factory=dict)
    rejected: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    build_s: float = 0.0

    @property
    def blocks_returned(self) -> bool:
        """Every block is back in the free queue (cached ones included), except the lazy
        scratch regions, which are reserved for good."""
        return all(p.get_num_free_blocks() == p.num_blocks - 1 - p.num_reserved_blocks for p in self.coord.pools)

    def _arena_dict(self) -> dict[str, Any]:
        """Decoupled layout only: the budget's geometry and where its bytes went."""
        arena, m = self.coord.arena, self.metrics
        if arena is None:
            return {}
        g, b = arena.geometry, arena.bytes
        return {"arena": {
            "superblocks": g.num_superblocks, "pages_per_superblock": g.pages_per_superblock,
            "page_bytes": g.page_bytes, "state_bytes": g.state_bytes, "superblock_bytes": g.superblock_bytes,
            "conversions": arena.num_conversions,
            "final_bytes": {"pages": b.pages, "states": b.states, "idle": b.idle, "free": b.free},
            "peak_state_bytes": m.peak_state_bytes, "peak_idle_bytes": m.peak_idle_bytes,
            "mean_state_bytes": _mean([x[3] for x in m.byte_series]),
            "mean_idle_bytes": _mean([x[4] for x in m.byte_series]),
            "state_evictions": self.coord.state_block_pool.num_evictions}}

    def _eviction_dict(self) -> dict[str, Any]:
        """Decoupled layout with eviction units: what the policy did, by class, and (reuse) the
        learned hazard table."""
        units = self.coord.units
        if units is None:
            return {}
        out = {"policy": units.policy.name, "ghosts": len(units.policy.ghost), **units.stats.to_json()}
        hazard = getattr(units.policy, "hazard", None)
        if hazard is not None:
            out["warm_start"] = bool(getattr(units.policy, "warm_start", False))
            out["hazard_table"] = hazard.to_json()
        return {"eviction": out}

    def _host_dict(self) -> dict[str, Any]:
        """With a host tier: hits by tier, bytes moved, and the tier's own counts."""
        host, m = self.coord.host, self.metrics
        if host is None:
            return {}
        host_hits = self.coord.prefix_cache_stats.host_hits
        prompt = m.prompt_tokens or 1
        s = host.stats
        g = host.geometry
        return {"hit_rate_gpu": round((m.cached_tokens - host_hits) / prompt, 6),
                "hit_rate_host": round(host_hits / prompt, 6),
                "bytes_h2d": s.bytes_h2d, "bytes_d2h": s.bytes_d2h,
                "host": {"write": host.write.value, "superblocks": g.num_superblocks, "total_bytes": g.total_bytes,
                         "hit_tokens": host_hits, "loads": s.loads, "loaded_tokens": s.loaded_tokens,
                         "aborted_loads": s.aborted_loads, "stores": s.stores, "stored_pages": s.stored_pages,
                         "stored_states": s.stored_states, "skipped_stores": s.skipped_stores, "dropped_stores": s.dropped_stores,
                         "bytes_h2d_per_hit_token": round(s.bytes_h2d / host_hits, 1) if host_hits else None,
                         "load_ms": round(m.host_load_ms, 3), "evictions": host.units.stats.to_json()}}

    def to_dict(self) -> dict[str, Any]:
        m, coord = self.metrics, self.coord
        pool = coord.block_pool
        stats = coord.prefix_cache_stats
        groups = [g.as_dict() for g in m.groups]
        bytes_per_block = max(g["block_bytes"] for g in groups)
        return {
            **self.settings,
            "num_blocks": pool.num_blocks,
            "bytes_per_block": bytes_per_block,
            "requests": m.requests + self.rejected,
            "finished": m.finished,
            "rejected": self.rejected,
            "max_model_len": coord.max_model_len,
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "hit_rate": round(m.hit_rate, 6),
            **self._host_dict(),
            "state_missing_tokens": m.state_missing_tokens,
            "prefix_queries": stats.queries,
            "prefix_hits": stats.hits,
            "output_tokens": m.output_tokens,
            "preemptions": m.preemptions,
            "evictions": pool.num_evictions,
            "peak_blocks": m.peak_blocks,
            "peak_bytes": m.peak_bytes,
            "peak_running": m.peak_running,
            "peak_mamba_blocks_per_request": {
                str(i): g["peak_mamba_blocks_per_request"] for i, g in enumerate(groups)
                if g["peak_mamba_blocks_per_request"] is not None},
            "groups": groups,
            "steps": m.steps,
            "scheduled_tokens": m.scheduled_tokens,
            "state_copies": m.copies,
            "sim_clock_ms": round(m.clock_ms, 3),
            "wall_s": round(m.wall_s + self.build_s, 4),
            "wall_ms": round((m.wall_s + self.build_s) * 1e3, 3),
            "build_s": round(self.build_s, 4),
            "library_s": round(m.library_s, 4),
            "library_ms": round(m.library_s * 1e3, 3),
            "library_us_per_step": round(m.library_s * 1e6 / m.steps, 2) if m.steps else 0.0,
            "library_calls": m.library_calls,
            "library_net_us_per_step": round(m.library_net_s * 1e6 / m.steps, 2) if m.steps else 0.0,
            "step_us": round(m.step_net_s * 1e6 / m.steps, 2) if m.steps else 0.0,
            "hash_ms": round(m.hash_s * 1e3, 3),
            "blocks_returned": self.blocks_returned,
            **self._arena_dict(),
            **self._eviction_dict(),
            **self.extra,
        }


def _mean(values: Sequence[int]) -> int:
    return round(sum(values) / len(values)) if values else 0
