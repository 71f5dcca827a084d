"""GhostIndex: a bounded index of recently evicted units, oldest first.

When a cached unit (a block, keyed by its block hash) is evicted, its key and a small entry (its
class, the time of its last use) go into the ghost index. The next turn of a conversation whose unit
was evicted still finds that entry (a *ghost hit*) and can teach the
:class:`~mambakv.core.hazard.HazardTable` that a unit of that class was reused at that age, instead
of the life looking censored; this is how LHD (Beckmann et al., NSDI 2018, "LHD: improving cache hit
rate by maximizing hit density") keeps learning about the units it evicts. The index keeps the
``capacity`` newest keys; the ones it drops leave observation (their lives end censored)::

    capacity 3       index (oldest .. newest)   add returns
    add(a)           a                          []
    add(b), add(c)   a b c                      [], []
    add(d)           b c d                      [(a, ...)]    a dropped: the oldest
    add(b)           c d b                      []            re-adding makes b the newest
    pop(c)           d b                        (returns c's entry)

Memory: about ``capacity x 200 B`` (a 16-byte key object, its ordered-dict slot and links, a small
entry), e.g. 100,000 ghosts in about 20 MB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

from mambakv.core.errors import InvalidSpecError, as_count

__all__ = ["GhostIndex"]

T = TypeVar("T")


def _key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise InvalidSpecError(f"a ghost key must be bytes (a block hash), got {type(key).__name__}")
    return key


class GhostIndex(Generic[T]):
    """Up to `capacity` ``key -> entry`` pairs, oldest first (an OrderedDict).

    Args:
        capacity: the most entries kept (int >= 0; 0 keeps nothing).

    Raises:
        InvalidSpecError: `capacity` not an int >= 0.
    """

    __slots__ = ("_cap", "_d")

    def __init__(self, capacity: int) -> None:
        self._cap = as_count(capacity, "capacity", 0, InvalidSpecError)
        self._d: OrderedDict[bytes, T] = OrderedDict()

    @property
    def capacity(self) -> int:
        """The most entries kept."""
        return self._cap

    def add(self, key: bytes, entry: T) -> list[tuple[bytes, T]]:
        """Insert ``key -> entry`` as the newest (a key already there gets `entry` and becomes the
        newest) and return the pairs dropped to keep ``len <= capacity``, oldest first; with
        capacity 0, ``[(key, entry)]`` itself. Raises InvalidSpecError (nothing changed): `key` not bytes."""
        d = self._d
        d[_key(key)] = entry
        d.move_to_end(key)
        dropped: list[tuple[bytes, T]] = []
        while len(d) > self._cap:
            dropped.append(d.popitem(last=False))
        return dropped

    def pop(self, key: bytes) -> T | None:
        """Remove `key` and return its entry, or None if absent. Raises InvalidSpecError: `key` not bytes."""
        return self._d.pop(_key(key), None)

    def pop_present(self, keys: Sequence[bytes]) -> list[tuple[int, T]]:
        """Remove every key of `keys` that is here and return ``(position in keys, entry)`` in
        the order of `keys`: one pass for a request's whole chain (keys are not checked)."""
        d = self._d
        if not d:
            return []
        found = [i for i, k in enumerate(keys) if k in d]
        return [(i, d.pop(keys[i])) for i in found]

    def get(self, key: bytes) -> T | None:
        """The entry of `key` (its place unchanged), or None. Raises InvalidSpecError: `key` not bytes."""
        return self._d.get(_key(key))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def items(self) -> list[tuple[bytes, T]]:
        """Every ``(key, entry)``, oldest first (a copy)."""
        return list(self._d.items())

    def clear(self) -> list[tuple[bytes, T]]:
        """Empty the index; return what it held, oldest first."""
        held = list(self._d.items())
        self._d.clear()
        return held

    def check_invariants(self) -> None:
        """Assert ``len <= capacity`` and that every key is bytes."""
        assert 0 <= len(self._d) <= self._cap
        assert all(isinstance(k, bytes) for k in self._d)
