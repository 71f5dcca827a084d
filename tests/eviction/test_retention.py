"""Retention hints: parse_retention, Retention.tier_at / stronger, Request.retain, oracle_retention."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mambakv import Request
from mambakv.core.errors import InvalidRequestError
from mambakv.core.retention import HIGH, LOW, NORMAL, Retention, parse_retention
from mambakv.sim.conversation import Link, Relation, oracle_retention
from mambakv.sim.workloads import RequestSpec, fixed_prompt


def test_tier_constants():
    assert (LOW, NORMAL, HIGH) == (0, 1, 2)


@pytest.mark.parametrize(("value", "expected"), [
    (None, Retention(NORMAL)),
    ("low", Retention(LOW)),
    ("normal", Retention(NORMAL)),
    ("high", Retention(HIGH)),
    ("HIGH", Retention(HIGH)),          # names are case-insensitive (value.lower())
    ("Low", Retention(LOW)),
    (15, Retention(HIGH, 15.0)),        # a ttl: high until idle 15 s
    (0.5, Retention(HIGH, 0.5)),
    (np.float64(2.0), Retention(HIGH, 2.0)),  # a float subclass
    (Retention(LOW), Retention(LOW)),   # passed through
    (Retention(HIGH, 3.0), Retention(HIGH, 3.0)),
])
def test_parse_retention_ok(value, expected):
    got = parse_retention(value)
    assert got == expected
    assert got.ttl is None or type(got.ttl) is float


@pytest.mark.parametrize("value", ["medium", "", 0, -1, 0.0, -0.5, math.nan, math.inf, -math.inf, True, False,
                                   [1], b"low", object()])
def test_parse_retention_bad(value):
    with pytest.raises(InvalidRequestError):
        parse_retention(value)


def test_tier_at():
    assert Retention(LOW).tier_at(1e9) == LOW          # no ttl: the tier whatever the idle time
    assert Retention(NORMAL).tier_at(0.0) == NORMAL
    assert Retention(HIGH).tier_at(1e9) == HIGH
    ttl = Retention(HIGH, 15.0)
    assert ttl.tier_at(0.0) == HIGH
    assert ttl.tier_at(14.999) == HIGH                 # idle < ttl
    assert ttl.tier_at(15.0) == NORMAL                 # idle >= ttl: decays to normal
    assert ttl.tier_at(100.0) == NORMAL


def test_stronger():
    low, normal, high = Retention(LOW), Retention(NORMAL), Retention(HIGH)
    t10, t20 = Retention(HIGH, 10.0), Retention(HIGH, 20.0)
    # different tiers: the higher one, in either order
    assert low.stronger(normal) is normal and normal.stronger(low) is normal
    assert normal.stronger(high) is high and high.stronger(low) is high
    assert normal.stronger(t10) is t10 and t10.stronger(normal) is t10
    # same tier, one without ttl: the one without (forever)
    assert high.stronger(t10) is high and t10.stronger(high) is high
    # same tier, neither with ttl: self
    other = Retention(NORMAL)
    assert normal.stronger(other) is normal and other.stronger(normal) is other
    # both ttl: the longer; equal: self
    assert t10.stronger(t20) is t20 and t20.stronger(t10) is t20
    t10b = Retention(HIGH, 10.0)
    assert t10.stronger(t10b) is t10 and t10b.stronger(t10) is t10b


def test_request_retain_init_and_setter():
    r = Request("r", [1, 2, 3])
    assert r.retain == Retention(NORMAL)
    assert Request("r", [1], retain="low").retain == Retention(LOW)
    assert Request("r", [1], retain=30).retain == Retention(HIGH, 30.0)
    r.retain = "high"
    assert r.retain == Retention(HIGH)
    r.retain = 2.5
    assert r.retain == Retention(HIGH, 2.5)
    r.retain = None
    assert r.retain == Retention(NORMAL)


@pytest.mark.parametrize("bad", ["medium", 0, -1, math.nan, True])
def test_request_retain_bad(bad):
    with pytest.raises(InvalidRequestError):
        Request("r", [1, 2, 3], retain=bad)
    r = Request("r", [1, 2, 3], retain="low")
    with pytest.raises(InvalidRequestError):
        r.retain = bad
    assert r.retain == Retention(LOW)  # unchanged


def _spec(i: int) -> RequestSpec:
    return RequestSpec(f"r{i}", 100.0 * i, 8, 1, fixed_prompt(np.arange(8, dtype=np.int32)))


def test_oracle_retention():
    specs = [_spec(i) for i in range(6)]
    links = [
        Link(Relation.NONE, 0, None, None),        # 0: first
        Link(Relation.NEXT_TURN, 3, 0, 0),         # 1: next turn of 0 -> 0 high
        Link(Relation.NONE, 1, 1, None),           # 2: shares only the first block with 1: NONE -> 1 not reused by it
        Link(Relation.BRANCH, 2, 1, None),         # 3: a branch of 1 -> 1 high
        Link(Relation.REPEAT, 4, 3, 3),            # 4: repeats 3 -> 3 high
        Link(Relation.NONE, 0, None, None),        # 5: nothing
    ]
    out = oracle_retention(specs, links)
    assert [s.retain for s in out] == ["high", "high", "low", "high", "low", "low"]
    assert [s.request_id for s in out] == [s.request_id for s in specs]
    assert all(s.retain is None for s in specs)  # the input is not modified (dataclasses.replace)
    assert out[1].arrival_ms == 100.0 and out[1].num_prompt_tokens == 8
    for s in out:
        assert parse_retention(s.retain).tier in (LOW, HIGH)


def test_oracle_retention_empty_and_no_links():
    assert oracle_retention([], []) == []
    specs = [_spec(0), _spec(1)]
    assert [s.retain for s in oracle_retention(specs, [Link(Relation.NONE, 0, None, None)] * 2)] == ["low", "low"]


@pytest.mark.parametrize("bad", [Retention(7), Retention(2, -1.0), Retention(2, float("nan")), Retention(1, 0.0),
                                 10**400])
def test_bad_retention_objects_and_huge_ttls_are_refused(bad):
    """Regression (fresh-user test): a Retention built by hand is validated like a value, and an
    int too large for a float is an InvalidRequestError, not an OverflowError."""
    with pytest.raises(InvalidRequestError):
        parse_retention(bad)
    with pytest.raises(InvalidRequestError):
        Request("r", [1, 2, 3], retain=bad)


def test_numpy_and_fraction_ttls_are_accepted():
    import fractions

    assert parse_retention(np.float32(2.5)) == Retention(2, 2.5)
    assert parse_retention(np.int64(3)) == Retention(2, 3.0)
    assert parse_retention(fractions.Fraction(1, 2)) == Retention(2, 0.5)
