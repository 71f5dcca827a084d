"""Eviction policies over the leaf units of the decoupled layout (:mod:`mambakv.core.units`).

Both policies evict whole units, leaf first; they differ in which leaf goes::

    policy   victim
    lru      the least recently used leaf of the lowest retention tier
    reuse    per class, the least recently used leaf is the class head; the victim is the head
             with the lowest hit density: P(reused within the hazard window | its class, its age)
             x its tokens / its bytes (LHD, Beckmann et al., NSDI 2018), lowest tier first

The reuse probabilities come from a :class:`~mambakv.core.hazard.HazardTable` learned online: a
leaf's life ends in a reuse (a later request's chain passes it, live or as a ghost) or is
censored (its ghost is dropped). A cold table gives every class probability 0: the oldest head
goes, i.e. LRU. Retention hints (:mod:`mambakv.core.retention`) set the tier: low units go
before any normal one, high ones last; a ttl hint is high until the unit has been idle that long.
Evicted units stay in a bounded :class:`GhostIndex`, so that a next turn after an eviction still
finds its parent's class and still teaches the table. The two structures the policies keep are
here too: :class:`LeafQueue` (leaves by last use) and :class:`GhostIndex`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from mambakv.core.errors import InvalidSpecError, as_count
from mambakv.core.hazard import HazardTable
from mambakv.core.retention import HIGH, NORMAL
from mambakv.core.unit_types import NUM_CLASSES, Unit, UnitStats

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "GhostIndex", "LeafQueue", "LruEviction", "ReuseEviction",
           "make_eviction_policy"]


_SEQ = itertools.count(1)


class LeafQueue:
    """Leaf units in least-recently-used order, by their ``last_use``.

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

#: leaves tried from a queue's head when the first ones are pinned (their state is in a table)
PROBE = 64
#: refresh the hazard table after this many reuse / censored events
REFRESH_EVERY = 64
#: the hazard window: P(reused within 16 x 30 s = 8 min). Measured on the real trace (first 3000
#: requests, conversation replay, one at a time): 60 GiB 0.0979 / 0.1146 / 0.1208 / 0.1218 with
#: 1 / 4 / 8 / 16 bins (30 GiB 0.0778 / 0.0787 at 8 / 16, 120 GiB 0.1704 / 0.1756); a next turn
#: comes a median 108 s later, p90 372 s (CACHE.md)
HAZARD_WINDOW_BINS = 16


class EvictionPolicy:
    """The leaf queues (one :class:`LeafQueue` per queue key, LRU first), the ghosts and the counts.

    Subclasses choose the queue key and the victim. Args: ghost_capacity: evicted units kept."""

    name = "lru"

    def __init__(self, *, ghost_capacity: int = 4096) -> None:
        self.ghost: GhostIndex[Unit] = GhostIndex(ghost_capacity)
        self.queues: dict[tuple[int, int], LeafQueue] = {}
        self.stats = UnitStats()
        self.num_leaves = 0
        #: high-tier leaves with a ttl (demoted to normal when it passes)
        self._ttl_leaves: set[Unit] = set()
        self.page_tokens = self.page_bytes = self.slot_bytes = self.num_states = 1

    def configure(self, *, page_tokens: int, page_bytes: int, slot_bytes: int, num_states: int,
                  stats: UnitStats) -> None:
        self.page_tokens, self.page_bytes, self.slot_bytes, self.num_states = page_tokens, page_bytes, slot_bytes, num_states
        self.stats = stats

    def queue_key(self, unit: Unit) -> tuple[int, int]:
        return (unit.tier, 0)

    # ------------------------------------------------------------------ leaves
    def add_leaf(self, unit: Unit) -> None:
        assert not unit.leaf and unit.node is not None
        unit.leaf = True
        unit.tier = unit.retain.tier
        self._queue(unit).push(unit)
        self.num_leaves += 1
        if _has_ttl(unit):
            self._ttl_leaves.add(unit)

    def _queue(self, unit: Unit) -> LeafQueue:
        key = self.queue_key(unit)
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = LeafQueue()
        return q

    def remove_leaf(self, unit: Unit) -> None:
        assert unit.leaf
        self.queues[self.queue_key(unit)].remove(unit)
        unit.leaf = False
        self.num_leaves -= 1
        self._ttl_leaves.discard(unit)

    def touch(self, unit: Unit) -> None:
        """A leaf was used (its ``last_use`` changed): re-placed in its queue, tier from its hint."""
        if unit.tier != unit.retain.tier or (unit in self._ttl_leaves) != _has_ttl(unit):
            self.remove_leaf(unit)  # its hint changed (a shared unit keeps the stronger one)
            self.add_leaf(unit)
        else:
            self.queues[self.queue_key(unit)].touch(unit)

    def leaves(self) -> Iterator[Unit]:
        for q in self.queues.values():
            yield from q.units()

    # ------------------------------------------------------------------ events
    def on_reuse(self, unit: Unit, now: float, hit_tokens: int) -> None:
        """A later request's chain passes leaf `unit` (its life ends in a reuse)."""
        st = self.stats
        st.reuses += 1
        st.reuses_by_class[unit.cls] += 1
        st.hit_tokens_by_class[unit.cls] += hit_tokens
        self.learn_reuse(unit, now)
        unit.last_use = now
        self.touch(unit)

    def on_ghost_hit(self, unit: Unit, now: float, tokens: int) -> None:
        """A request passes evicted `unit` (popped from the ghosts): the hit it would have had."""
        st = self.stats
        if tokens > 0:  # past the hit (a ghost inside it had a deeper checkpoint that served it)
            st.ghost_hits += 1
            st.ghost_hit_tokens += tokens
            st.ghost_hits_by_class[unit.cls] += 1
        self.learn_reuse(unit, now)

    def on_evict(self, unit: Unit, now: float, *, chosen: bool) -> None:
        st = self.stats
        if chosen:
            st.evictions += 1
        else:
            st.cascade_evictions += 1
        st.evictions_by_class[unit.cls] += 1
        if unit.leaf:
            self.remove_leaf(unit)
        unit.node = None
        for _, dropped in self.ghost.add(unit.key, unit):
            self.learn_censored(dropped, now)

    def learn_reuse(self, unit: Unit, now: float) -> None:
        """Hook: a life ended in a reuse at age ``now - unit.last_use``."""

    def learn_censored(self, unit: Unit, now: float) -> None:
        """Hook: a ghost was dropped unreused at age ``now - unit.last_use``."""

    # ------------------------------------------------------------------ victims
    def demote_expired(self, now: float) -> None:
        """High-tier leaves whose ttl passed join their normal queue (by their last use). A ttl
        leaf's expiry is ``last_use + ttl``; the scan runs only while some high leaf has a ttl."""
        if not self._ttl_leaves:
            return
        for u in [u for u in self._ttl_leaves if now - u.last_use >= u.retain.ttl]:  # type: ignore[operator]
            self.queues[self.queue_key(u)].remove(u)
            u.tier = NORMAL
            self._ttl_leaves.discard(u)
            self._queue(u).push(u)

    def victim(self, now: float, is_free: Callable[[Unit], bool]) -> Unit | None:
        """The leaf to evict next (its states free: `is_free`), or None."""
        self.demote_expired(now)
        for tier in range(3):
            for key, q in self.queues.items():
                if key[0] == tier and q.num_live:
                    head = q.head(is_free, PROBE)
                    if head is not None:
                        return head
        return None

    def check_invariants(self) -> None:
        n = 0
        for key, q in self.queues.items():
            q.check_invariants()
            for u in q.units():
                assert u.leaf and u.node is not None and u.node.unit is u, f"leaf {u!r} stale"
                assert self.queue_key(u) == key, f"leaf {u!r} in queue {key}"
                n += 1
        assert n == self.num_leaves
        assert all(u.leaf and _has_ttl(u) for u in self._ttl_leaves), "a ttl leaf without a high ttl hint"
        self.ghost.check_invariants()


class LruEviction(EvictionPolicy):
    """Units in LRU order within a retention tier (``--eviction lru``)."""

    name = "lru"


class ReuseEviction(EvictionPolicy):
    """Reuse-aware hit density over classes (``--eviction reuse``; the module docstring).

    Args:
        hazard: a warm-start table (its counts; learning continues), else a cold one.
        ghost_capacity: evicted units kept for learning.
    """

    name = "reuse"

    def __init__(self, *, hazard: HazardTable | None = None, ghost_capacity: int = 4096) -> None:
        super().__init__(ghost_capacity=ghost_capacity)
        if hazard is not None and hazard.num_classes != NUM_CLASSES:
            raise InvalidSpecError(f"a hazard table for {hazard.num_classes} classes; the unit classes are {NUM_CLASSES}")
        self.hazard = hazard if hazard is not None else HazardTable(NUM_CLASSES, window_bins=HAZARD_WINDOW_BINS)
        self.warm_start = hazard is not None
        self._events = REFRESH_EVERY if self.warm_start else 0
        self._bin_s, self._last_bin = self.hazard.bin_seconds, self.hazard.num_bins - 1
        self._rows = [self.hazard.probability_row(c) for c in range(NUM_CLASSES)]

    def queue_key(self, unit: Unit) -> tuple[int, int]:
        return (unit.tier, unit.cls)

    def learn_reuse(self, unit: Unit, now: float) -> None:
        self.hazard.record_reuse(unit.cls, max(0.0, now - unit.last_use))
        self._events += 1

    def learn_censored(self, unit: Unit, now: float) -> None:
        self.hazard.record_censored(unit.cls, max(0.0, now - unit.last_use))
        self._events += 1

    def refresh(self, now: float) -> None:
        lives = [(u.cls, max(0.0, now - u.last_use)) for u in self.leaves()]
        lives.extend((u.cls, max(0.0, now - u.last_use)) for _, u in self.ghost.items())
        self.hazard.refresh(lives, checked=False)
        self._rows = [self.hazard.probability_row(c) for c in range(NUM_CLASSES)]
        self._events = 0

    def density(self, unit: Unit, now: float) -> float:
        """Expected hit tokens per byte: P(reuse | class, age) x tokens / bytes."""
        age = now - unit.last_use
        b = int(age // self._bin_s) if age > 0 else 0
        p = self._rows[unit.cls][b if b < self._last_bin else self._last_bin]
        pages = unit.seg_pages if unit.seg_pages > 0 else 1
        return p * pages * self.page_tokens / (pages * self.page_bytes + self.num_states * self.slot_bytes)

    def victim(self, now: float, is_free: Callable[[Unit], bool]) -> Unit | None:
        if self._events >= REFRESH_EVERY:
            self.refresh(now)
        self.demote_expired(now)
        for tier in range(3):
            best: Unit | None = None
            best_score = (0.0, 0.0)
            for key, q in self.queues.items():
                if key[0] != tier or not q.num_live:
                    continue
                head = q.head(is_free, PROBE)
                if head is None:
                    continue
                score = (self.density(head, now), head.last_use)
                if best is None or score < best_score:
                    best, best_score = head, score
            if best is not None:
                return best
        return None


def _has_ttl(unit: Unit) -> bool:
    """A high-tier leaf whose hint is a ttl (it decays to normal)."""
    return unit.tier == HIGH and unit.retain.ttl is not None


#: ``--eviction`` names
EVICTION_POLICIES = ("reuse", "lru")


def make_eviction_policy(name: str | EvictionPolicy, *, hazard: HazardTable | None = None,
                         ghost_capacity: int = 4096) -> EvictionPolicy:
    """A policy by name (``reuse`` / ``lru``), or `name` itself when it is a policy.

    Raises:
        InvalidSpecError: an unknown name, or a hazard table with the lru policy.
    """
    if isinstance(name, EvictionPolicy):
        return name
    if name == "reuse":
        return ReuseEviction(hazard=hazard, ghost_capacity=ghost_capacity)
    if name == "lru":
        if hazard is not None:
            raise InvalidSpecError("a hazard table needs the reuse eviction policy")
        return LruEviction(ghost_capacity=ghost_capacity)
    raise InvalidSpecError(f"unknown eviction policy {name!r}; known: {', '.join(EVICTION_POLICIES)}")
