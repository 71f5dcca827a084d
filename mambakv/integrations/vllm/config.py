"""vLLM's ``KVCacheConfig`` -> mambakv's (unified layout), refusing what the integration
does not drive.

Full-attention groups (vLLM's ``FullAttentionSpec`` without a sliding window or chunked local
attention) and Mamba groups in align mode are converted (mambakv's ``MambaSpec(mode="align")``
with vLLM's ``num_speculative_blocks``, decode checkpoints ``every``: vLLM's table rule); every
other group kind is refused with one line naming it. The pool keeps vLLM's block count and ids (block 0 is the null block in both), so block
ids in the worker's tables mean the same rows of vLLM's KV tensors.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFullAttentionSpec
from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

from mambakv.core.errors import UnsupportedEngineError
from mambakv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MambaSpec

__all__ = ["convert_kv_cache_config", "refused_group_kind"]


def _refused_kind(spec: Any) -> str | None:
    """The name of the feature a vLLM group spec needs that the integration refuses, else None."""
    if isinstance(spec, VllmMambaSpec):
        if spec.mamba_cache_mode != "align":
            return f"Mamba cache mode {spec.mamba_cache_mode!r} (only 'align')"
        if spec.num_prefill_checkpoint_blocks:
            return "Mamba prefill checkpoint blocks"
        return None
    if type(spec) is not VllmFullAttentionSpec:
        return f"KV-cache groups of kind {type(spec).__name__}"
    if spec.sliding_window is not None:
        return "sliding-window attention"
    if spec.attention_chunk_size is not None:
        return "chunked local attention"
    if getattr(spec, "prefix_replay_tokens", 0):
        return "prefix replay (bounded-window recompute)"
    return None


def refused_group_kind(config: Any) -> str | None:
    """The feature named by the first group of vLLM's `config` that the integration refuses
    (with the group's index), else None."""
    for i, group in enumerate(config.kv_cache_groups):
        refused = _refused_kind(group.kv_cache_spec)
        if refused is not None:
            return f"{refused} (KV-cache group {i})"
    return None


def convert_kv_cache_config(config: Any) -> KVCacheConfig:
    """mambakv's unified-layout config for vLLM's `config`: the same ``num_blocks``, one
    mambakv group per vLLM group with the same layer names and block size (tokens).

    Raises:
        UnsupportedEngineError: a group mambakv does not drive inside vLLM (Mamba groups not in
            align mode, sliding windows, ...): one line naming it.
    """
    refused = refused_group_kind(config)
    if refused is not None:
        raise UnsupportedEngineError(f"mambakv.integrations.vllm does not support {refused}")
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        ours: KVCacheSpec
        if isinstance(spec, VllmMambaSpec):  # align mode: a state per block boundary, K scratch blocks
            ours = MambaSpec(spec.block_size, tuple(tuple(s) for s in spec.shapes),
                             tuple(str(d).removeprefix("torch.") for d in spec.dtypes), mode="align",
                             num_speculative_blocks=spec.num_speculative_blocks)
        else:
            ours = FullAttentionSpec(spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                     dtype=str(spec.dtype).removeprefix("torch."))
        groups.append(KVCacheGroupSpec(list(group.layer_names), ours))
    return KVCacheConfig(int(config.num_blocks), groups)
