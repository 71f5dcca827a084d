"""KV-cache events with vLLM's field names, so cache-aware routers that consume vLLM's
events can consume ours (``BlockPool.take_events()``).

The stream is raw and per ``(group, hash)``: a ``(group_id, hash)`` is stored when the first
block of that group gets the hash and removed when the last such block loses it, so replaying
the stream gives exactly the pool's hashed blocks, and every BlockRemoved pairs with an earlier
BlockStored of the same group. Each BlockStored is one chain::

    BlockStored(block_hashes=[h2, h3], parent_block_hash=h1, token_ids=<8 ids>, block_size=4)
        h2 = H(h1, ids[0:4]), h3 = H(h2, ids[4:8]): len(token_ids) == 2 * block_size

A Mamba state at slot s is published like the attention block at the same position: its key
``h_s``, parent ``h_{s-1}`` (None at slot 0) and the slot's ``block_size`` token ids. What a
router should see of a hybrid model is a filtered view of this stream
(``mambakv.events.announce``, docs/routers.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BlockStored:
    """Blocks were published: their hashes (one chain), the hash of the block before the first
    one (None for a request's first block), their token ids (flat, ``len(block_hashes) *
    block_size``), tokens per block, the request's numeric LoRA id and name, the medium and the
    KV-cache group."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = "GPU"
    group_id: int = 0
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """The last block of group `group_id` carrying each hash lost it (it was reused or its
    data dropped). On vLLM's wire the group is ``group_idx``."""

    block_hashes: list[bytes]
    medium: str | None = "GPU"
    group_id: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _as_int_list(ids: Any) -> list[int]:
    """A slice of a request's token ids as plain ints: a numpy slice (``Request``) or an
    engine's own sequence (an ``EngineRequest``'s ``all_token_ids``)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(map(int, ids))


def stored_event_fields(request: Any, keys: Sequence[bytes], start: int, stop: int,
                        block_size: int) -> dict[str, Any]:
    """Keyword arguments of ``BlockPool.cache_full_blocks`` that only feed the BlockStored
    event of a request's blocks ``[start, stop)`` (group keys `keys`, `block_size` tokens
    each): parent hash (key ``start - 1``, None at 0), their token ids, the request's LoRA id
    and name. Managers call it only when events are enabled (the slice is a copy)."""
    return {
        "parent_block_hash": keys[start - 1] if start else None,
        "token_ids": _as_int_list(request.all_token_ids[start * block_size : stop * block_size]),
        "block_size": block_size,
        "lora_id": request.lora_id,
        "lora_name": request.lora_name,
    }


def stored_events(new: Sequence[int], block_hashes: Sequence[bytes], group_id: int,
                  parent_block_hash: bytes | None, token_ids: Sequence[int] | None, block_size: int,
                  lora_id: int | None, lora_name: str | None) -> list[BlockStored]:
    """One BlockStored per run of consecutive indices in `new` (sorted indices into
    `block_hashes` of the blocks whose hash is new to the group; ``BlockPool.cache_full_blocks``
    shows an example). A run's parent is the hash just before it (`parent_block_hash` for a run
    at index 0) and its token ids are its slice of the flat `token_ids` (none when None)."""
    out = []
    start = 0
    for k in range(1, len(new) + 1):
        if k < len(new) and new[k] == new[k - 1] + 1:
            continue
        lo, hi = new[start], new[k - 1] + 1
        parent = block_hashes[lo - 1] if lo else parent_block_hash
        ids = token_ids[lo * block_size : hi * block_size] if token_ids is not None else []
        if type(ids) is not list:  # (a list's slice is already a copy of its own)
            ids = list(ids)
        out.append(BlockStored(list(block_hashes[lo:hi]), parent, ids, block_size, lora_id,
                               group_id=group_id, lora_name=lora_name))
        start = k
    return out
