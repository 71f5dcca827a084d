"""Block hash chain (DESIGN.md section 4, mambakv/hashing.py).

The reference digest is rebuilt here from the documented formula,
``xxh3_128(parent + little-endian int32 token bytes [+ extra keys])``, with the chain seeded by
``hashing.NONE_HASH``; nothing is compared against values the library printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

import mambakv.core.hashing as hashing
from mambakv import InvalidTokenCountError, MambaKVError, hash_block_tokens, init_none_hash
from mambakv.core.hashing import as_token_array, hash_blocks
from mambakv.groups.base import BlockHashView

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_seed():
    """init_none_hash changes a module global: put the original seed back afterwards."""
    saved = hashing.NONE_HASH
    yield
    hashing.NONE_HASH = saved


def ref_chain(tokens, block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Independent reference: one xxh3-128 per full block over parent + int32 LE bytes."""
    p = hashing.NONE_HASH if parent is None else parent
    out = []
    for j in range(len(tokens) // block_size):
        raw = np.asarray(tokens[j * block_size : (j + 1) * block_size], dtype="<i4").tobytes()
        p = xxhash.xxh3_128_digest(p + raw)
        out.append(p)
    return out


def test_digest_is_xxh3_128_of_parent_and_int32_le_bytes():
    toks = [1, 2, 3, 70000]
    # 4 ids x 4 bytes, little endian: 70000 = 0x00011170 -> 70 11 01 00
    raw = b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x70\x11\x01\x00"
    parent = b"p" * 16
    assert hash_block_tokens(parent, toks) == xxhash.xxh3_128_digest(parent + raw)
    assert hash_block_tokens(None, toks) == xxhash.xxh3_128_digest(hashing.NONE_HASH + raw)
    assert len(hash_block_tokens(None, toks)) == 16


def test_chaining_parent_changes_hash():
    toks = list(range(16))
    a = hash_block_tokens(b"a" * 16, toks)
    b = hash_block_tokens(b"b" * 16, toks)
    assert a != b
    assert hash_block_tokens(b"a" * 16, toks) == a  # deterministic within a process
    assert hash_block_tokens(None, toks) != a


def test_token_order_and_values_matter():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [2, 1, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


def test_extra_keys_change_hash():
    toks = list(range(8))
    plain = hash_block_tokens(None, toks)
    assert hash_block_tokens(None, toks, ()) == plain  # no keys is no keys
    assert hash_block_tokens(None, toks, ("lora:a",)) != plain
    assert hash_block_tokens(None, toks, ("lora:a",)) != hash_block_tokens(None, toks, ("lora:b",))
    # keys are length-prefixed: ("ab", "c") and ("a", "bc") must not collide
    assert hash_block_tokens(None, toks, ("ab", "c")) != hash_block_tokens(None, toks, ("a", "bc"))


def test_list_int32_int64_hash_equally():
    ids = [5, 0, 2**31 - 1, 2**31 - 2, 12345, 7, 8, 9]  # both ends of 0 .. 2**31 - 1
    expect = ref_chain(ids, 4)
    for form in (ids, np.array(ids, dtype=np.int32), np.array(ids, dtype=np.int64)):
        got = hash_blocks(as_token_array(form), 4, 0, 2, None)
        assert got == expect
        assert hash_block_tokens(None, form[:4]) == expect[0]
    arr32 = np.array(ids, dtype=np.int32)
    assert as_token_array(arr32) is arr32  # used as is, no copy


@pytest.mark.parametrize("bad", [
    [1, 2**31], [-(2**31) - 1], np.array([0, 2**31], dtype=np.int64), np.array([[1, 2]], dtype=np.int32),
    np.array([1.0, 2.0]),
    [-1], [3, -5], [2**32], [2**32 + 1], [2**40],  # negative; >= 2**32 (array "I" overflows)
    [2**31, 0], [2**32 - 1],  # 2**31 .. 2**32 - 1 fit in uint32: caught by the max check
    [1.9, 2.0], [np.float64(3.0)], [1, "2"], "ab", [[1, 2]],  # not ints (np.fromiter truncated 1.9 to 1)
    np.array([-1, 5], dtype=np.int32), np.array([-1], dtype=np.int64), np.array([2**31], dtype=np.uint32),
])
def test_ids_outside_0_to_int32_max_raise(bad):
    with pytest.raises(InvalidTokenCountError) as e:
        as_token_array(bad)
    assert isinstance(e.value, MambaKVError)


def test_list_ids_accept_numpy_ints_and_equal_fromiter():
    ids = [0, 1, 2**31 - 1, np.int64(7), np.uint32(9), np.int32(11)]
    got = as_token_array(ids)
    assert got.dtype == np.dtype("<i4") and got.tolist() == [0, 1, 2**31 - 1, 7, 9, 11]
    big = list(range(0, 2**31 - 1, 4_000_007))  # 537 ids spread over the range
    assert np.array_equal(as_token_array(big), np.fromiter(big, dtype="<i4", count=len(big)))
    assert hash_block_tokens(None, [2**31 - 1]) == ref_chain([2**31 - 1], 1)[0]


def test_hash_blocks_ranges_and_partial_blocks():
    toks = as_token_array(list(range(35)))  # 35 tokens at block 16: 2 full blocks, 3 left over
    full = ref_chain(list(range(35)), 16)
    assert len(full) == 2
    assert hash_blocks(toks, 16, 0, 2, None) == full
    assert hash_blocks(toks, 16, 1, 2, full[0]) == full[1:]  # resume from the parent digest
    assert hash_blocks(toks, 16, 2, 2, full[1]) == []


def test_coarse_block_keys_are_the_fine_digest_ending_each_coarse_block():
    fine = [bytes([i]) * 16 for i in range(9)]
    assert list(BlockHashView(fine, 4)) == [fine[3], fine[7]]
    assert BlockHashView(fine, 4)[1:] == [fine[7]]
    assert list(BlockHashView(fine, 1)) == fine
    assert list(BlockHashView(fine[:3], 4)) == []  # no full coarse block yet


def test_init_none_hash_seed_fixed_and_random(restore_seed):
    toks = [3, 1, 4, 1]
    init_none_hash(1234)
    a = hash_block_tokens(None, toks)
    init_none_hash(4321)
    b = hash_block_tokens(None, toks)
    init_none_hash(1234)
    assert hash_block_tokens(None, toks) == a
    assert a != b
    # a parent given explicitly does not depend on the seed
    init_none_hash(99)
    assert hash_block_tokens(b"x" * 16, toks) == xxhash.xxh3_128_digest(b"x" * 16 + np.array(toks, "<i4").tobytes())


def test_init_none_hash_random_without_seed(restore_seed, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash()
    a = hashing.NONE_HASH
    init_none_hash()
    assert hashing.NONE_HASH != a and len(a) == 16
    monkeypatch.setenv("PYTHONHASHSEED", "random")  # Python's own "random" setting: still random
    init_none_hash()
    assert hashing.NONE_HASH != a
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    init_none_hash()
    c = hashing.NONE_HASH
    init_none_hash(7)
    assert hashing.NONE_HASH == c  # the environment seed and the explicit seed agree


_CHILD = (
    "from mambakv import Request;"
    "print(Request('r', list(range(64)), hash_block_size=16, lora_name='x').block_hashes[-1].hex())"
)


def _child_hash(seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_hashes_agree_across_processes_only_with_a_fixed_seed():
    a, b = _child_hash("123"), _child_hash("123")
    assert len(a) == 32 and a == b
    assert _child_hash("124") != a
    assert _child_hash(None) != _child_hash(None)  # random seed per process


def test_none_hash_is_current_on_every_public_path_after_init(restore_seed):
    """Defect 5: ``mambakv.hashing.NONE_HASH`` (a 0.1 re-export) was a copy taken at import and
    went stale after ``init_none_hash()``. That module is gone; every module of the package that
    has a ``NONE_HASH`` must read the current seed digest, worked out here from the documented
    rule (xxh3-128 of ``b"mambakv-none-hash:" + str(seed)``), and a first block chains from it."""
    import importlib
    import pkgutil

    import mambakv

    init_none_hash(1234)
    expected = xxhash.xxh3_128_digest(b"mambakv-none-hash:1234")
    holders = []
    for info in pkgutil.walk_packages(mambakv.__path__, "mambakv."):
        if info.name.endswith("__main__"):  # runs the command
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (triton, zmq, matplotlib) not installed
            continue
        if hasattr(module, "NONE_HASH"):
            holders.append(info.name)
            assert module.NONE_HASH == expected, info.name
    assert holders == ["mambakv.core.hashing"]
    assert not hasattr(mambakv, "NONE_HASH")
    raw = np.asarray([5, 6], dtype="<i4").tobytes()
    assert hash_block_tokens(None, [5, 6]) == xxhash.xxh3_128_digest(expected + raw)
