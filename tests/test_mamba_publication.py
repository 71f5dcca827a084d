"""Publication of Mamba states (DESIGN.md 5.1, "Caching: publish a state only where and when
it is known"), through the coordinator with one Mamba align group."""

from __future__ import annotations

from mambakv import Request
from tests.coord_helpers import free_queue_ids, mamba_coordinator, prefill, snapshot, step, tokens


def hashed_blocks(coord) -> list[int]:
    return [b.block_id for b in coord.block_pool.blocks if b.block_hash is not None]


def test_chunk_ending_off_a_boundary_publishes_nothing():
    # block 544, chunks of 256: the state after 256 and 512 both sit in slot 0 (boundary 544),
    # the state after 768 in slot 1 (boundary 1088): no tag equals its slot's boundary.
    coord = mamba_coordinator(544, max_model_len=2000)
    req = Request("a", tokens(1200))
    prefill(coord, req, [256, 512, 768])
    assert hashed_blocks(coord) == []
    coord.free("a")
    assert hashed_blocks(coord) == []
    assert coord.get_computed_blocks(Request("b", tokens(1200)))[1] == 0
    # teeth: the same prompt with a chunk ending on 544 publishes slot 0
    coord2 = mamba_coordinator(544, max_model_len=2000)
    req2 = Request("a", tokens(1200))
    prefill(coord2, req2, [544, 768])
    assert len(hashed_blocks(coord2)) == 1
    assert coord2.get_computed_blocks(Request("b", tokens(1200)))[1] == 544


def test_state_not_hashed_before_its_position_is_processed():
    # block 4; two chunks in flight: [0, 8) -> slot 1 (state at 8), [8, 16) -> slot 3 (state at 16)
    coord = mamba_coordinator(4)
    req = Request("a", tokens(20))
    step(coord, req, 8)
    step(coord, req, 8)
    table = coord.managers[0].req_to_blocks["a"]
    s1, s3 = table[1], table[3]
    assert hashed_blocks(coord) == []  # allocation publishes no state
    coord.retire("a", 8)               # the first chunk is done: its state at 8 is known
    assert s1.block_hash == req.block_hashes[1] and s3.block_hash is None
    coord.retire("a", 16)
    assert s3.block_hash == req.block_hashes[3]
    coord.check_invariants()


def test_aborted_request_publishes_nothing():
    coord = mamba_coordinator(4)
    req = Request("a", tokens(20))
    step(coord, req, 16)
    coord.free("a")  # its step never ran
    assert hashed_blocks(coord) == []
    coord.check_invariants()


def test_retire_to_boundary_then_past_leaves_hashed_free_hittable_block():
    # block 4: chunk to 8 (slot 1), retire 8 -> slot 1 published (still the running block);
    # chunk to 12 (slot 2, copy 1 -> 2), retire 12: slot 2 published, then 11 // 4 = 2 slots
    # retire -> slot 1 is freed, keeps its hash, goes to the LRU tail.
    coord = mamba_coordinator(4)
    req = Request("a", tokens(20))
    prefill(coord, req, [8, 12])
    s1 = next(b for b in coord.block_pool.blocks if b.block_hash == req.block_hashes[1])
    assert s1.ref_cnt == 0 and free_queue_ids(coord)[-1] == s1.block_id
    # a 10-token prompt with the same first 8 tokens: cap 9 -> the state at 8 is the hit
    b = Request("b", tokens(8) + [7, 7])
    hit, n = coord.get_computed_blocks(b)
    assert n == 8 and hit.blocks[0] == [coord.block_pool.null_block, s1]
    step(coord, b, 2, num_new_computed_tokens=8, new_computed_blocks=hit)
    assert s1.ref_cnt == 1  # touched
    # its running block (slot cdiv(10, 4) - 1 = 2) starts from a copy of the hit state
    running = coord.managers[0].req_to_blocks["b"][2]
    assert coord.take_copy_plan() == {0: [(s1.block_id, running.block_id)]}
    assert coord.take_zero_plan() == {}


def test_publish_before_retire_in_one_call():
    # block 4: chunks to 8 and 12 both in flight, then one retire(12): slot 1 (state at 8) is
    # published and retired in the same call -> it reaches the free queue hashed, at the tail.
    # Retiring first would drop its tag and lose the state.
    coord = mamba_coordinator(4)
    req = Request("a", tokens(20))
    step(coord, req, 8)
    step(coord, req, 4)
    s1 = coord.managers[0].req_to_blocks["a"][1]
    coord.retire("a", 12)
    assert s1.ref_cnt == 0 and s1.block_hash == req.block_hashes[1]
    assert free_queue_ids(coord)[-1] == s1.block_id
    assert coord.get_computed_blocks(Request("b", tokens(9)))[0].blocks[0][-1] is s1
    coord.check_invariants()


def test_relocated_and_scratch_blocks_unhashed_ref_one():
    # block 4, nspec 2: chunk to 8 -> [0, R, s, s]; chunk to 16 -> running slot 3: scratch at
    # slot 2 lies below it and moves to the end: [0, R, 0, s(3), s(2)->4, new 5].
    coord = mamba_coordinator(4, nspec=2)
    req = Request("a", tokens(20))
    step(coord, req, 8)
    old_scratch = coord.managers[0].req_to_blocks["a"][2]
    coord.retire("a", 8)
    step(coord, req, 8)
    coord.retire("a", 16)
    table = coord.managers[0].req_to_blocks["a"]
    assert [b.is_null for b in table] == [True, True, True, False, False, False]
    assert table[4] is old_scratch  # relocated, not a new block
    assert table[3].block_hash == req.block_hashes[3]  # the running state at 16 is published
    for b in table[4:]:
        assert b.ref_cnt == 1 and b.block_hash is None
    coord.check_invariants()


def test_retire_zero_and_unknown_request_are_noops():
    coord = mamba_coordinator(4)
    req = Request("a", tokens(20))
    step(coord, req, 8)
    before = snapshot(coord, ["a"])
    coord.retire("a", 0)
    coord.retire("ghost", 12)
    coord.free("ghost")
    assert snapshot(coord, ["a"]) == before
