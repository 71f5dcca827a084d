"""mambakv's KV events as vLLM 0.33's (``vllm.distributed.kv_events``), for vLLM's publisher.

The hashes are vLLM's own (the coordinator reads ``request.block_hashes``), in the form vLLM
publishes them (``maybe_convert_block_hash``: the bytes, or with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` set, vLLM 0.33's default, the low 64 bits of their
big-endian integer). The setting is read once per batch of events, not once per hash (one read
of ``vllm.envs`` costs about 2.5 us on a CPU of the test machines, more than building the
event). A store event carries the group's kind and sliding window as vLLM's
``KVCacheManager.take_events`` annotates them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm import envs
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["event_metadata", "to_vllm_events"]

_LOW_64_BITS = (1 << 64) - 1


def _int_key(block_hash: bytes) -> int:
    """An event key as an int: the low 64 bits of the hash read as a big-endian integer."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


def _keys(block_hashes: list[bytes], key: Callable[[bytes], Any] | None) -> list[Any]:
    """An event's hashes as vLLM's event keys (the list itself when they stay bytes)."""
    return block_hashes if key is None else [key(h) for h in block_hashes]


def _key_converter() -> Callable[[bytes], Any] | None:
    """How vLLM's events carry a block hash under the current environment: a function to an
    int key (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` set), or None (the bytes themselves)."""
    return _int_key if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else None


def event_metadata(config: Any) -> tuple[tuple[str, int | None], ...]:
    """Per vLLM group: (spec kind, sliding window), as vLLM's manager annotates store events."""
    return tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                 for g in config.kv_cache_groups)


def to_vllm_events(events: Sequence[KVCacheEvent], metadata: Sequence[tuple[str, int | None]]) -> list[Any]:
    """vLLM event objects for mambakv's `events`, in order (one for one). The vLLM events take
    over the lists of mambakv's (drained) events: nothing is copied."""
    out: list[Any] = []
    if not events:
        return out
    key = _key_converter()
    for ev in events:
        if isinstance(ev, BlockStored):
            kind, window = metadata[ev.group_id]
            parent = ev.parent_block_hash
            out.append(VllmBlockStored(
                block_hashes=_keys(ev.block_hashes, key),
                parent_block_hash=parent if key is None or parent is None else key(parent),
                token_ids=ev.token_ids, block_size=ev.block_size, lora_id=ev.lora_id, medium=ev.medium,
                lora_name=ev.lora_name, group_idx=ev.group_id, kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window))
        elif isinstance(ev, BlockRemoved):
            out.append(VllmBlockRemoved(block_hashes=_keys(ev.block_hashes, key), medium=ev.medium,
                                        group_idx=ev.group_id))
        elif isinstance(ev, AllBlocksCleared):
            out.append(VllmAllBlocksCleared())
    return out
