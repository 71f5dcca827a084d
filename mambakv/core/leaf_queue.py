"""LeafQueue: leaf units in least-recently-used order, by their ``last_use``.

A unit can join a queue out of order: an interior unit becomes a leaf when its last child goes
(its last use may be long ago), a ttl hint expires. So the queue is a binary heap on
``(last_use, seq)`` with lazy deletion, not a list in insertion order::

    push(u)      heap entry (u.last_use, seq, u); u.queue_seq = seq          O(log n)
    remove(u)    u.queue_seq = 0: its entries go stale                       O(1)
    touch(u)     push again with the new last_use (the old entry goes stale) O(log n)
    head(free)   drop stale entries from the top; the first entry whose
                 unit `free` accepts (pinned ones are put back)              O(k log n)

Stale entries are dropped when they reach the top, and all at once when they outnumber the
live ones twice.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from mambakv.core.unit_types import Unit

__all__ = ["LeafQueue"]

_SEQ = itertools.count(1)


class LeafQueue:
    """Leaf units by last use, oldest first (see the module docstring)."""

    __slots__ = ("_heap", "num_live")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Unit]] = []
        self.num_live = 0

    def __len__(self) -> int:
        return self.num_live

    def push(self, unit: Unit) -> None:
        if not unit.queue_seq:
            self.num_live += 1
        self._push(unit)

    def _push(self, unit: Unit) -> None:
        seq = next(_SEQ)
        unit.queue_seq = seq
        heapq.heappush(self._heap, (unit.last_use, seq, unit))
        if len(self._heap) > 2 * self.num_live + 64:
            self._heap = [e for e in self._heap if e[2].queue_seq == e[1]]
            heapq.heapify(self._heap)

    def remove(self, unit: Unit) -> None:
        assert unit.queue_seq, f"{unit!r} is in no queue"
        unit.queue_seq = 0
        self.num_live -= 1

    def touch(self, unit: Unit) -> None:
        """`unit`'s last use moved: re-place it."""
        assert unit.queue_seq
        self._push(unit)

    def head(self, is_free: Callable[[Unit], bool], probe: int) -> Unit | None:
        """The least recently used unit that `is_free` accepts, among the first `probe` live
        ones; None if none."""
        heap = self._heap
        aside: list[tuple[float, int, Unit]] = []
        found = None
        while heap and len(aside) <= probe:
            entry = heap[0]
            unit = entry[2]
            if unit.queue_seq != entry[1]:
                heapq.heappop(heap)
                continue
            if is_free(unit):
                found = unit
                break
            aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def units(self) -> Iterator[Unit]:
        """The live units, in no particular order."""
        return (u for _, seq, u in self._heap if u.queue_seq == seq)

    def check_invariants(self) -> None:
        live = [u for _, seq, u in self._heap if u.queue_seq == seq]
        assert len(live) == self.num_live == len(set(map(id, live))), "leaf queue count"
        assert all(lu == u.last_use for lu, seq, u in self._heap if u.queue_seq == seq), "stale last_use"
