"""HazardTable: the probabilities of a scripted stream, worked out by hand, and its JSON form."""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction

import pytest

from mambakv.core.errors import InvalidSpecError, MambaKVError
from mambakv.core.hazard import HazardTable


def scripted(prior_weight: float) -> HazardTable:
    """2 classes, 30 s bins, 4 bins, W = 2.

    class 0: reused at 10 s (bin 0), reused at 40 s (bin 1), censored at 95 s (bin 3: 95 // 30 = 3),
             censored at 200 s (bin 3: 6, clipped to the open-ended last bin)
    class 1: reused at 5 s (bin 0)
    """
    t = HazardTable(2, bin_seconds=30, num_bins=4, window_bins=2, prior_weight=prior_weight)
    for step in (lambda: t.record_reuse(0, 10.0), lambda: t.record_reuse(0, 40.0),
                 lambda: t.record_censored(0, 95.0), lambda: t.record_censored(0, 200.0),
                 lambda: t.record_reuse(1, 5.0)):
        step()
        t.check_invariants()
    return t


def probs(t: HazardTable) -> list[list[float]]:
    return [[t.reuse_probability(c, 30.0 * b + 1.0) for b in range(t.num_bins)] for c in range(t.num_classes)]


def test_counts_of_the_stream() -> None:
    t = scripted(0.0)
    assert t.reuses == ((1, 1, 0, 0), (1, 0, 0, 0))
    assert t.ends == ((1, 1, 0, 2), (1, 0, 0, 0))
    assert (t.num_reuses, t.num_lives, t.num_refreshes) == (3, 5, 0)


def test_before_refresh_everything_is_zero() -> None:
    t = scripted(2.0)
    assert probs(t) == [[0.0] * 4, [0.0] * 4]
    assert t.reuse_probability(1, 1e9) == 0.0


def test_no_prior_is_the_plain_fraction() -> None:
    # class 0: S = suffix sums of ends (1, 1, 0, 2) = (4, 3, 2, 2)
    #          R_w (W = 2) = (r0 + r1, r1 + r2, r2 + r3, r3) = (2, 1, 0, 0)    -> p = 2/4, 1/3, 0/2, 0/2
    # class 1: S = (1, 0, 0, 0), R_w = (1, 0, 0, 0)                             -> p = 1/1, 0 (0/0), 0, 0
    t = scripted(0.0)
    t.refresh()
    t.check_invariants()
    assert t.num_refreshes == 1
    assert probs(t) == [pytest.approx([1 / 2, 1 / 3, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0, 0.0])]


def test_prior_shrinks_towards_the_pool() -> None:
    # pooled: S_all = (4+1, 3+0, 2, 2) = (5, 3, 2, 2), R_all = (2+1, 1, 0, 0) -> p_all = (3/5, 1/3, 0, 0)
    # m = 2:  p[0] = ((2 + 2*3/5) / (4+2), (1 + 2*1/3) / (3+2), 0 / 4, 0 / 4) = (16/30, 1/3, 0, 0)
    #         p[1] = ((1 + 2*3/5) / (1+2), (0 + 2*1/3) / (0+2), 0 / 2, 0 / 2) = (11/15, 1/3, 0, 0)
    t = scripted(2.0)
    t.refresh()
    t.check_invariants()
    assert probs(t) == [pytest.approx([8 / 15, 1 / 3, 0.0, 0.0]), pytest.approx([11 / 15, 1 / 3, 0.0, 0.0])]


def test_open_lives_count_as_survivors() -> None:
    # an open life of class 0 at 65 s is in bin 2: it reached bins 0, 1, 2 -> S[0] = (5, 4, 3, 2), R_w unchanged
    # m = 0: p[0] = (2/5, 1/4, 0/3, 0/2); class 1 unchanged (1, 0, 0, 0)
    t = scripted(0.0)
    t.refresh([(0, 65.0)])
    t.check_invariants()
    assert probs(t) == [pytest.approx([2 / 5, 1 / 4, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0, 0.0])]
    # m = 2: S_all = (6, 4, 3, 2), R_all = (3, 1, 0, 0) -> p_all = (1/2, 1/4, 0, 0)
    #        p[0] = ((2 + 1) / 7, (1 + 1/2) / 6, 0, 0) = (3/7, 1/4, 0, 0)
    #        p[1] = ((1 + 1) / 3, (0 + 1/2) / 2, 0, 0) = (2/3, 1/4, 0, 0)
    t = scripted(2.0)
    t.refresh([(0, 65.0)])
    assert probs(t) == [pytest.approx([3 / 7, 1 / 4, 0.0, 0.0]), pytest.approx([2 / 3, 1 / 4, 0.0, 0.0])]
    # a refresh without open lives forgets them: back to the m = 2 values of the closed stream
    t.refresh()
    assert probs(t) == [pytest.approx([8 / 15, 1 / 3, 0.0, 0.0]), pytest.approx([11 / 15, 1 / 3, 0.0, 0.0])]
    assert t.num_refreshes == 2


def test_age_bin_edges() -> None:
    t = HazardTable(1, bin_seconds=30, num_bins=4, window_bins=1)
    # 0 -> 0; 29.999 // 30 = 0; 30 // 30 = 1; 89.999 -> 2; 90 -> 3; huge -> clipped to 3; negative -> 0
    assert [t.age_bin(a) for a in (0, 0.0, 29.999, 30, 30.0, 89.999, 90.0, 1e300, -5.0, -1e300)] == \
        [0, 0, 0, 1, 1, 2, 3, 3, 0, 0]
    assert t.age_bin(Fraction(61, 2)) == 1  # any real number: 30.5 s -> bin 1


@pytest.mark.parametrize(("window", "expected"), [
    # ends = (1, 1, 2) -> S = (4, 3, 2) for every W; reuses r = (1, 1, 1)
    (1, [1 / 4, 1 / 3, 1 / 2, 1 / 2]),  # R_w = (r0, r1, r2) = (1, 1, 1)
    (2, [2 / 4, 2 / 3, 1 / 2, 1 / 2]),  # R_w = (r0+r1, r1+r2, r2) = (2, 2, 1): bin 2 clipped (no bin 3)
    (3, [3 / 4, 2 / 3, 1 / 2, 1 / 2]),  # R_w = (r0+r1+r2, r1+r2, r2) = (3, 2, 1): bins 1 and 2 clipped
])
def test_window_clipped_at_the_last_bin(window: int, expected: list[float]) -> None:
    # 1 class, 10 s bins, 3 bins, m = 0; reuses at 1 s, 11 s, 25 s (bins 0, 1, 2), one censored at 500 s (bin 2)
    t = HazardTable(1, bin_seconds=10, num_bins=3, window_bins=window, prior_weight=0)
    for age in (1.0, 11.0, 25.0):
        t.record_reuse(0, age)
    t.record_censored(0, 500.0)
    t.refresh()
    t.check_invariants()
    assert [t.reuse_probability(0, a) for a in (0.0, 10.0, 20.0, 1e6)] == pytest.approx(expected)


def test_window_of_one_bin_on_the_stream() -> None:
    # W = 1, m = 0: R_w = reuses themselves; class 0: (1, 1, 0, 0) / S (4, 3, 2, 2); class 1: (1, 0, 0, 0) / (1, 0, 0, 0)
    t = HazardTable(2, bin_seconds=30, num_bins=4, window_bins=1, prior_weight=0)
    t.merge_counts(scripted(0.0))
    t.refresh()
    t.check_invariants()
    assert probs(t) == [pytest.approx([1 / 4, 1 / 3, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0, 0.0])]


def test_json_round_trip(tmp_path) -> None:
    t = scripted(2.0)
    t.refresh()
    d = t.to_json()
    assert d == {"format": "mambakv-hazard-table", "version": 1, "bin_seconds": 30.0, "num_bins": 4,
                 "window_bins": 2, "prior_weight": 2.0, "num_classes": 2,
                 "reuses": [[1, 1, 0, 0], [1, 0, 0, 0]], "ends": [[1, 1, 0, 2], [1, 0, 0, 0]]}
    for u in (HazardTable.from_json(json.loads(json.dumps(d))), _saved_and_loaded(t, tmp_path)):
        u.check_invariants()
        assert (u.reuses, u.ends, u.num_reuses, u.num_lives) == (t.reuses, t.ends, 3, 5)
        assert u.num_refreshes == 1  # from_json refreshes once
        assert probs(u) == probs(t)
        assert u.to_json() == d
    assert json.loads((tmp_path / "h.json").read_text(encoding="utf-8")) == d
    assert (tmp_path / "h.json").read_text(encoding="utf-8").startswith('{\n "format"')  # indent=1


def _saved_and_loaded(t: HazardTable, tmp_path) -> HazardTable:
    t.save(tmp_path / "h.json")
    return HazardTable.load(str(tmp_path / "h.json"))


def _bad(d: dict, **change) -> dict:
    d = copy.deepcopy(d)
    for k, v in change.items():
        if v is KeyError:
            del d[k]
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("change", [
    {"format": "mambakv-other"}, {"version": 2}, {"version": True}, {"version": "1"}, {"format": KeyError},
    {"ends": KeyError}, {"num_classes": 0}, {"num_bins": 1.5}, {"bin_seconds": -1}, {"bin_seconds": "30"},
    {"window_bins": 5}, {"prior_weight": -0.5}, {"prior_weight": math.inf},
    {"reuses": [[1, 1, 0, 0]]},                                  # one row for 2 classes
    {"ends": [[1, 1, 0, 2], [1, 0, 0]]},                         # a short row
    {"ends": [[1, 1, 0, 2], [1, 0, 0, -1]]},                     # a negative count
    {"ends": [[1, 1, 0, 2.0], [1, 0, 0, 0]]},                    # a float count
    {"reuses": [[1, 1, 0, 0], [1, 0, 0, True]], "ends": [[1, 1, 0, 2], [1, 0, 0, 1]]},  # a bool count
    {"reuses": [[1, 2, 0, 0], [1, 0, 0, 0]]},                    # reuses 2 > ends 1 in class 0, bin 1
    {"reuses": "[[1]]"},
])
def test_malformed_json_raises(change: dict) -> None:
    with pytest.raises(InvalidSpecError):
        HazardTable.from_json(_bad(scripted(0.0).to_json(), **change))


def test_malformed_input_to_from_json_and_load(tmp_path) -> None:
    for d in ([], "x", None):
        with pytest.raises(InvalidSpecError):
            HazardTable.from_json(d)  # type: ignore[arg-type]
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(InvalidSpecError):
        HazardTable.load(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(InvalidSpecError):
        HazardTable.load(tmp_path / "list.json")


def test_merge_counts_adds() -> None:
    # scripted + scripted = every count doubled; probabilities unchanged with m = 0 (both S and R_w double)
    t, u = scripted(0.0), scripted(0.0)
    t.refresh()
    before = probs(t)
    t.merge_counts(u)
    t.check_invariants()
    assert t.reuses == ((2, 2, 0, 0), (2, 0, 0, 0)) and t.ends == ((2, 2, 0, 4), (2, 0, 0, 0))
    assert (t.num_reuses, t.num_lives) == (6, 10)
    assert probs(t) == before  # not refreshed by the merge
    t.refresh()
    assert probs(t) == [pytest.approx([1 / 2, 1 / 3, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0, 0.0])]
    t.merge_counts(t)  # merging a table into itself doubles again
    t.check_invariants()
    assert t.ends == ((4, 4, 0, 8), (4, 0, 0, 0)) and (t.num_reuses, t.num_lives) == (12, 20)
    # window_bins and prior_weight may differ: they are not part of the counts
    v = HazardTable(2, bin_seconds=30, num_bins=4, window_bins=4, prior_weight=9)
    v.merge_counts(u)
    assert v.ends == u.ends and v.reuses == u.reuses


@pytest.mark.parametrize("other", [
    HazardTable(3, bin_seconds=30, num_bins=4, window_bins=2),  # another num_classes
    HazardTable(2, bin_seconds=30, num_bins=5, window_bins=2),  # another num_bins
    HazardTable(2, bin_seconds=60, num_bins=4, window_bins=2),  # another bin width
    "not a table",
])
def test_failed_merge_changes_nothing(other: object) -> None:
    t = scripted(2.0)
    t.refresh()
    state = (t.to_json(), probs(t), t.num_reuses, t.num_lives, t.num_refreshes)
    with pytest.raises(InvalidSpecError):
        t.merge_counts(other)  # type: ignore[arg-type]
    assert (t.to_json(), probs(t), t.num_reuses, t.num_lives, t.num_refreshes) == state
    t.check_invariants()


@pytest.mark.parametrize("kwargs", [
    dict(num_classes=0), dict(num_classes=1.0), dict(num_classes=True), dict(num_classes="2"),
    dict(num_classes=1, bin_seconds=0), dict(num_classes=1, bin_seconds=-1.0), dict(num_classes=1, bin_seconds=math.nan),
    dict(num_classes=1, bin_seconds=math.inf), dict(num_classes=1, bin_seconds=True),
    dict(num_classes=1, bin_seconds=10**400),
    dict(num_classes=1, num_bins=0), dict(num_classes=1, num_bins=2.0),
    dict(num_classes=1, window_bins=0), dict(num_classes=1, num_bins=3, window_bins=4), dict(num_classes=1, window_bins=None),
    dict(num_classes=1, prior_weight=-1), dict(num_classes=1, prior_weight=math.nan), dict(num_classes=1, prior_weight="2"),
])
def test_bad_constructor_args(kwargs: dict) -> None:
    with pytest.raises(InvalidSpecError):
        HazardTable(**kwargs)
    assert issubclass(InvalidSpecError, MambaKVError)


def test_edge_constructor_args() -> None:
    # the smallest valid table: 1 class, 1 bin, W = 1, m = 0; every age is bin 0
    t = HazardTable(1, bin_seconds=1e-9, num_bins=1, window_bins=1, prior_weight=0)
    t.record_reuse(0, 1e9)
    t.record_censored(0, -3.0)
    t.refresh()  # S = 2, R_w = 1 -> 1/2
    t.check_invariants()
    assert t.reuse_probability(0, 0.0) == 0.5


def test_bad_cls_or_age_changes_nothing() -> None:
    t = scripted(2.0)
    t.refresh()
    state = (t.to_json(), probs(t), t.num_reuses, t.num_lives, t.num_refreshes)
    bad_calls = [(cls, 1.0) for cls in (-1, 2, 1.0, True, "0", None)] + \
                [(0, age) for age in (math.nan, math.inf, -math.inf, 10**400, "1", None, True)]  # 10**400: no float
    for cls, age in bad_calls:
        for call in (t.record_reuse, t.record_censored, t.reuse_probability):
            with pytest.raises(InvalidSpecError):
                call(cls, age)  # type: ignore[arg-type]
        with pytest.raises(InvalidSpecError):  # one bad open life: no refresh happens
            t.refresh([(0, 1.0), (cls, age)])
    for bad_life in ((0,), [0, 1.0], (0, 1.0, 2), 5):
        with pytest.raises(InvalidSpecError):
            t.refresh([bad_life])  # type: ignore[list-item]
    with pytest.raises(InvalidSpecError):
        t.age_bin(math.nan)
    assert (t.to_json(), probs(t), t.num_reuses, t.num_lives, t.num_refreshes) == state
    t.check_invariants()
