"""KV-cache events with vLLM's field names, so cache-aware routers that consume vLLM's
events can consume ours (``BlockPool.take_events()``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Blocks were published: their hashes, the hash of the block before the first one (None
    for a request's first block), their token ids (flat), tokens per block, LoRA id, medium."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = "GPU"
    group_id: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    """Published blocks were evicted (their hashes dropped to reuse them)."""

    block_hashes: list[bytes]
    medium: str | None = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
