"""Request: token buffer, block hashes kept current, extra keys (DESIGN.md section 4, mambakv/request.py).

Reference digests are rebuilt with ``hash_block_tokens`` block by block (the per-block formula is
checked against raw xxh3 in test_hashing.py), so these tests pin down *which* blocks carry which
extra key and how the chain continues, not the key encoding.
"""

from __future__ import annotations

import numpy as np
import pytest

import mambakv.core.request as request_mod
from mambakv import (
    HashBlockSizeMismatchError,
    InvalidRequestError,
    InvalidTokenCountError,
    MambaKVError,
    Request,
    hash_block_tokens,
)
from mambakv.groups.base import BlockHashView, group_block_hashes


def chain(tokens, bs: int, keys=None, parent=None) -> list[bytes]:
    """hash_block_tokens block by block; ``keys[j]`` (a tuple or None) for block j."""
    out, p = [], parent
    for j in range(len(tokens) // bs):
        p = hash_block_tokens(p, list(tokens[j * bs : (j + 1) * bs]), keys[j] if keys else None)
        out.append(p)
    return out


TOKS = [(7 * i + 3) % 1000 for i in range(64)]


def test_basic_fields_and_full_blocks_only():
    r = Request("r", TOKS[:35], hash_block_size=16)
    assert (r.request_id, r.num_tokens, r.num_prompt_tokens, r.num_computed_tokens) == ("r", 35, 35, 0)
    assert list(r.all_token_ids) == TOKS[:35]
    assert r.block_hashes == chain(TOKS[:35], 16)  # 35 // 16 = 2 full blocks; the partial 3 tokens are not hashed
    assert len(r.block_hashes) == 2
    assert Request("s", TOKS[:15], hash_block_size=16).block_hashes == []


def test_list_int32_int64_prompts_hash_equally():
    a = Request("a", TOKS, hash_block_size=8).block_hashes
    b = Request("b", np.array(TOKS, dtype=np.int32), hash_block_size=8).block_hashes
    c = Request("c", np.array(TOKS, dtype=np.int64), hash_block_size=8).block_hashes
    assert len(a) == 8 and a == b == c == chain(TOKS, 8)


@pytest.mark.parametrize("bad", [
    [1, 2**31], [-(2**31) - 1, 0], np.array([2**40], dtype=np.int64),
    [1.9, 2.0], [3, 4.0], [-1, 5], [2**32], np.array([7, -1], dtype=np.int32), np.array([0.0, 1.0]),
])
def test_prompt_ids_outside_0_to_int32_max_or_not_ints_raise(bad):
    # [1.9, 2.0] was silently truncated to [1, 2] by np.fromiter
    with pytest.raises(InvalidTokenCountError):
        Request("r", bad, hash_block_size=4)


def test_largest_id_accepted_and_int32_array_used_as_is():
    r = Request("r", [0, 2**31 - 1], hash_block_size=2)
    assert r.all_token_ids.tolist() == [0, 2**31 - 1]
    arr = np.array([5, 6, 7], dtype=np.int32)
    assert np.shares_memory(Request("s", arr).all_token_ids, arr)  # not copied (caller must not mutate it)


@pytest.mark.parametrize("rid", [1, None, b"r", ("r",)])
def test_request_id_must_be_str(rid):
    with pytest.raises(InvalidRequestError) as e:
        Request(rid, [1, 2])
    assert isinstance(e.value, MambaKVError)


@pytest.mark.parametrize("max_tokens", [-1, 1.5, "3", True])
def test_bad_max_tokens_raise(max_tokens):
    with pytest.raises(InvalidRequestError):
        Request("r", [1, 2], max_tokens=max_tokens)


def test_max_tokens_none_zero_and_numpy_int_accepted():
    assert Request("r", [1], max_tokens=None).max_tokens is None
    assert Request("r", [1], max_tokens=0).max_tokens == 0
    assert Request("r", [1], max_tokens=np.int64(7)).max_tokens == 7


@pytest.mark.parametrize("empty", [[], np.array([], dtype=np.int32), np.array([], dtype=np.int64)])
def test_empty_prompt_raises(empty):
    with pytest.raises(InvalidTokenCountError) as e:
        Request("r", empty)
    assert isinstance(e.value, MambaKVError)


@pytest.mark.parametrize("hbs", [0, -16, 2.5])
def test_bad_hash_block_size_raises(hbs):
    with pytest.raises(HashBlockSizeMismatchError):
        Request("r", TOKS, hash_block_size=hbs)


def test_bad_mm_items_raise():
    with pytest.raises(InvalidTokenCountError):
        Request("r", TOKS, mm_hashes=[(-1, 2, "img")])
    with pytest.raises(InvalidTokenCountError):
        Request("r", TOKS, mm_hashes=[(4, 0, "img")])


def test_hash_block_size_adoption():
    r = Request("r", TOKS[:20])
    assert r.hash_block_size is None
    assert r.block_hashes == []  # unknown size: nothing hashed yet
    r.set_hash_block_size(8)
    assert r.hash_block_size == 8
    r.set_hash_block_size(8)  # same size again is fine
    with pytest.raises(HashBlockSizeMismatchError) as e:
        r.set_hash_block_size(16)
    assert isinstance(e.value, MambaKVError)
    assert r.hash_block_size == 8
    assert r.block_hashes == chain(TOKS[:20], 8)
    fixed = Request("f", TOKS[:20], hash_block_size=4)
    with pytest.raises(HashBlockSizeMismatchError):
        fixed.set_hash_block_size(8)
    assert fixed.hash_block_size == 4


def test_incremental_hashing_only_new_blocks(monkeypatch):
    calls = []
    real = request_mod.hash_blocks

    def spy(tokens, bs, start, stop, parent, extra=None):
        calls.append((start, stop))
        return real(tokens, bs, start, stop, parent, extra)

    monkeypatch.setattr(request_mod, "hash_blocks", spy)
    r = Request("r", TOKS[:20], hash_block_size=4)
    r.num_computed_tokens = 20  # the prompt was scheduled: outputs may come
    first = r.block_hashes
    assert len(first) == 5 and calls == [(0, 5)]  # 20 // 4
    kept = list(first)
    r.append_output_token_ids(TOKS[20:23])  # 23 tokens: still 5 full blocks
    assert r.block_hashes == kept and calls == [(0, 5)]
    r.append_output_token_ids(TOKS[23])  # one id as an int: 24 -> block 5 completes
    assert len(r.block_hashes) == 6 and calls == [(0, 5), (5, 6)]
    r.append_output_token_ids(np.array(TOKS[24:33], dtype=np.int64))  # 33 -> blocks 6, 7
    assert len(r.block_hashes) == 8 and calls[-1] == (6, 8)
    assert r.block_hashes[:5] == kept  # earlier digests untouched
    assert r.block_hashes == Request("all", TOKS[:33], hash_block_size=4).block_hashes == chain(TOKS[:33], 4)
    assert r.num_tokens == 33 and r.num_prompt_tokens == 20 and list(r.all_token_ids) == TOKS[:33]


def test_append_grows_buffer_beyond_prompt_array():
    prompt = np.array(TOKS[:5], dtype=np.int32)
    r = Request("r", prompt, hash_block_size=4)
    r.num_computed_tokens = 5
    for t in TOKS[5:40]:
        r.append_output_token_ids(t)
    assert list(r.all_token_ids) == TOKS[:40]
    assert list(prompt) == TOKS[:5]  # the caller's array is never written
    assert r.block_hashes == chain(TOKS[:40], 4)


def test_append_out_of_range_changes_nothing():
    r = Request("r", TOKS[:8], hash_block_size=4)
    r.num_computed_tokens = 8
    before = list(r.block_hashes)
    for bad in ([5, 2**31], [5, -1], -1, 2**31, 1.5, [2, 3.7], np.array([4, -2], dtype=np.int32)):
        with pytest.raises(InvalidTokenCountError):
            r.append_output_token_ids(bad)
        assert r.num_tokens == 8 and list(r.all_token_ids) == TOKS[:8] and r.block_hashes == before


def test_lora_changes_every_block():
    plain = Request("p", TOKS[:16], hash_block_size=4).block_hashes
    lora = Request("l", TOKS[:16], hash_block_size=4, lora_name="a").block_hashes
    other = Request("o", TOKS[:16], hash_block_size=4, lora_name="b").block_hashes
    assert all(x != y for x, y in zip(plain, lora))
    assert all(x != y for x, y in zip(lora, other))
    # the adapter is a key of every block itself, not only of the first: block 2 from block 1's
    # digest without keys differs from the request's block 2
    assert lora[2] != hash_block_tokens(lora[1], TOKS[8:12])


def test_cache_salt_only_in_first_block():
    plain = Request("p", TOKS[:16], hash_block_size=4).block_hashes
    salted = Request("s", TOKS[:16], hash_block_size=4, cache_salt="tenant-1").block_hashes
    other = Request("t", TOKS[:16], hash_block_size=4, cache_salt="tenant-2").block_hashes
    assert salted[0] != plain[0] and salted[0] != other[0]
    # blocks 1.. carry no salt of their own: they are the plain chain continued from salted[0]
    assert salted[1:] == chain(TOKS[4:16], 4, parent=salted[0])
    assert salted[1] != plain[1]  # (different only through the chain)


def test_mm_hash_only_in_overlapping_blocks():
    # hash block 4; item covers tokens [5, 7) -> only block 1 ([4, 8)) carries its key
    plain = Request("p", TOKS[:16], hash_block_size=4).block_hashes
    mm = Request("m", TOKS[:16], hash_block_size=4, mm_hashes=[(5, 2, "img-A")]).block_hashes
    mm_b = Request("n", TOKS[:16], hash_block_size=4, mm_hashes=[(5, 2, "img-B")]).block_hashes
    assert mm[0] == plain[0]  # block 0 ([0, 4)) does not overlap
    assert mm[1] != plain[1] and mm[1] != mm_b[1]  # the key is in block 1; content matters
    assert mm[1] != hash_block_tokens(plain[0], TOKS[4:8])
    assert mm[2:] == chain(TOKS[8:16], 4, parent=mm[1])  # blocks 2, 3: no key, differ only by chain


def test_mm_item_spanning_two_blocks():
    # item [3, 5) overlaps block 0 (token 3) and block 1 (token 4); block 2 [8, 12) untouched
    plain = Request("p", TOKS[:12], hash_block_size=4).block_hashes
    mm = Request("m", TOKS[:12], hash_block_size=4, mm_hashes=[(3, 2, "img")]).block_hashes
    assert mm[0] != plain[0]
    assert mm[1] != hash_block_tokens(mm[0], TOKS[4:8])  # own key in block 1 too
    assert mm[2] == hash_block_tokens(mm[1], TOKS[8:12])  # none in block 2
    # an item ending exactly at a boundary ([4, 8)) stays out of block 2
    edge = Request("e", TOKS[:12], hash_block_size=4, mm_hashes=[(4, 4, "img")]).block_hashes
    assert edge[0] == plain[0] and edge[1] != plain[1]
    assert edge[2] == hash_block_tokens(edge[1], TOKS[8:12])


def test_coarse_group_keys_from_fine_hashes():
    r = Request("r", TOKS[:50], hash_block_size=4)  # 12 fine blocks
    keys = group_block_hashes(r, 16)  # ratio 4: 3 coarse blocks
    fine = r.block_hashes
    assert isinstance(keys, BlockHashView)
    assert list(keys) == [fine[3], fine[7], fine[11]]
    assert group_block_hashes(r, 4) == fine
    with pytest.raises(HashBlockSizeMismatchError):
        group_block_hashes(r, 6)  # not a multiple of 4
    fresh = Request("f", TOKS[:50])
    assert list(group_block_hashes(fresh, 16)) == chain(TOKS[:50], 16)  # adopts 16
    assert fresh.hash_block_size == 16
