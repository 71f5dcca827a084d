"""HazardTable: a per-class reuse probability by age, learned online (the idea of LHD, Beckmann et al.,
NSDI 2018, "LHD: improving cache hit rate by maximizing hit density").

A *life* is the time a cached unit spends since its last use. It ends by a reuse (a later request hits
it: :meth:`~HazardTable.record_reuse`) or leaves observation unreused (censored, dropped from the ghost
index: :meth:`~HazardTable.record_censored`). Ages fall into ``num_bins`` bins of ``bin_seconds``, the
last one open-ended. :meth:`~HazardTable.refresh` turns the counts into, per class c and bin b, the
probability that a unit that survived to bin b is reused within the next W = ``window_bins`` bins::

    S[c][b]   = ends in bins >= b + open lives of class c now in a bin >= b   (lives that reached b)
    R_w[c][b] = reuses in bins b .. min(b + W, num_bins) - 1
    p_all[b]  = sum_c R_w[c][b] / sum_c S[c][b]                 (pooled; 0 when no life reached b)
    p[c][b]   = (R_w[c][b] + m * p_all[b]) / (S[c][b] + m)      (m = prior_weight pseudo-lives; 0 / 0 -> 0)

Worked example, bin_seconds 30, num_bins 4, W 2. Class 0 reused at 10 s and 40 s, censored at 95 s
and 200 s (both bin 3); class 1 reused at 5 s::

    bin                   0      1      2      3
    class 0 reuses        1      1      0      0
    class 0 ends          1      1      0      2
    class 0 S / R_w      4/2    3/1    2/0    2/0     m = 0: p[0] = 1/2, 1/3, 0, 0
    class 1 S / R_w      1/1    0/0    0/0    0/0     m = 0: p[1] = 1,   0,   0, 0
    pooled p_all         3/5    1/3    0      0
    m = 2: p[0][0] = (2 + 2 * 3/5) / (4 + 2) = 8/15     p[1][0] = (1 + 6/5) / 3 = 11/15
           p[1][1] = (0 + 2 * 1/3) / (0 + 2) = 1/3      (a class never seen at bin 1 behaves like the pool)

Between refreshes :meth:`~HazardTable.reuse_probability` is an O(1) table lookup (0.0 before the first).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Sequence
from typing import Any

from mambakv.core.errors import InvalidSpecError, as_count

__all__ = ["HazardTable"]

FORMAT = "mambakv-hazard-table"
VERSION = 1


def _finite(value: object, name: str) -> float:
    """`value` (a real number, not a bool) as a finite float, else InvalidSpecError."""
    try:
        f = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond the float range
        f = math.nan
    if not math.isfinite(f):
        raise InvalidSpecError(f"{name} must be a finite number, got {value!r}")
    return f


def _real(value: object, name: str, *, positive: bool) -> float:
    """`value` as a finite float, > 0 if `positive` else >= 0, else InvalidSpecError."""
    f = _finite(value, name)
    if f < 0 or (positive and f == 0):
        raise InvalidSpecError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return f


class HazardTable:
    """Reuse counts per (class, age bin) and the probabilities of the last :meth:`refresh`.

    Args:
        num_classes: classes of units (int >= 1); a class is an int in ``0 .. num_classes - 1``.
        bin_seconds: width of an age bin in seconds (finite, > 0).
        num_bins: age bins (int >= 1); the last one holds every age beyond it.
        window_bins: W, the horizon of a probability in bins (int, ``1 <= W <= num_bins``).
        prior_weight: m, pseudo-lives pulling a class towards the pooled estimate (finite, >= 0).

    Raises:
        InvalidSpecError: any argument out of range or of the wrong type.
    """

    __slots__ = ("_nc", "_bs", "_nb", "_w", "_m", "_reuses", "_ends", "_p", "_nr", "_nl", "_nref")

    def __init__(self, num_classes: int, *, bin_seconds: float = 30.0, num_bins: int = 40,
                 window_bins: int = 4, prior_weight: float = 2.0) -> None:
        self._nc = as_count(num_classes, "num_classes", 1, InvalidSpecError)
        self._bs = _real(bin_seconds, "bin_seconds", positive=True)
        self._nb = as_count(num_bins, "num_bins", 1, InvalidSpecError)
        self._w = as_count(window_bins, "window_bins", 1, InvalidSpecError)
        if self._w > self._nb:
            raise InvalidSpecError(f"window_bins must be <= num_bins ({self._nb}), got {self._w}")
        self._m = _real(prior_weight, "prior_weight", positive=False)
        self._reuses = [[0] * self._nb for _ in range(self._nc)]
        self._ends = [[0] * self._nb for _ in range(self._nc)]
        self._p = [[0.0] * self._nb for _ in range(self._nc)]
        self._nr = self._nl = self._nref = 0

    @property
    def num_classes(self) -> int: return self._nc  # classes of units
    @property
    def bin_seconds(self) -> float: return self._bs  # seconds per age bin
    @property
    def num_bins(self) -> int: return self._nb  # age bins (the last open-ended)
    @property
    def window_bins(self) -> int: return self._w  # W: the horizon of a probability, in bins
    @property
    def prior_weight(self) -> float: return self._m  # m: pseudo-lives of the pooled prior
    @property
    def num_reuses(self) -> int: return self._nr  # lives ended by a reuse
    @property
    def num_lives(self) -> int: return self._nl  # lives ended (reused or censored)
    @property
    def num_refreshes(self) -> int: return self._nref  # calls of refresh (from_json's included)

    @property
    def reuses(self) -> tuple[tuple[int, ...], ...]:
        """reuses[c][b]: lives of class c ended by a reuse in age bin b (a copy)."""
        return tuple(map(tuple, self._reuses))

    @property
    def ends(self) -> tuple[tuple[int, ...], ...]:
        """ends[c][b]: lives of class c ended (reused or censored) in age bin b (a copy)."""
        return tuple(map(tuple, self._ends))

    def age_bin(self, age: float) -> int:
        """The bin of `age` seconds: ``min(int(age // bin_seconds), num_bins - 1)``; a negative age
        (clock jitter) is bin 0. Raises InvalidSpecError: `age` not a finite number."""
        a = age if type(age) is float and age - age == 0.0 else _finite(age, "age")  # finite floats pass
        if a <= 0:
            return 0
        return self._nb - 1 if a >= self._bs * self._nb else min(int(a // self._bs), self._nb - 1)

    def _cls(self, cls: int) -> int:
        if type(cls) is int and 0 <= cls < self._nc:  # the policy's own calls: no conversion
            return cls
        c = as_count(cls, "cls", 0, InvalidSpecError)
        if c >= self._nc:
            raise InvalidSpecError(f"cls must be < num_classes ({self._nc}), got {c}")
        return c

    def record_reuse(self, cls: int, age: float) -> None:
        """A life of class `cls` ended by a reuse at `age` seconds. Raises InvalidSpecError: bad cls/age."""
        c, b = self._cls(cls), self.age_bin(age)
        self._reuses[c][b] += 1
        self._ends[c][b] += 1
        self._nr += 1
        self._nl += 1

    def record_censored(self, cls: int, age: float) -> None:
        """A life of class `cls` left observation unreused at `age` seconds. Raises InvalidSpecError."""
        c, b = self._cls(cls), self.age_bin(age)
        self._ends[c][b] += 1
        self._nl += 1

    def refresh(self, open_lives: Iterable[tuple[int, float]] = (), *, checked: bool = True) -> None:
        """Recompute every probability (module docstring) from the counts and `open_lives`, the
        ``(cls, current age in seconds)`` of lives still going on. Raises InvalidSpecError (nothing
        changed): an open life with a bad class or age. ``checked=False``: the caller guarantees
        int classes in range and finite ages >= 0 (the eviction policy's own lives; no per-life
        validation)."""
        nc, nb, w, m = self._nc, self._nb, self._w, self._m
        reached = [list(row) for row in self._ends]  # ends + open lives per bin, suffix-summed below
        if checked:
            for life in list(open_lives):
                if not isinstance(life, tuple) or len(life) != 2:
                    raise InvalidSpecError(f"an open life must be a (cls, age) tuple, got {life!r}")
                reached[self._cls(life[0])][self.age_bin(life[1])] += 1
        else:
            bs, last = self._bs, nb - 1
            for c, age in open_lives:
                b = int(age // bs)
                reached[c][b if b < last else last] += 1
        s = [[0] * nb for _ in range(nc)]
        r = [[0] * nb for _ in range(nc)]
        for c in range(nc):
            acc, rc = 0, self._reuses[c]
            for b in range(nb - 1, -1, -1):
                acc += reached[c][b]
                s[c][b] = acc
                r[c][b] = sum(rc[b:min(b + w, nb)])
        p_all = [0.0] * nb
        for b in range(nb):
            s_all = sum(s[c][b] for c in range(nc))
            p_all[b] = sum(r[c][b] for c in range(nc)) / s_all if s_all else 0.0
        self._p = [[(r[c][b] + m * p_all[b]) / (s[c][b] + m) if s[c][b] + m else 0.0 for b in range(nb)]
                   for c in range(nc)]
        self._nref += 1

    def reuse_probability(self, cls: int, age: float) -> float:
        """P(reused within W bins | class `cls` survived to `age` seconds), as of the last refresh
        (0.0 before it). Raises InvalidSpecError: bad cls/age."""
        return self._p[self._cls(cls)][self.age_bin(age)]

    def probability_row(self, cls: int) -> Sequence[float]:
        """Class `cls`'s probabilities by age bin as of the last refresh (the table's own list:
        read it, do not change it; all 0.0 before a refresh). For a caller that bins ages itself
        (``min(int(age // bin_seconds), num_bins - 1)``) on a hot path."""
        return self._p[self._cls(cls)]

    def to_json(self) -> dict[str, Any]:
        """The counts and parameters as a JSON-ready dict (probabilities are recomputed on load)."""
        return {"format": FORMAT, "version": VERSION, "bin_seconds": self._bs, "num_bins": self._nb,
                "window_bins": self._w, "prior_weight": self._m, "num_classes": self._nc,
                "reuses": [list(row) for row in self._reuses], "ends": [list(row) for row in self._ends]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HazardTable:
        """The table `d` (from :meth:`to_json`) describes, refreshed with no open lives. Unknown keys
        are ignored. Raises InvalidSpecError: not a dict, a key missing, a wrong format or version, a
        bad parameter, counts of the wrong shape, not ints >= 0, or reuses > ends in a cell."""
        if not isinstance(d, dict):
            raise InvalidSpecError(f"a hazard table must be a JSON object, got {type(d).__name__}")
        missing = {"format", "version", "bin_seconds", "num_bins", "window_bins", "prior_weight",
                   "num_classes", "reuses", "ends"} - d.keys()
        if missing:
            raise InvalidSpecError(f"hazard table JSON lacks {sorted(missing)}")
        if d["format"] != FORMAT or type(d["version"]) is not int or d["version"] != VERSION:
            raise InvalidSpecError(f"not a {FORMAT} version {VERSION}: {d['format']!r} {d['version']!r}")
        t = cls(d["num_classes"], bin_seconds=d["bin_seconds"], num_bins=d["num_bins"],
                window_bins=d["window_bins"], prior_weight=d["prior_weight"])
        grids = [_grid(d[k], k, t._nc, t._nb) for k in ("reuses", "ends")]
        if any(x > y for rr, er in zip(*grids) for x, y in zip(rr, er)):
            raise InvalidSpecError("hazard table JSON has more reuses than ended lives in a cell")
        t._reuses, t._ends = grids
        t._nr, t._nl = sum(map(sum, grids[0])), sum(map(sum, grids[1]))
        t.refresh()
        return t

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to `path` (UTF-8, indent=1). OSError propagates."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HazardTable:
        """The table saved at `path`. Raises InvalidSpecError: not JSON or not a valid table (OSError
        propagates)."""
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise InvalidSpecError(f"{path}: not a JSON hazard table: {e}") from e
        return cls.from_json(d)

    def merge_counts(self, other: HazardTable) -> None:
        """Add `other`'s counts to this table's (a warm start); probabilities change at the next
        :meth:`refresh`. Raises InvalidSpecError (nothing changed): not a HazardTable, or another
        num_classes, num_bins or bin_seconds."""
        if not isinstance(other, HazardTable):
            raise InvalidSpecError(f"merge_counts needs a HazardTable, got {type(other).__name__}")
        if (other._nc, other._nb, other._bs) != (self._nc, self._nb, self._bs):
            raise InvalidSpecError(f"cannot merge a {other._nc}x{other._nb} table of {other._bs} s bins into "
                                   f"a {self._nc}x{self._nb} table of {self._bs} s bins")
        add_r, add_e, add_nr, add_nl = other._reuses, other._ends, other._nr, other._nl  # `other` may be self
        self._reuses = [[x + y for x, y in zip(a, b)] for a, b in zip(self._reuses, add_r)]
        self._ends = [[x + y for x, y in zip(a, b)] for a, b in zip(self._ends, add_e)]
        self._nr += add_nr
        self._nl += add_nl

    def check_invariants(self) -> None:
        """Assert shapes, counts ints >= 0 with reuses <= ends, totals, probabilities in [0, 1]."""
        for grid in (self._reuses, self._ends, self._p):
            assert len(grid) == self._nc and all(len(row) == self._nb for row in grid)
        for rr, er in zip(self._reuses, self._ends):
            assert all(type(x) is int and type(y) is int and 0 <= x <= y for x, y in zip(rr, er))
        assert self._nr == sum(map(sum, self._reuses)) and self._nl == sum(map(sum, self._ends))
        assert all(0.0 <= p <= 1.0 for row in self._p for p in row)
        assert 1 <= self._w <= self._nb and self._bs > 0 and self._m >= 0


def _grid(value: object, name: str, rows: int, cols: int) -> list[list[int]]:
    """`value` as a `rows` x `cols` list of lists of ints >= 0, else InvalidSpecError."""
    if not isinstance(value, list) or len(value) != rows:
        raise InvalidSpecError(f"{name} must be a list of {rows} rows")
    out = []
    for row in value:
        if not isinstance(row, list) or len(row) != cols:
            raise InvalidSpecError(f"each row of {name} must be a list of {cols} counts")
        if not all(type(x) is int and x >= 0 for x in row):
            raise InvalidSpecError(f"{name} counts must be ints >= 0, got {row!r}")
        out.append(list(row))
    return out
