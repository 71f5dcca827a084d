"""A Mamba state published before it is written (vLLM #56525, #56524).

vLLM #56525 / #56524: a state block was hashed when its step was *scheduled*; a request freed
(aborted, preempted) before that step ran left a hit pointing at a block that never received
the state, and a later request resumed from garbage. The rule (DESIGN.md 5.1, publication): a
state is published only once the engine reports its position processed; a block that is
reused starts either zeroed in the state pool (``take_zero_plan``) or from a copy of a
published state, never from what a previous owner left in it.
"""

from __future__ import annotations

import torch

from mambakv import MambaStatePool, Request

from .util import admit, coordinator, hashed_ids, mamba, queue_ids, tokens


def test_freed_before_processed_publishes_nothing():
    # Mamba B = 16, N = 8 (blocks 1..7). A scheduled for [0, 16): running slot 0 = block 1.
    spec = mamba(16)
    coord = coordinator(8, spec)
    states = MambaStatePool(spec, 1, 8, "cpu")
    a = Request("a", tokens(16))
    coord.allocate(a, 16)
    assert coord.get_block_ids("a") == ([1],) and coord.take_zero_plan() == {0: [1]}
    states.zero_([1])
    states.conv_state(0)[1].fill_(3.0)          # A's step ran part way: half-written garbage
    coord.free("a")                             # before 16 tokens were ever reported processed
    assert hashed_ids(coord.block_pool) == []   # nothing published
    assert queue_ids(coord.block_pool)[0] == 1  # unhashed -> head: the next block handed out
    b = Request("b", tokens(16) + tokens(4, start=9000))
    hit, new = admit(coord, b)                  # cap 19 -> 16: no state at 16 exists
    assert hit == 0 and coord.get_block_ids("b") == ([0, 1],)  # running slot cdiv(20, 16) - 1 = 1
    zero = coord.take_zero_plan()
    assert zero == {0: [1]} and coord.take_copy_plan() == {}    # reported as no initial state
    states.zero_(zero[0])
    assert torch.count_nonzero(states.conv_state(0)[1]) == 0
    coord.check_invariants()


def test_pending_zeroing_of_a_freed_request_is_dropped_not_duplicated():
    # A is allocated and freed within one scheduling pass (its plan never taken): A's zeroing
    # of block 1 is dropped; B, reusing block 1, reports it once.
    coord = coordinator(8, mamba(16))
    coord.allocate(Request("a", tokens(16)), 16)
    coord.free("a")
    assert coord.take_zero_plan() == {}
    admit(coord, Request("b", tokens(20)))
    assert coord.take_zero_plan() == {0: [1]}


def test_in_flight_chunk_of_a_freed_request_is_not_a_hit():
    # Async: A's chunks [0, 16) and [16, 32) are scheduled; only the first is processed
    # (retire(16) publishes block 1, the state at 16); A is freed before retire(32).
    coord = coordinator(8, mamba(16))
    a = Request("a", tokens(40))
    coord.allocate(a, 16)
    a.num_computed_tokens = 16
    coord.allocate(a, 16)                       # running slot 1 = block 2, copy 1 -> 2
    a.num_computed_tokens = 32
    coord.retire("a", 16)
    assert hashed_ids(coord.block_pool) == [1]
    coord.free("a")
    assert hashed_ids(coord.block_pool) == [1]  # block 2 (state at 32) was never settled
    b = Request("b", tokens(36))
    hit, _ = admit(coord, b)                    # cap 35 -> 32: no state at 32; state at 16 hits
    # A's table [1, 2] freed reversed: 2 (unhashed) -> head, 1 -> tail. B: running slot
    # cdiv(36, 16) - 1 = 2, pad slot 1 with null, new block 2: [1, null, 2].
    assert hit == 16 and coord.get_block_ids("b") == ([1, 0, 2],)
    # One copy, B's own (A's pending copy 1 -> 2 was dropped with A).
    assert coord.take_copy_plan() == {0: [(1, 2)]}
    coord.check_invariants()
