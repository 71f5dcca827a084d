"""vLLM 0.33.0's event wire format: a batch encoded by vLLM's own encoder (the fixture, made by
tests/fixtures/make_vllm_golden.py in the peer venv) decodes with our schema to the values
written below, and our encoder writes the same bytes for the same events."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("msgspec")

from mambakv import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from mambakv.events.wire import (  # noqa: E402
    EventDecodeError,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    encode_batch,
    external_hash,
    to_wire_batch,
)

GOLDEN = (Path(__file__).parent / "fixtures" / "vllm_0.33.0_event_batch.msgpack").read_bytes()
A = 0x0102030405060708
B = 0x1112131415161718
DA = bytes(8) + bytes(range(1, 9))  # a 16-byte digest whose low 8 bytes read A
DB = b"\xff" * 8 + bytes(range(0x11, 0x19))  # the high half is not published


def test_external_hash_is_the_low_8_bytes_big_endian():
    assert external_hash(DA) == A == 72623859790382856
    assert external_hash(DB) == B
    assert external_hash(bytes(range(16))) == 0x08090A0B0C0D0E0F


def test_golden_batch_decodes_with_our_schema():
    batch = decode_batch(GOLDEN)
    assert batch.ts == 1700000000.25 and batch.data_parallel_rank == 0
    s1, s2, r, c = batch.events
    assert isinstance(s1, WireBlockStored)
    assert (s1.block_hashes, s1.parent_block_hash, s1.token_ids, s1.block_size) == ([A, B], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert (s1.lora_id, s1.lora_name, s1.medium, s1.extra_keys, s1.group_idx) == (None, None, "GPU", [None, None], 0)
    assert (s2.block_hashes, s2.parent_block_hash, s2.token_ids, s2.lora_id, s2.lora_name) == ([B], A, [5, 6, 7, 8], 7, "sql")
    assert (s2.extra_keys, s2.group_idx, s2.kv_cache_spec_kind, s2.session_id) == ([("sql",)], 1, None, None)
    assert isinstance(r, WireBlockRemoved) and (r.block_hashes, r.medium, r.group_idx) == ([B], "GPU", 1)
    assert isinstance(c, WireAllBlocksCleared)


def test_our_encoder_writes_vllms_bytes():
    events = [
        BlockStored([DA, DB], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, group_id=0),
        BlockStored([DB], DA, [5, 6, 7, 8], 4, 7, group_id=1, lora_name="sql"),
        BlockRemoved([DB], group_id=1),
        AllBlocksCleared(),
    ]
    payload = encode_batch(to_wire_batch(1700000000.25, events, data_parallel_rank=0))
    assert payload == GOLDEN
    assert len(payload) == 416


def test_head_of_the_payload_by_hand():
    """msgpack: 0x93 = array of 3 (ts, events, rank); 0xcb + 8 bytes = float64 ts
    (1700000000.25 = 0x41d954fc40100000); 0x94 = 4 events; 0xde 0x000a = a map of 10 fields
    whose first key is "type" (0xa4 + 4 bytes); the last byte is the rank 0."""
    assert GOLDEN[:10] == bytes.fromhex("93cb41d954fc40100000")
    assert GOLDEN[10] == 0x94
    assert GOLDEN[11:14] == b"\xde\x00\x0a"
    assert GOLDEN[14:19] == b"\xa4type"
    assert GOLDEN[-1] == 0x00


def test_spec_kind_is_written_when_given():
    payload = encode_batch(to_wire_batch(1.0, [BlockStored([DA], None, [1], 1, None, group_id=2)],
                                         spec_kinds={2: "mamba"}))
    (ev,) = decode_batch(payload).events
    assert ev.kv_cache_spec_kind == "mamba" and ev.group_idx == 2 and ev.block_hashes == [A]


def test_bad_input_raises_event_decode_error():
    with pytest.raises(EventDecodeError):
        decode_batch(b"\x93\x01")  # truncated
    with pytest.raises(EventDecodeError):
        decode_batch(encode_batch(to_wire_batch(1.0, []))[:-1] + b"\xa1x")  # rank is a str
    with pytest.raises(EventDecodeError):
        to_wire_batch(1.0, ["BlockStored"])
