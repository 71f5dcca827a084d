"""The shared empty result (``allocate`` for a step that takes no block, ``get_computed_blocks``
for a miss) refuses additions: one caller's change would otherwise show in every later result."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from mambakv import KVCacheBlocks, ReadOnlyResultError, Request
from tests.coord_helpers import coordinator, fa_spec, step, tokens


def _changes(lst):
    null = object()
    return [lambda: lst.append(null), lambda: lst.extend([null]), lambda: lst.insert(0, null),
            lambda: lst.__setitem__(slice(0, 0), [null]), lambda: lst.__iadd__([null]),
            lambda: lst.__init__([null])]  # (a refill through __init__: found by a new-user review)


def test_a_step_without_new_blocks_shares_one_result_that_refuses_additions() -> None:
    coord = coordinator(16, fa_spec(4))
    a, b = Request("a", tokens(5)), Request("b", tokens(5, start=2000))
    step(coord, a, 5)  # 5 tokens: 2 blocks of 4, room up to 8
    step(coord, b, 5)
    out_a = coord.allocate(a, 1, num_draft_tokens=0)  # token 6 fits block 2: no new block
    out_b = coord.allocate(b, 1, num_draft_tokens=0)
    assert out_a is out_b and out_a.get_block_ids() == ([],)
    for change in _changes(out_a.blocks[0]):
        with pytest.raises(ReadOnlyResultError):
            change()
    with pytest.raises(ReadOnlyResultError):
        shared = out_a.blocks[0]
        shared += [coord.block_pool.null_block]
    assert out_b.get_block_ids() == ([],)  # nothing leaked into the other request's result
    assert out_a.blocks[0] + [1] == [1] and list(out_a.blocks[0]) == []  # reading and copying work
    coord.check_invariants()


def test_a_miss_returns_the_shared_result_and_its_lists_refuse_additions() -> None:
    coord = coordinator(16, fa_spec(4))
    hit_a, n_a = coord.get_computed_blocks(Request("a", tokens(9)))
    hit_b, n_b = coord.get_computed_blocks(Request("b", tokens(9, start=5000)))
    assert (n_a, n_b) == (0, 0) and hit_a is hit_b
    with pytest.raises(ReadOnlyResultError):
        hit_a.blocks[0].extend([coord.block_pool.null_block])
    assert coord.get_computed_blocks(Request("c", tokens(9, start=9000)))[0].get_block_ids() == ([],)
    coord.check_invariants()


def test_the_shared_result_is_not_rebound_and_fresh_results_are_plain_lists() -> None:
    coord = coordinator(16, fa_spec(4))
    a = Request("a", tokens(5))
    out = step(coord, a, 5)
    assert type(out.blocks[0]) is list and out.get_block_ids() == ([1, 2],)
    shared = KVCacheBlocks.shared_empty(2)
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError: results are frozen
        shared.blocks = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del shared.blocks  # type: ignore[misc]
    with pytest.raises(TypeError):  # slotted: no __dict__ to write the field into
        vars(shared)
    assert shared == KVCacheBlocks(([], [])) and shared.get_block_ids() == ([], [])


def test_copies_of_the_shared_lists_are_plain_lists() -> None:
    """The way out that the error names (copy, then change), by every copying route."""
    shared = KVCacheBlocks.shared_empty(2)
    lists = [list(shared.blocks[0]), copy.copy(shared.blocks[0]), copy.deepcopy(shared.blocks[0]),
             pickle.loads(pickle.dumps(shared.blocks[0])), *copy.deepcopy(shared).blocks,
             *pickle.loads(pickle.dumps(shared)).blocks]
    for lst in lists:
        assert type(lst) is list and lst == []
        lst.append(1)
    mine = dataclasses.replace(shared, blocks=tuple(list(b) for b in shared.blocks))
    mine.blocks[1].append(2)
    assert mine.blocks == ([], [2]) and shared.blocks == ([], [])
