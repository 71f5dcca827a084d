"""Metrics of a simulated run: peaks per group, prefix hits, preemptions, time in the library."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.arena import ArenaBytes
from mambakv.groups import MambaManager, SingleTypeKVCacheManager


def measure_timer_overhead(samples: int = 2000) -> float:
    """Seconds one timed library call adds by its own timing (two ``perf_counter`` calls and
    one accumulation), the median of `samples` empty timed regions."""
    now = time.perf_counter
    acc = 0.0
    costs = []
    for _ in range(samples):
        t0 = now()
        t = now()
        acc += now() - t
        costs.append(now() - t0)
    costs.sort()
    return costs[len(costs) // 2]


__all__ = ["GroupMetrics", "SimMetrics", "group_kind", "group_usage"]


def group_kind(manager: SingleTypeKVCacheManager) -> str:
    """``"full_attention"``, ``"sliding_window"`` or ``"mamba"``: the manager's GroupKind."""
    return manager.kind.value


def group_usage(coord: KVCacheCoordinator) -> list[int]:
    """Distinct non-null blocks held by the tables of each group (shared blocks count once).

    A group alone on its pool (the decoupled layout's attention group) is the pool's used
    count, O(1); otherwise the distinct ids of its tables from each one's retirement watermark
    (every slot below it is null), O(live table entries)."""
    users: dict[int, int] = {}
    for m in coord.managers:
        users[m.block_pool.pool_id] = users.get(m.block_pool.pool_id, 0) + 1
    out = []
    for m in coord.managers:
        pool = m.block_pool
        if users[pool.pool_id] == 1:
            out.append(pool.num_blocks - 1 - pool.get_num_free_blocks() - pool.num_reserved_blocks)
            continue
        ids: set[int] = set()
        for rid in m.req_to_blocks:
            t = m.get_table(rid)
            if t is not None:
                ids.update(b.block_id for b in t.blocks[t.retired_below:])
        ids.discard(0)
        out.append(len(ids))
    return out


@dataclass
class GroupMetrics:
    """One KV-cache group.

    Attributes:
        kind: ``full_attention`` / ``sliding_window`` / ``mamba``.
        block_size: tokens per block.
        num_layers: layers in the group.
        block_bytes: bytes one block holds for this group: ``page_size_bytes x num_layers``.
        peak_blocks: most blocks the group's tables held at once (after an allocation).
        peak_mamba_blocks_per_request: Mamba only: most non-null blocks one request's table
            held at once (the bound is ``2 + nspec + steps in flight``); None otherwise.
    """

    kind: str
    block_size: int
    num_layers: int
    block_bytes: int
    peak_blocks: int = 0
    peak_mamba_blocks_per_request: int | None = None

    @property
    def peak_bytes(self) -> int:
        return self.peak_blocks * self.block_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size, "num_layers": self.num_layers,
                "block_bytes": self.block_bytes, "peak_blocks": self.peak_blocks,
                "peak_bytes": self.peak_bytes,
                "peak_mamba_blocks_per_request": self.peak_mamba_blocks_per_request}


@dataclass
class SimMetrics:
    """Counters of one scheduler run (tokens, blocks, seconds).

    ``prompt_tokens`` / ``cached_tokens`` count each request once, at its first admission
    (a recompute after preemption is not counted again); ``hit_rate = cached / prompt``.
    ``state_missing_tokens``: at each first admission, the attention-only hit
    (``get_shared_prefix_length``) minus the hit, summed (0 unless Mamba groups align).
    Time (``time.perf_counter``): ``library_s`` inside coordinator calls and ``Request``
    appends, each call timed, or a run of calls with no scheduler work between them timed as
    one region (a result's append, ``retire`` and ``free``; the plan drains): ``library_calls``
    counts the timed regions, and ``library_net_s`` subtracts the timers' own cost, measured
    once per run as ``timer_overhead_s`` per region; ``step_s`` the
    whole of every scheduler step, timed once per step (the same scope as an engine's
    per-step loop: scheduling, library calls, result processing), minus ``hash_s``, the
    prompts' block hashing at admission (done before the lookup, apart from both figures);
    ``pool_s`` inside ``MambaStatePool`` copies.  ``series`` samples ``(step, clock_ms, blocks per group,
    running hit rate)`` whenever an allocation may have changed the usage; in the decoupled layout
    ``byte_series`` samples the budget's bytes in pages, states and idle slot tails (fragmentation)
    at the same times.
    """

    groups: list[GroupMetrics]
    steps: int = 0
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    state_missing_tokens: int = 0
    output_tokens: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    #: most bytes the pools' used blocks held at once: each pool's used count x its block's bytes
    #: (the decoupled layout's pages and states differ in size; unified: ``peak_blocks x`` one size)
    peak_bytes: int = 0
    #: bytes of one block of each of the coordinator's pools, in ``coord.pools`` order
    pool_block_bytes: tuple[int, ...] = ()
    peak_running: int = 0
    copies: int = 0
    library_s: float = 0.0
    library_calls: int = 0
    timer_overhead_s: float = field(default_factory=lambda: measure_timer_overhead())
    step_s: float = 0.0
    hash_s: float = 0.0
    pool_s: float = 0.0
    wall_s: float = 0.0
    clock_ms: float = 0.0
    #: host-tier loads started and their simulated time at ``h2d_gbps`` (ms, summed)
    host_loads: int = 0
    host_load_ms: float = 0.0
    series: list[tuple[int, float, tuple[int, ...], float]] = field(default_factory=list)
    #: decoupled layout: ``(step, clock_ms, page bytes, state bytes, idle bytes)`` with ``series``
    byte_series: list[tuple[int, float, int, int, int]] = field(default_factory=list)
    peak_state_bytes: int = 0
    peak_idle_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def library_net_s(self) -> float:
        """``library_s`` less the timers' own cost (``library_calls x timer_overhead_s``)."""
        return max(0.0, self.library_s - self.library_calls * self.timer_overhead_s)

    @property
    def step_net_s(self) -> float:
        """``step_s`` less the prompt hashing inside it (``hash_s``)."""
        return max(0.0, self.step_s - self.hash_s)

    def observe_usage(self, coord: KVCacheCoordinator) -> None:
        """Update per-group and pool peaks from the current tables (call after allocations)."""
        usage = group_usage(coord)
        for g, n in zip(self.groups, usage):
            if n > g.peak_blocks:
                g.peak_blocks = n
        used = used_bytes = 0
        for pool, block_bytes in zip(coord.pools, self.pool_block_bytes):
            n = pool.num_blocks - 1 - pool.get_num_free_blocks() - pool.num_reserved_blocks
            used += n
            used_bytes += n * block_bytes
        if used > self.peak_blocks:
            self.peak_blocks = used
        if used_bytes > self.peak_bytes:
            self.peak_bytes = used_bytes
        if coord.arena is not None:
            self.observe_bytes(coord.arena.bytes)
        self.series.append((self.steps, self.clock_ms, tuple(usage), self.hit_rate))

    def observe_bytes(self, b: ArenaBytes) -> None:
        """Decoupled layout: where the budget is now (pages, states, fragmentation)."""
        self.byte_series.append((self.steps, self.clock_ms, b.pages, b.states, b.idle))
        if b.states > self.peak_state_bytes:
            self.peak_state_bytes = b.states
        if b.idle > self.peak_idle_bytes:
            self.peak_idle_bytes = b.idle

    def observe_mamba(self, manager: MambaManager, request_id: str) -> None:
        g = self.groups[manager.kv_cache_group_id]
        held = manager.num_held_blocks(request_id)
        if g.peak_mamba_blocks_per_request is None or held > g.peak_mamba_blocks_per_request:
            g.peak_mamba_blocks_per_request = held

    @classmethod
    def for_coordinator(cls, coord: KVCacheCoordinator) -> SimMetrics:
        groups = []
        for m, g in zip(coord.managers, coord.kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            groups.append(GroupMetrics(group_kind(m), spec.block_size, len(g.layer_names),
                                       spec.page_size_bytes * len(g.layer_names),
                                       peak_mamba_blocks_per_request=0 if isinstance(m, MambaManager) else None))
        pool_bytes: dict[int, int] = {}
        for m, gm in zip(coord.managers, groups):
            pool_bytes[m.block_pool.pool_id] = max(pool_bytes.get(m.block_pool.pool_id, 0), gm.block_bytes)
        return cls(groups, pool_block_bytes=tuple(pool_bytes.get(p.pool_id, 0) for p in coord.pools))
