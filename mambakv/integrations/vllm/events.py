"""mambakv's KV events as vLLM 0.33's (``vllm.distributed.kv_events``), for vLLM's publisher.

The hashes are vLLM's own (the coordinator reads ``request.block_hashes``), converted the way
vLLM converts them for its events (``maybe_convert_block_hash``: bytes, or 64-bit ints when
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set). A store event carries the group's kind and
sliding window as vLLM's ``KVCacheManager.take_events`` annotates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["event_metadata", "to_vllm_events"]


def event_metadata(config: Any) -> tuple[tuple[str, int | None], ...]:
    """Per vLLM group: (spec kind, sliding window), as vLLM's manager annotates store events."""
    return tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                 for g in config.kv_cache_groups)


def to_vllm_events(events: Sequence[KVCacheEvent], metadata: Sequence[tuple[str, int | None]]) -> list[Any]:
    """vLLM event objects for mambakv's `events`, in order (one for one)."""
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            kind, window = metadata[ev.group_id]
            out.append(VllmBlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in ev.block_hashes],
                parent_block_hash=None if ev.parent_block_hash is None else maybe_convert_block_hash(
                    BlockHash(ev.parent_block_hash)),
                token_ids=list(ev.token_ids), block_size=ev.block_size, lora_id=ev.lora_id, medium=ev.medium,
                lora_name=ev.lora_name, group_idx=ev.group_id, kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window))
        elif isinstance(ev, BlockRemoved):
            out.append(VllmBlockRemoved(block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in ev.block_hashes],
                                        medium=ev.medium, group_idx=ev.group_id))
        elif isinstance(ev, AllBlocksCleared):
            out.append(VllmAllBlocksCleared())
    return out
