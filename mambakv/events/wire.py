"""vLLM 0.33.0's KV event wire format (msgpack, via msgspec), written from the format's facts.

One ZMQ message per batch, three frames: ``topic`` (utf-8), an 8-byte big-endian sequence
number, and the msgpack payload. The payload is a batch encoded as an array
``[ts, events, data_parallel_rank]``; each event is a map whose first key ``"type"`` names it
(``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``), fields in the order below,
fields equal to their default left out (``group_idx`` 0 is written: its default is None)::

    [1700000000.25,
     [{"type": "BlockStored", "block_hashes": [72623859790382856], "parent_block_hash": None,
       "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
       "lora_name": None, "extra_keys": [None], "group_idx": 0},
      {"type": "BlockRemoved", "block_hashes": [72623859790382856], "medium": "GPU", "group_idx": 0},
      {"type": "AllBlocksCleared"}],
     0]

Block hashes are ints as vLLM converts its digests for events
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default): the digest read as a big-endian
integer, low 64 bits kept, i.e. ``int.from_bytes(digest[-8:], "big")`` (:func:`external_hash`).
Decoding also accepts bytes hashes (vLLM with that variable off).

Needs the ``events`` extra (``pip install 'mambakv[events]'``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from mambakv.core import events as core
from mambakv.core.errors import MambaKVError

__all__ = ["EventDecodeError", "WireAllBlocksCleared", "WireBlockRemoved", "WireBlockStored", "WireEventBatch", "decode_batch",
           "encode_batch", "external_hash", "to_wire_batch", "to_wire_event"]

Hash = int | bytes


class EventDecodeError(MambaKVError, ValueError):
    """A payload that is not an event batch of this schema, or an object that is no event."""


def external_hash(digest: bytes) -> int:
    """A 16-byte mambakv digest as vLLM publishes block hashes: its low 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class WireBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: per block: the LoRA name, then multimodal (identifier, offset) pairs, then the cache
    #: salt; None for a block without any (mambakv publishes the LoRA name only)
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def to_wire_event(ev: core.KVCacheEvent, *, spec_kinds: Mapping[int, str] | None = None) -> WireEvent:
    """One core event in wire form (hashes converted by :func:`external_hash`).
    `spec_kinds`: group id -> vLLM's spec kind (``"full_attention"``, ``"mamba"``, ...) for
    ``kv_cache_spec_kind``; left out when None."""
    if isinstance(ev, core.BlockStored):
        n = len(ev.block_hashes)
        return WireBlockStored(
            block_hashes=[external_hash(h) for h in ev.block_hashes],
            parent_block_hash=None if ev.parent_block_hash is None else external_hash(ev.parent_block_hash),
            token_ids=list(ev.token_ids),
            block_size=ev.block_size,
            lora_id=ev.lora_id,
            medium=ev.medium,
            lora_name=ev.lora_name,
            extra_keys=[(ev.lora_name,) if ev.lora_name is not None else None] * n,
            group_idx=ev.group_id,
            kv_cache_spec_kind=spec_kinds.get(ev.group_id) if spec_kinds else None,
        )
    if isinstance(ev, core.BlockRemoved):
        return WireBlockRemoved(block_hashes=[external_hash(h) for h in ev.block_hashes], medium=ev.medium,
                                group_idx=ev.group_id)
    if isinstance(ev, core.AllBlocksCleared):
        return WireAllBlocksCleared()
    raise EventDecodeError(f"not a KV event: {ev!r}")


def to_wire_batch(ts: float, events: Iterable[core.KVCacheEvent], *, data_parallel_rank: int | None = 0,
                  spec_kinds: Mapping[int, str] | None = None) -> WireEventBatch:
    return WireEventBatch(ts=ts, events=[to_wire_event(e, spec_kinds=spec_kinds) for e in events],
                          data_parallel_rank=data_parallel_rank)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireEventBatch)


def encode_batch(batch: WireEventBatch) -> bytes:
    """The payload frame of one batch."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> WireEventBatch:
    """Decode (and validate) a payload frame.

    Raises:
        EventDecodeError: not a batch of this schema.
    """
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise EventDecodeError(f"not a KV event batch: {e}") from None
