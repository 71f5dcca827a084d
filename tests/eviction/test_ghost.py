"""GhostIndex: the bound, recency order, and a hypothesis comparison with a list model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mambakv.core.errors import InvalidSpecError
from mambakv.core.eviction import GhostIndex


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")  # a 16-byte "block hash"


def test_bound_drops_the_oldest_in_order() -> None:
    g: GhostIndex[str] = GhostIndex(3)
    dropped = [g.add(k(i), f"e{i}") for i in range(5)]
    g.check_invariants()
    # keys 0, 1, 2 fit; adding 3 drops 0, adding 4 drops 1
    assert dropped == [[], [], [], [(k(0), "e0")], [(k(1), "e1")]]
    assert g.items() == [(k(2), "e2"), (k(3), "e3"), (k(4), "e4")]
    assert len(g) == 3 and g.capacity == 3


def test_readd_replaces_and_makes_newest() -> None:
    g: GhostIndex[str] = GhostIndex(3)
    for i in range(3):
        g.add(k(i), f"e{i}")
    assert g.add(k(0), "new") == []  # 0 goes from oldest to newest: order 1 2 0, nothing dropped
    g.check_invariants()
    assert g.items() == [(k(1), "e1"), (k(2), "e2"), (k(0), "new")]
    assert g.add(k(3), "e3") == [(k(1), "e1")]  # now 1 is the oldest
    assert g.items() == [(k(2), "e2"), (k(0), "new"), (k(3), "e3")]


def test_pop_get_contains() -> None:
    g: GhostIndex[int] = GhostIndex(4)
    for i in range(3):
        g.add(k(i), i * 10)
    assert g.get(k(0)) == 0 and g.items()[0] == (k(0), 0)  # get does not move it
    assert k(1) in g and k(9) not in g and "x" not in g and 1 not in g
    assert g.pop(k(1)) == 10 and k(1) not in g and len(g) == 2
    assert g.pop(k(1)) is None and g.get(k(1)) is None
    g.check_invariants()
    assert g.items() == [(k(0), 0), (k(2), 20)]
    with pytest.raises(InvalidSpecError):
        g.add("not bytes", 1)  # type: ignore[arg-type]
    for call in (g.pop, g.get):
        with pytest.raises(InvalidSpecError):
            call(bytearray(b"x"))  # type: ignore[arg-type]
    assert g.items() == [(k(0), 0), (k(2), 20)]  # the failed calls changed nothing


def test_capacity_zero_keeps_nothing() -> None:
    g: GhostIndex[str] = GhostIndex(0)
    assert g.add(k(1), "a") == [(k(1), "a")]
    assert len(g) == 0 and k(1) not in g and g.items() == [] and g.clear() == []
    g.check_invariants()


def test_clear_returns_everything_oldest_first() -> None:
    g: GhostIndex[str] = GhostIndex(5)
    for i in (3, 1, 2):
        g.add(k(i), str(i))
    assert g.clear() == [(k(3), "3"), (k(1), "1"), (k(2), "2")]
    assert len(g) == 0 and g.items() == []
    g.check_invariants()


def test_items_is_a_copy() -> None:
    g: GhostIndex[str] = GhostIndex(2)
    g.add(k(0), "a")
    g.items().clear()
    assert len(g) == 1


@pytest.mark.parametrize("capacity", [-1, 1.0, True, "3", None])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises(InvalidSpecError):
        GhostIndex(capacity)  # type: ignore[arg-type]


ops = st.lists(st.tuples(st.sampled_from(["add", "pop", "get"]), st.integers(0, 7), st.integers()), max_size=60)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(capacity=st.integers(0, 5), ops=ops)
def test_matches_a_list_model(capacity: int, ops: list[tuple[str, int, int]]) -> None:
    g: GhostIndex[int] = GhostIndex(capacity)
    model: list[tuple[bytes, int]] = []  # oldest first
    for op, i, value in ops:
        key = k(i)
        old = next((e for kk, e in model if kk == key), None)
        if op == "add":
            model = [(kk, e) for kk, e in model if kk != key] + [(key, value)]
            expected_dropped = model[:max(0, len(model) - capacity)]
            model = model[len(expected_dropped):]
            assert g.add(key, value) == expected_dropped
        elif op == "pop":
            assert g.pop(key) == old
            model = [(kk, e) for kk, e in model if kk != key]
        else:
            assert g.get(key) == old
        g.check_invariants()
        assert g.items() == model and len(g) == len(model)
        assert all((kk in g) == any(kk == m for m, _ in model) for kk in map(k, range(8)))
    assert g.clear() == model and len(g) == 0
