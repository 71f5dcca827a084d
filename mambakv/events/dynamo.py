"""The vLLM-to-Dynamo event mapping: a decoded vLLM batch as the JSON events that Dynamo's
KV router index takes (``dynamo.llm.RadixTree().apply_event(worker_id, json_bytes)``).

Dynamo's index is a radix tree of blocks per ``(worker, dp_rank)``. Each node is matched by a
*local* hash of its own tokens only (``compute_block_hash_for_seq(tokens, block_size)``, one
per block, not chained: the tree gives the chaining) and named by the engine's block hash::

    vLLM BlockStored(block_hashes=[h1, h2], parent_block_hash=p, token_ids=t, block_size=bs)
      -> {"event_id": n, "dp_rank": r, "data": {"stored": {"parent_hash": p, "blocks": [
             {"block_hash": h1, "tokens_hash": L(t[0:bs])}, {"block_hash": h2, "tokens_hash": L(t[bs:2bs])}]}}}
    vLLM BlockRemoved(block_hashes=[h1])  -> {"event_id": n, "dp_rank": r, "data": {"removed": {"block_hashes": [h1]}}}
    vLLM AllBlocksCleared()               -> {"event_id": n, "dp_rank": r, "data": "cleared"}

``L`` is ``compute_block_hash_for_seq`` (with the event's ``lora_name``). Dynamo refuses a
store whose parent it does not hold for that worker, so feed it the announced stream of a
``ZmqEventPublisher`` (every event there extends an announced chain). Dynamo keeps one block
size: all events of the announced stream are of the first full-attention group.

This module imports nothing from Dynamo: pass ``compute_block_hash_for_seq`` in.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from mambakv.events.wire import (
    EventDecodeError,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    WireEventBatch,
)

__all__ = ["batch_to_dynamo", "event_to_dynamo"]

LocalHasher = Callable[..., list[int]]


def event_to_dynamo(ev: WireEvent, event_id: int, local_hash: LocalHasher, *, dp_rank: int = 0) -> bytes:
    """One wire event as Dynamo's JSON event bytes (module docstring).

    `local_hash(tokens, block_size, lora_name=...)` is Dynamo's ``compute_block_hash_for_seq``.

    Raises:
        EventDecodeError: `ev` is no wire event.
    """
    if isinstance(ev, WireBlockStored):
        bs = ev.block_size
        local = local_hash(list(ev.token_ids), bs, lora_name=ev.lora_name)
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(ev.block_hashes, local)]
        data: object = {"stored": {"parent_hash": ev.parent_block_hash, "blocks": blocks}}
    elif isinstance(ev, WireBlockRemoved):
        data = {"removed": {"block_hashes": list(ev.block_hashes)}}
    elif isinstance(ev, WireAllBlocksCleared):
        data = "cleared"
    else:
        raise EventDecodeError(f"not a wire event: {ev!r}")
    return json.dumps({"event_id": event_id, "data": data, "dp_rank": dp_rank}).encode()


def batch_to_dynamo(batch: WireEventBatch, first_event_id: int, local_hash: LocalHasher) -> list[bytes]:
    """Every event of a decoded batch, numbered from `first_event_id`."""
    rank = batch.data_parallel_rank or 0
    return [event_to_dynamo(ev, first_event_id + i, local_hash, dp_rank=rank) for i, ev in enumerate(batch.events)]
