"""The raw KV event stream (``take_events()``): one (group, hash) stored once, removed when its
group's last copy goes; Mamba states as chains with their tokens; LoRA id and name; group ids
on removals (project issue 19, part 1)."""

from __future__ import annotations

import random

import pytest

from mambakv import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, Request
from mambakv.core.errors import InvalidRequestError, InvalidTokenCountError
from tests.coord_helpers import coordinator, fa_spec, mamba_coordinator, step, sw_spec, tokens
from tests.event_driver import MiniEngine, StreamMirror, pool_hashed
from tests.helpers import mamba_spec
from tests.regressions.util import pool_snapshot


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_second_copy_is_not_stored_again_and_removed_only_with_the_last():
    pool = BlockPool(6, enable_kv_cache_events=True)
    b1, b2 = pool.get_new_blocks(2)  # blocks 1 and 2
    pool.cache_full_blocks([b1], [h(1)], 0, token_ids=[1, 2, 3, 4], block_size=4)
    pool.cache_full_blocks([b2], [h(1)], 0, token_ids=[1, 2, 3, 4], block_size=4)  # a second copy
    assert pool.take_events() == [BlockStored([h(1)], None, [1, 2, 3, 4], 4, None, group_id=0)]
    pool.free_blocks([b1, b2])
    pool.evict_blocks([1])  # block 2 still serves h(1): no event
    assert pool.take_events() == []
    assert pool.get_cached_block(h(1), [0]) == [b2]
    pool.evict_blocks([2])  # the last copy
    assert pool.take_events() == [BlockRemoved([h(1)], group_id=0)]
    pool.check_invariants()


def test_same_hash_in_two_groups_is_two_streams():
    pool = BlockPool(6, enable_kv_cache_events=True)
    a, m = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(1)], 0, token_ids=[0, 1], block_size=2)
    pool.cache_full_blocks([m], [h(1)], 1, token_ids=[0, 1], block_size=2)
    assert [(e.group_id, e.block_hashes) for e in pool.take_events()] == [(0, [h(1)]), (1, [h(1)])]
    pool.free_blocks([a, m])
    pool.evict_blocks([m.block_id])
    assert pool.take_events() == [BlockRemoved([h(1)], group_id=1)]
    assert pool.get_cached_block(h(1), [0]) == [a]  # the group-0 block is untouched


def test_runs_split_around_skipped_blocks():
    """[b1, b2 (h2 already served by b4), b3]: two chains, each with its own parent and tokens."""
    pool = BlockPool(8, enable_kv_cache_events=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.cache_full_blocks([b4], [h(2)], 0, parent_block_hash=h(1), token_ids=[5, 6], block_size=2)
    pool.take_events()
    pool.cache_full_blocks([b1, b2, b3], [h(1), h(2), h(3)], 0, parent_block_hash=h(9),
                           token_ids=[3, 4, 5, 6, 7, 8], block_size=2, lora_id=4, lora_name="x")
    assert pool.take_events() == [
        BlockStored([h(1)], h(9), [3, 4], 2, 4, group_id=0, lora_name="x"),
        BlockStored([h(3)], h(2), [7, 8], 2, 4, group_id=0, lora_name="x"),
    ]
    assert b2.block_hash == h(2)  # the copy is hashed and mapped all the same
    pool.check_invariants()


def test_token_ids_of_the_wrong_length_raise_before_any_change():
    pool = BlockPool(6, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    before = pool_snapshot(pool)
    with pytest.raises(InvalidTokenCountError):
        pool.cache_full_blocks(blocks, [h(1), h(2)], 0, token_ids=[1, 2, 3], block_size=2)
    assert pool_snapshot(pool) == before and pool.take_events() == []


def test_evicting_a_mamba_state_names_its_group_not_the_attention_block():
    """Full attention (group 0) + Mamba (group 1), block 4: after 8 tokens both groups hold
    key k1 (the state at 8 shares it with attention block 1). Evicting the state removes
    (1, k1) only."""
    coord = coordinator(16, fa_spec(4), mamba_spec(4), enable_kv_cache_events=True)
    pool = coord.block_pool
    req = Request("r", tokens(12))
    step(coord, req, 8)
    k = req.block_hashes
    ids = req.all_token_ids.tolist()
    assert pool.take_events() == [BlockStored([k[0], k[1]], None, ids[0:8], 4, None, group_id=0)]
    coord.retire("r", 8)  # the state at 8 is processed: published at slot 1
    assert pool.take_events() == [BlockStored([k[1]], k[0], ids[4:8], 4, None, group_id=1)]
    state = coord.get_block_ids("r")[1][1]
    pool.evict_blocks([state])
    assert pool.take_events() == [BlockRemoved([k[1]], group_id=1)]
    assert pool.get_cached_block(k[1], [0]) is not None  # attention block 1 still cached


def test_mamba_state_at_slot_2_carries_its_tokens_parent_and_lora():
    """Mamba block 4, chunks 8 + 4 of a 12-token prompt: the state at 12 (slot 2) is stored
    with tokens 8..11, parent k1, the request's LoRA id and name (vLLM #44451: not a root)."""
    coord = mamba_coordinator(4, enable_kv_cache_events=True)
    pool = coord.block_pool
    req = Request("r", tokens(12), lora_name="sql", lora_id=5)
    step(coord, req, 8)
    coord.retire("r", 8)
    step(coord, req, 4)
    coord.retire("r", 12)
    k = req.block_hashes
    ids = req.all_token_ids.tolist()
    assert pool.take_events() == [
        BlockStored([k[1]], k[0], ids[4:8], 4, 5, group_id=0, lora_name="sql"),
        BlockStored([k[2]], k[1], ids[8:12], 4, 5, group_id=0, lora_name="sql"),
    ]


def test_attention_blocks_carry_the_lora_id():
    coord = coordinator(8, fa_spec(2), enable_kv_cache_events=True)
    req = Request("r", [7, 8, 9, 10], lora_id=3)
    step(coord, req, 4)
    (ev,) = coord.block_pool.take_events()
    assert (ev.lora_id, ev.lora_name, ev.token_ids, ev.parent_block_hash) == (3, None, [7, 8, 9, 10], None)


@pytest.mark.parametrize("bad", [-1, True, "3", 1.0])
def test_bad_lora_id_raises(bad):
    with pytest.raises(InvalidRequestError):
        Request("r", [1, 2], lora_id=bad)


LAYOUTS = {
    "fa+mamba+mamba": (fa_spec(4), mamba_spec(4), mamba_spec(4, nspec=1)),
    "fa+sw+mamba": (fa_spec(4), sw_spec(4, 8), mamba_spec(4)),
    "fa+lazy": (fa_spec(4), mamba_spec(4, mode="align_lazy"), mamba_spec(4, mode="align_lazy")),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replayed_stream_is_exactly_the_hashed_blocks(layout):
    """Random hybrid traffic (shared prefixes, decode, preemptions, evictions, resets): after
    every step the replayed stream equals the pool's hashed (group, hash) set, each removal
    pairs with its store and each stored chain hashes back from its tokens."""
    rng = random.Random(19)
    coord = coordinator(24, *LAYOUTS[layout], enable_kv_cache_events=True, max_num_seqs=4)
    engine = MiniEngine(coord, 4, rng)
    mirror = StreamMirror()
    prefixes = [[rng.randrange(1, 40) for _ in range(24)] for _ in range(3)]
    for t in range(400):
        if rng.random() < 0.3:
            p = rng.choice(prefixes)
            engine.submit(p[: rng.randrange(4, 24)] + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 9))],
                          max_tokens=rng.randrange(0, 6), lora_id=rng.choice([None, 2]))
        engine.step()
        if t % 97 == 96:
            engine.preempt_all()
            assert coord.reset_prefix_cache()
        mirror.apply(coord.block_pool.take_events())
        assert mirror.stored == pool_hashed(coord.block_pool)
        coord.check_invariants()
    assert mirror.num_removed > 50 and mirror.num_cleared == 4 and engine.num_preemptions > 0
    assert mirror.groups_stored == {0, 1, 2}, mirror.groups_stored


def test_cleared_after_reset():
    pool = BlockPool(4, enable_kv_cache_events=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [h(1)], 2, token_ids=[1], block_size=1)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert [type(e) for e in pool.take_events()] == [BlockStored, AllBlocksCleared]
