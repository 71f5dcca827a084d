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
Evicted units stay in a bounded :class:`~mambakv.core.ghost.GhostIndex`, so that a next turn after
an eviction still finds its parent's class and still teaches the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mambakv.core.errors import InvalidSpecError
from mambakv.core.ghost import GhostIndex
from mambakv.core.hazard import HazardTable
from mambakv.core.leaf_queue import LeafQueue
from mambakv.core.retention import HIGH, NORMAL
from mambakv.core.unit_types import NUM_CLASSES, Unit, UnitStats

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "LruEviction", "ReuseEviction", "make_eviction_policy"]

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
