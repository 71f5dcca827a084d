"""Runs of the reference scheduler on a model's KV-cache config: replay, trace, conversations.

Each ``run_*`` function builds a :class:`KVCacheCoordinator` for a model (a packaged name such as
``"qwen3-next-80b-a3b"`` or a ``config.json`` path) over ``memory_gib`` GiB, drives it with
:class:`~mambakv.sim.scheduler.Scheduler`, and returns a :class:`SimResult` whose ``to_dict()``
is what ``mambakv ... --json`` prints (:mod:`mambakv.sim.sim_result`, re-exported here).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mambakv.coordinator import KVCacheCoordinator
from mambakv.core.errors import InvalidSpecError, InvalidTokenCountError
from mambakv.core.eviction import EvictionPolicy, make_eviction_policy
from mambakv.core.hazard import HazardTable
from mambakv.core.host_tier import HostTierSpec
from mambakv.core.spec import KVCacheConfig, MambaSpec
from mambakv.models import build_kv_cache_config, load_model
from mambakv.models.kv_config import DEFAULT_PAGE_TOKENS, plan_pages
from mambakv.sim.causes import HitCauses
from mambakv.sim.conversation import REPLAY_MODES, chain_hooks, oracle_retention, prepare_replay
from mambakv.sim.scheduler import Scheduler, SimRequest
from mambakv.sim.sim_result import SimResult
from mambakv.sim.workloads import RequestSpec, conversations, load_trace, long_prefill

__all__ = ["DEFAULT_MODEL", "GIB", "SimResult", "build_coordinator", "model_max_len", "run_conversations",
           "run_replay", "run_trace", "run_workload"]

DEFAULT_MODEL = "qwen3-next-80b-a3b"
GIB = 1 << 30
#: Largest request the coordinator accepts (tokens) when nothing else says: the replay and chat
#: workloads, and a trace on a model whose config has no context length (``mamba_ssm``).
DEFAULT_MAX_MODEL_LEN = 1 << 21
#: policy name -> (``MambaSpec.decode_checkpoints``, spares may evict a cached block). The first
#: four are ``--decode-checkpoints`` values (``latest-evict``: a benchmark knob, spares may
#: evict); ``eager`` / ``lazy`` / ``lazy-evict`` are the 0.x ``--mamba-policy`` names, aliases.
MAMBA_POLICIES = {"none": ("none", False), "every": ("every", False), "latest": ("latest", False),
                  "latest-evict": ("latest", True),
                  "eager": ("every", False), "lazy": ("latest", False), "lazy-evict": ("latest", True)}
#: Most blocks a simulated pool may have. Measured on a 2-core machine: a 1,000,000-block
#: coordinator takes 0.75 s and ~100 MiB of host memory to build, so this bound is ~8 s and
#: ~1 GiB; it is far above real budgets (8 x 141 GiB of Jamba blocks of 1.25 MiB is ~0.9 M)
#: and stops ``--memory-gib 1e30`` from allocating without end.
MAX_NUM_BLOCKS = 10_000_000


def build_coordinator(model: str | Path = DEFAULT_MODEL, memory_gib: float = 60.0, *,
                      num_speculative_tokens: int = 0, use_eagle: bool = False, enable_caching: bool = True,
                      num_blocks: int | None = None, mamba_mode: str = "align",
                      max_model_len: int = DEFAULT_MAX_MODEL_LEN, mamba_policy: str | None = None,
                      max_num_seqs: int = 256, layout: str = "unified",
                      page_tokens: int = DEFAULT_PAGE_TOKENS,
                      placement: Sequence[str] | None = None, eviction: str | None = None,
                      hazard_table: str | Path | None = None, host_memory_gib: float | None = None,
                      host_write: str = "through", host_eviction: str | None = None) -> KVCacheCoordinator:
    """A coordinator for `model` over `memory_gib` GiB (or exactly `num_blocks` blocks; in the
    decoupled layout, `num_blocks` superblocks).

    The Mamba groups get ``num_speculative_tokens`` speculative blocks. `mamba_policy`
    (``none`` / ``every`` / ``latest`` / ``latest-evict``, or an alias, see MAMBA_POLICIES)
    sets the Mamba groups' ``decode_checkpoints`` (None: the layout's default, ``every``
    unified, ``none`` decoupled). `layout` and `page_tokens`: as ``build_kv_cache_config``;
    `placement`: checkpoint placement rule names (None: the layout's ``DEFAULT_PLACEMENT``).
    `eviction`: ``reuse`` / ``lru`` (None: the layout's, ``reuse`` decoupled); `hazard_table`: a
    JSON file written by ``save_hazard_table`` to warm-start the reuse policy. `host_memory_gib`:
    a host tier of that many GiB (:class:`~mambakv.core.host_tier.HostTierSpec`, `host_write`
    ``through`` / ``evict``, `host_eviction` ``lru`` / ``reuse``); it tracks block ids only (no
    host memory is allocated).

    Raises:
        ModelConfigError: unknown model / unreadable config.
        InvalidSpecError: memory not a finite number > 0, fewer than 2 blocks fit, or more
            than MAX_NUM_BLOCKS blocks; a bad host tier.
    """
    if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or not math.isfinite(memory_gib) \
            or memory_gib <= 0:
        raise InvalidSpecError(f"memory must be a finite number > 0 GiB, got {memory_gib!r}")
    decode_checkpoints: str | None = None
    evict = False
    if mamba_policy is not None:
        if mamba_policy not in MAMBA_POLICIES:
            raise InvalidSpecError(f"unknown Mamba policy {mamba_policy!r}; known: {', '.join(MAMBA_POLICIES)}")
        decode_checkpoints, evict = MAMBA_POLICIES[mamba_policy]
    if not math.isfinite(memory_gib * GIB):  # 1e308 GiB: the byte count overflows a float
        raise InvalidSpecError(f"memory {memory_gib:g} GiB is too large")
    cfg = build_kv_cache_config(load_model(model), int(memory_gib * GIB), mamba_mode=mamba_mode,
                                num_speculative_blocks=num_speculative_tokens, decode_checkpoints=decode_checkpoints,
                                layout=layout, page_tokens=page_tokens)
    if num_blocks is not None and cfg.superblocks is not None:
        geo = replace(cfg.superblocks, num_superblocks=num_blocks)
        cfg = KVCacheConfig(geo.num_pages, cfg.kv_cache_groups, geo)
    elif num_blocks is not None:
        cfg = KVCacheConfig(num_blocks, cfg.kv_cache_groups)
    if cfg.num_blocks > MAX_NUM_BLOCKS:
        src = f"{memory_gib:g} GiB" if num_blocks is None else "num_blocks"
        raise InvalidSpecError(f"a pool of {cfg.num_blocks:,} blocks ({src}) exceeds the simulator's limit of "
                               f"{MAX_NUM_BLOCKS:,} blocks; use less memory")
    policy: str | EvictionPolicy | None = eviction
    if hazard_table is not None:
        policy = make_eviction_policy(eviction or "reuse", hazard=HazardTable.load(hazard_table))
    host = None
    if host_memory_gib is not None:
        if isinstance(host_memory_gib, bool) or not isinstance(host_memory_gib, (int, float)) \
                or not math.isfinite(host_memory_gib * GIB) or host_memory_gib <= 0:
            raise InvalidSpecError(f"host memory must be a finite number > 0 GiB, got {host_memory_gib!r}")
        block_bytes = None if cfg.superblocks is not None else plan_pages(load_model(model)).bytes_per_block
        host = HostTierSpec(int(host_memory_gib * GIB), write=host_write, eviction=host_eviction,
                            block_bytes=block_bytes)
        if host.geometry(cfg.superblocks).num_pages > MAX_NUM_BLOCKS:
            raise InvalidSpecError(f"a host tier of {host_memory_gib:g} GiB exceeds the simulator's limit of "
                                   f"{MAX_NUM_BLOCKS:,} blocks")
    coord = KVCacheCoordinator(cfg, max_model_len=max_model_len, enable_caching=enable_caching, use_eagle=use_eagle,
                               max_num_seqs=max_num_seqs, checkpoint_placement=placement, eviction=policy,
                               host_tier=host)
    for m in coord.mamba_managers:
        m.spare_may_evict = evict
    return coord


def model_max_len(model: str | Path) -> int:
    """The model's own context length: ``max_position_embeddings`` of its config.json (the
    packaged configs carry the public model's value; ``HybridModel.max_position_embeddings``),
    or DEFAULT_MAX_MODEL_LEN when the config has none.  Qwen3-Next: 262,144.

    Raises:
        ModelConfigError: unknown model / unreadable config.
    """
    return load_model(model).max_position_embeddings or DEFAULT_MAX_MODEL_LEN


def _policy_name(coord: KVCacheCoordinator, mamba_policy: str | None) -> str | None:
    """The ``--mamba-policy`` / ``--decode-checkpoints`` name asked for, else the layout's default."""
    if mamba_policy is not None or not coord.mamba_managers:
        return mamba_policy
    spec = coord.mamba_managers[0].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    return str(spec.decode_checkpoints.value)


def _layout_settings(coord: KVCacheCoordinator) -> dict[str, Any]:
    cfg = coord.kv_cache_config
    units = coord.units
    return {"layout": cfg.layout, "page_tokens": coord.managers[0].block_size if cfg.superblocks else None,
            "placement": list(coord.checkpoint_placement.names),
            "eviction_policy": units.policy.name if units is not None else "lru",
            "hazard_warm_start": bool(getattr(units.policy, "warm_start", False)) if units is not None else False,
            "host_memory_gib": coord.host.geometry.total_bytes / GIB if coord.host is not None else None,
            "host_write": coord.host.write.value if coord.host is not None else None,
            "host_eviction": coord.host.units.policy.name if coord.host is not None else None}


def run_workload(coord: KVCacheCoordinator, specs: Sequence[RequestSpec], *, one_at_a_time: bool = False,
                 settings: dict[str, Any] | None = None, on_finish: Callable[[SimRequest], None] | None = None,
                 build_s: float = 0.0, **scheduler_kwargs: Any) -> SimResult:
    """Run `specs` through a :class:`Scheduler` on `coord` (keyword arguments go to it).
    `build_s`: seconds it took to build `coord` (the result's wall time includes them).

    A request longer than the model allows (``num_prompt_tokens + output_len >
    coord.max_model_len``) is rejected before the run, as an engine refuses a request whose
    prompt plus ``max_tokens`` exceed its ``max_model_len``: it is counted in
    ``SimResult.rejected``, never scheduled, and its prompt is never built.
    """
    limit = coord.max_model_len
    kept = [s for s in specs if s.num_prompt_tokens + s.output_len <= limit]
    sched = Scheduler(coord, on_finish=on_finish, **scheduler_kwargs)
    metrics = sched.run(kept, one_at_a_time=one_at_a_time)
    return SimResult(coord, metrics, dict(settings or {}), rejected=len(specs) - len(kept), build_s=build_s)


def run_replay(model: str | Path = DEFAULT_MODEL, *, prompt_tokens: int = 480_031, output_tokens: int = 4,
               max_num_batched_tokens: int = 8192, num_speculative_tokens: int = 5, in_flight: int = 2,
               memory_gib: float = 60.0, use_eagle: bool = False, seed: int = 0, mamba_policy: str | None = None,
               layout: str = "unified", page_tokens: int = DEFAULT_PAGE_TOKENS,
               placement: Sequence[str] | None = None, eviction: str | None = None,
               hazard_table: str | Path | None = None, host_memory_gib: float | None = None,
               host_write: str = "through", host_eviction: str | None = None, **kwargs: Any) -> SimResult:
    """One long prefill (default 480,031 tokens) then a few decode steps, DESIGN.md 5.1's replay.

    With the defaults each Mamba group's request peaks at ``2 + 5 + 2 = 9`` blocks.

    Raises:
        InvalidTokenCountError: ``prompt_tokens + output_tokens`` > DEFAULT_MAX_MODEL_LEN
            (checked before the prompt is built)."""
    if prompt_tokens + output_tokens > DEFAULT_MAX_MODEL_LEN:
        raise InvalidTokenCountError(f"prompt {prompt_tokens:,} + output {output_tokens:,} tokens exceed "
                                     f"max_model_len {DEFAULT_MAX_MODEL_LEN:,}")
    t0 = time.perf_counter()
    coord = build_coordinator(model, memory_gib, num_speculative_tokens=num_speculative_tokens, use_eagle=use_eagle,
                              mamba_policy=mamba_policy, max_num_seqs=kwargs.get("max_num_seqs", 256),
                              layout=layout, page_tokens=page_tokens, placement=placement, eviction=eviction,
                              hazard_table=hazard_table, host_memory_gib=host_memory_gib, host_write=host_write,
                              host_eviction=host_eviction)
    build_s = time.perf_counter() - t0
    settings = {"workload": "replay", "model": str(model), "memory_gib": memory_gib,
                "mamba_policy": _policy_name(coord, mamba_policy), **_layout_settings(coord),
                "prompt_tokens_requested": prompt_tokens, "output_tokens_requested": output_tokens,
                "max_num_batched_tokens": max_num_batched_tokens,
                "num_speculative_tokens": num_speculative_tokens, "in_flight": in_flight}
    specs = long_prefill(prompt_tokens, output_len=output_tokens, seed=seed)
    return run_workload(coord, specs, settings=settings, max_num_batched_tokens=max_num_batched_tokens, build_s=build_s,
                        num_speculative_tokens=num_speculative_tokens, lag=in_flight, seed=seed, **kwargs)


def run_trace(path: str | Path, model: str | Path = DEFAULT_MODEL, *, memory_gib: float = 60.0,
              limit: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
              num_speculative_tokens: int = 0, in_flight: int = 0, one_at_a_time: bool = False,
              use_eagle: bool = False, max_output_tokens: int | None = None, num_blocks: int | None = None,
              seed: int = 0, specs: Sequence[RequestSpec] | None = None, mamba_policy: str | None = None,
              replay: str = "strict", skip: int = 0, layout: str = "unified", page_tokens: int = DEFAULT_PAGE_TOKENS,
              placement: Sequence[str] | None = None, eviction: str | None = None,
              hazard_table: str | Path | None = None, oracle_hints: bool = False,
              host_memory_gib: float | None = None, host_write: str = "through", host_eviction: str | None = None,
              max_model_len: int | None = None, **kwargs: Any) -> SimResult:
    """A Mooncake JSONL trace (first `limit` requests after the first `skip` lines) through the scheduler.

    `replay`: ``"strict"`` (equal ids = equal tokens) or ``"conversation"`` (a next turn begins
    with its parent's prompt and generated ids; :mod:`mambakv.sim.conversation`). `specs`, when
    given, must be ``load_trace(path, limit=limit, skip=skip, ...)`` (the command builds them
    first to size its progress bar). The result's ``to_dict()`` adds ``hit_tokens_by_cause``
    (:mod:`mambakv.sim.causes`) and, under conversation replay, ``conversation_children`` /
    ``conversation_prompts`` / ``strict_fallbacks``. `oracle_hints`: each request's ``retain`` is
    set from the trace's future (``high`` when a later request of the window shares more than
    the first block with it, else ``low``): an oracle, reported as such. `host_memory_gib` /
    `host_write`: a host tier (``build_coordinator``); ``h2d_gbps=`` (a Scheduler keyword) times
    its loads. `max_model_len`: requests of more prompt + output tokens are rejected before the
    run (``rejected``; :func:`run_workload`); None: the model's own context length
    (:func:`model_max_len`).

    Raises:
        TraceFormatError: missing file or malformed line, `specs` not those of the trace;
            InvalidSpecError: unknown `replay`; ModelConfigError; BudgetTooSmallError.
    """
    if replay not in REPLAY_MODES:
        raise InvalidSpecError(f"unknown replay {replay!r}; known: {', '.join(REPLAY_MODES)}")
    t0 = time.perf_counter()
    coord = build_coordinator(model, memory_gib, num_speculative_tokens=num_speculative_tokens,
                              use_eagle=use_eagle, num_blocks=num_blocks, mamba_policy=mamba_policy,
                              max_model_len=model_max_len(model) if max_model_len is None else max_model_len,
                              max_num_seqs=max_num_seqs, layout=layout, page_tokens=page_tokens,
                              placement=placement, eviction=eviction, hazard_table=hazard_table,
                              host_memory_gib=host_memory_gib, host_write=host_write,
                              host_eviction=host_eviction)
    build_s = time.perf_counter() - t0
    if specs is None:
        specs = load_trace(path, limit=limit, max_output_tokens=max_output_tokens, skip=skip)
    strict_specs = specs
    specs, conv, hooks = prepare_replay(specs, path, skip=skip, limit=limit, replay=replay)
    causes = HitCauses(strict_specs, conv.links)
    if oracle_hints:
        specs = oracle_retention(specs, conv.links)
    hooks += [causes.on_finish] + ([kwargs["on_finish"]] if kwargs.get("on_finish") else [])
    kwargs["on_finish"] = chain_hooks(hooks)
    settings = {"workload": "trace", "trace": str(path), "model": str(model), "memory_gib": memory_gib,
                "mamba_policy": _policy_name(coord, mamba_policy), **_layout_settings(coord), "replay": replay,
                "skip": skip,
                "limit": limit, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                "num_speculative_tokens": num_speculative_tokens, "in_flight": in_flight,
                "one_at_a_time": one_at_a_time, "oracle_hints": oracle_hints}
    result = run_workload(coord, specs, one_at_a_time=one_at_a_time, settings=settings, max_num_seqs=max_num_seqs,
                          build_s=build_s,
                          max_num_batched_tokens=max_num_batched_tokens,
                          num_speculative_tokens=num_speculative_tokens, lag=in_flight, seed=seed, **kwargs)
    result.extra["hit_tokens_by_cause"] = dict(causes.tokens)
    if replay == "conversation":
        result.extra.update(conversation_children=conv.num_children, conversation_prompts=conv.conversation_prompts,
                            strict_fallbacks=conv.strict_fallbacks)
    return result


def run_conversations(model: str | Path = DEFAULT_MODEL, *, num_conversations: int = 8, turns: int = 4,
                      memory_gib: float = 60.0, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                      num_speculative_tokens: int = 0, in_flight: int = 0, one_at_a_time: bool = False,
                      use_eagle: bool = False, seed: int = 0, specs: Sequence[RequestSpec] | None = None,
                      mamba_policy: str | None = None, layout: str = "unified",
                      page_tokens: int = DEFAULT_PAGE_TOKENS, placement: Sequence[str] | None = None,
                      eviction: str | None = None, hazard_table: str | Path | None = None,
                      host_memory_gib: float | None = None, host_write: str = "through",
                      host_eviction: str | None = None, **kwargs: Any) -> SimResult:
    """Multi-turn chats (:func:`~mambakv.sim.workloads.conversations`) through the scheduler."""
    t0 = time.perf_counter()
    coord = build_coordinator(model, memory_gib, num_speculative_tokens=num_speculative_tokens, use_eagle=use_eagle,
                              mamba_policy=mamba_policy, max_num_seqs=max_num_seqs, layout=layout,
                              page_tokens=page_tokens, placement=placement, eviction=eviction,
                              hazard_table=hazard_table, host_memory_gib=host_memory_gib, host_write=host_write,
                              host_eviction=host_eviction)
    build_s = time.perf_counter() - t0
    if specs is None:
        specs = conversations(num_conversations, turns, seed=seed)
    settings = {"workload": "chat", "model": str(model), "memory_gib": memory_gib,
                "mamba_policy": _policy_name(coord, mamba_policy), **_layout_settings(coord),
                "conversations": num_conversations, "turns": turns, "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "num_speculative_tokens": num_speculative_tokens, "in_flight": in_flight,
                "one_at_a_time": one_at_a_time}
    return run_workload(coord, specs, one_at_a_time=one_at_a_time, settings=settings, max_num_seqs=max_num_seqs,
                        build_s=build_s, max_num_batched_tokens=max_num_batched_tokens,
                        num_speculative_tokens=num_speculative_tokens, lag=in_flight, seed=seed, **kwargs)
