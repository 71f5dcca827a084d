"""The unit index keeps its tree by segments: runs of single-child pages, split on demand.

Geometry and harness of tests/eviction/test_units.py (4-token pages; a 13-token prompt leaves
pages 0..2 and its checkpoint at page 2). Every expected shape below is worked out by hand from
the chains' tokens.
"""

from __future__ import annotations

import types

import pytest

from mambakv.core.units import Segment, UnitIndex
from tests.eviction.test_units import A, B, Harness

F = A[:8] + list(range(400, 405))  # shares A's pages 0, 1; its page 2 differs: a branch after page 1
# F's prefill ends a chunk at the junction with A's chain (8 tokens, the junction placement rule),
# so F also checkpoints page 1: F leaves units at pages 1 and 2.


def shape(units: UnitIndex) -> list[tuple[int, int, bool, int]]:
    """(first page, last page, has a unit, number of kids) per segment, sorted."""
    return sorted((s.start, s.end, s.unit is not None, len(s.children)) for s in units.segments())


def test_a_chain_is_one_segment_per_unit() -> None:
    h = Harness(12)
    h.run("A", A, 0.0)
    units = h.coord.units
    assert shape(units) == [(0, 2, True, 0)]  # pages 0..2, its checkpoint at 2: one object
    h.run("B", B, 10.0)  # A's next turn: pages 3, 4 and a checkpoint at 4 below A's unit
    assert shape(units) == [(0, 2, True, 1), (3, 4, True, 0)]
    assert units.num_pages == 5
    assert [u.index for u in units.live_units()] == [2, 4]


def test_a_branch_inside_a_segment_splits_it() -> None:
    h = Harness(12)
    h.run("A", A, 0.0)
    units = h.coord.units
    (a_unit,) = units.live_units()
    assert h.run("F", F, 10.0) == 0  # no state at page 1 yet: no hit; F's pages 0, 1 are A's
    # A's [0..2] splits after page 1 (F's junction unit ends it): [0 1]* with two kids, A's [2]*
    # (its unit moves with it) and F's [2]*
    assert shape(units) == [(0, 1, True, 2), (2, 2, True, 0), (2, 2, True, 0)]
    assert a_unit.node is not None and a_unit.node.start == 2 and a_unit.leaf
    assert units.num_pages == 4
    h.coord.check_invariants()


def test_evicting_both_branches_prunes_the_shared_pages() -> None:
    h = Harness(12)
    h.run("A", A, 0.0)
    h.run("F", F, 10.0)
    units = h.coord.units
    junction, f_unit, a_unit = sorted(units.live_units(), key=lambda u: (-u.last_use, u.index))
    assert (junction.index, f_unit.index, a_unit.index) == (1, 2, 2)
    assert units.evict_unit(f_unit) == (1, 1)  # F's page 2 and its state; [0 1]* keeps A's branch
    h.coord.check_invariants()
    assert shape(units) == [(0, 1, True, 1), (2, 2, True, 0)] and not junction.leaf
    assert units.evict_unit(a_unit) == (1, 1)  # A's page 2; [0 1]* has no child left: a leaf
    h.coord.check_invariants()
    assert shape(units) == [(0, 1, True, 0)] and junction.leaf
    # pages 1, 0 go, two copies each: F had no hit, so it computed and cached them again
    assert units.evict_unit(junction) == (4, 1)
    h.coord.check_invariants()
    assert units.num_pages == 0 and shape(units) == []


def test_checkpoints_and_chain_keys_cross_segments() -> None:
    h = Harness(12)
    h.run("A", A, 0.0)
    h.run("B", B, 10.0)
    units = h.coord.units
    keys = units.chain_keys(units.unit_at(next(u.key for u in units.live_units() if u.index == 4)).key)  # type: ignore[union-attr]
    assert len(keys) == 5 and all(units.has_page(k) for k in keys)
    assert units.checkpoints(keys) == [2, 4]
    assert units.checkpoints(keys[:4]) == [2]  # page 3 is inside B's segment: B's unit is past it
    assert units.checkpoints(keys[:2]) == []


def test_a_misindexed_page_is_caught() -> None:
    h = Harness(12)
    h.run("A", A, 0.0)
    h.run("B", B, 10.0)
    units = h.coord.units
    first = next(iter(units.where))
    units.where[first] = Segment([first], 0, None)  # the page points at a segment outside the tree
    with pytest.raises(AssertionError, match="indexed to another segment"):
        h.coord.check_invariants()


def test_a_split_that_forgets_the_index_is_caught() -> None:
    """A planted bug through the instance: the split moves pages into the new segment but leaves
    ``where`` pointing at the old one."""
    h = Harness(12)
    h.run("A", A, 0.0)
    units = h.coord.units

    def forgetful_split(self: UnitIndex, seg: Segment, i: int) -> Segment:
        saved = dict(self.where)
        UnitIndex._split(self, seg, i)
        self.where.update(saved)
        return seg

    units._split = types.MethodType(forgetful_split, units)  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="indexed to another segment"):
        h.run("F", F, 10.0)
