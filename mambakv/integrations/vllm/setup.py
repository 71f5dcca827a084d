"""Putting mambakv under a constructed vLLM scheduler: the refusals, then the manager swap.

vLLM's ``Scheduler.__init__`` builds its own ``KVCacheManager`` and reads it while it is still
in the constructor (the spec-decode step blocks, the Mamba split flags, the connector binding).
The integration lets that constructor run unchanged, then refuses what it does not drive (one
line naming the feature) and replaces ``kv_cache_manager`` before the first ``schedule``: vLLM's
own manager is dropped unused (Python objects only; the KV tensors belong to the worker).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler

from mambakv.core.errors import UnsupportedEngineError
from mambakv.integrations.vllm.config import refused_group_kind
from mambakv.integrations.vllm.manager import VllmKVCacheManager

__all__ = ["install_mambakv", "refused_feature"]


def refused_feature(scheduler: Any) -> str | None:
    """The first feature of a constructed vLLM scheduler that the integration refuses, by
    name, or None."""
    vllm_config = scheduler.vllm_config
    kind = refused_group_kind(scheduler.kv_cache_config)
    if kind is not None:
        return kind
    if scheduler.connector is not None or vllm_config.kv_transfer_config is not None:
        return "KV connectors (disaggregated prefill / KV transfer)"
    if scheduler.is_encoder_decoder:
        return "encoder-decoder models"
    if scheduler.dcp_world_size > 1 or scheduler.pcp_world_size > 1:
        return "decode / prefill context parallelism (DCP / PCP)"
    own = scheduler.kv_cache_manager.coordinator
    if scheduler.hash_block_size != scheduler.block_size or getattr(own, "enable_partial_hash_hits", False):
        return "partial-block prefix hits (hash_block_size below the block size)"
    hybrid = bool(scheduler.kv_cache_config.has_mamba_layers)
    if hybrid and scheduler.num_spec_tokens:
        return "hybrid (Mamba) models with speculative decoding"
    if hybrid and scheduler.use_pp:
        return "hybrid (Mamba) models with pipeline parallelism"
    if scheduler.needs_kv_cache_zeroing and not hybrid:
        return "KV-cache block zeroing"
    if getattr(scheduler, "aux_output_connector", None) is not None:
        return "aux output connectors"
    if scheduler.num_hash_lookahead_tokens or scheduler.num_prefill_lookahead:
        return "hash / prefill lookahead tokens (multi-module MTP)"
    if getattr(scheduler.kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        return "HiSparse host KV blocks"
    if getattr(scheduler, "kv_metrics_collector", None) is not None:
        return "KV-cache residency metrics (observability kv_cache_metrics)"
    return None


def install_mambakv(scheduler: Any) -> VllmKVCacheManager:
    """Refuse what the integration does not drive, then make a mambakv-backed manager the
    scheduler's ``kv_cache_manager`` (built from the ``KVCacheConfig`` vLLM passed).

    Raises:
        UnsupportedEngineError: a refused feature (one line naming it), or a scheduler class that
            does not match the async-scheduling setting (``Scheduler`` needs it off,
            ``AsyncScheduler`` on, as vLLM pairs its own), before anything changed.
    """
    refused = refused_feature(scheduler)
    if refused is not None:
        raise UnsupportedEngineError(f"mambakv.integrations.vllm does not support {refused}")
    async_on = bool(scheduler.scheduler_config.async_scheduling)
    if async_on != isinstance(scheduler, VllmAsyncScheduler):
        wanted = "AsyncScheduler" if async_on else "Scheduler"
        raise UnsupportedEngineError(
            f"mambakv.integrations.vllm.{type(scheduler).__name__} with async scheduling "
            f"{'on' if async_on else 'off'}: use mambakv.integrations.vllm.{wanted}")
    manager = VllmKVCacheManager(
        scheduler.kv_cache_config, max_model_len=scheduler.max_model_len, hash_block_size=scheduler.hash_block_size,
        enable_caching=bool(scheduler.cache_config.enable_prefix_caching), use_eagle=scheduler.use_eagle_block_drop,
        log_stats=scheduler.log_stats, enable_kv_cache_events=scheduler.enable_kv_cache_events,
        watermark=scheduler.scheduler_config.watermark)
    scheduler.kv_cache_manager = manager
    return manager
