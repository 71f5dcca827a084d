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

from collections import OrderedDict
from collections.abc import Callable, Iterator

from mambakv.core.errors import InvalidSpecError
from mambakv.core.ghost import GhostIndex
from mambakv.core.hazard import HazardTable
from mambakv.core.retention import HIGH, NORMAL
from mambakv.core.unit_types import NUM_CLASSES, Unit, UnitStats

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "LruEviction", "ReuseEviction", "make_eviction_policy"]

#: leaves tried from a queue's head when the first ones are pinned (their state is in a table)
PROBE = 64
#: refresh the hazard table after this many reuse / censored events
REFRESH_EVERY = 64


class EvictionPolicy:
    """The leaf queues (one OrderedDict per queue key, LRU first), the ghosts and the counts.

    Subclasses choose the queue key and the victim. Args: ghost_capacity: evicted units kept."""

    name = "lru"

    def __init__(self, *, ghost_capacity: int = 4096) -> None:
        self.ghost: GhostIndex[Unit] = GhostIndex(ghost_capacity)
        self.queues: dict[tuple[int, int], OrderedDict[bytes, Unit]] = {}
        self.stats = UnitStats()
        self.num_leaves = 0
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
        key = self.queue_key(unit)
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = OrderedDict()
        q[unit.key] = unit
        self.num_leaves += 1

    def remove_leaf(self, unit: Unit) -> None:
        assert unit.leaf
        del self.queues[self.queue_key(unit)][unit.key]
        unit.leaf = False
        self.num_leaves -= 1

    def touch(self, unit: Unit) -> None:
        """A leaf was used (its ``last_use`` is now): newest of its queue, tier from its hint."""
        if unit.tier != unit.retain.tier:
            self.remove_leaf(unit)
            self.add_leaf(unit)
        else:
            self.queues[self.queue_key(unit)].move_to_end(unit.key)

    def leaves(self) -> Iterator[Unit]:
        for q in self.queues.values():
            yield from q.values()

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
        """High-tier leaves whose ttl passed go to the front of their normal queue."""
        for key in [k for k in self.queues if k[0] == HIGH]:
            q = self.queues[key]
            expired = [u for u in q.values() if u.retain.ttl is not None and now - u.last_use >= u.retain.ttl]
            for u in expired:
                self.remove_leaf(u)
                u.leaf = True
                u.tier = NORMAL
                nk = self.queue_key(u)
                nq = self.queues.setdefault(nk, OrderedDict())
                nq[u.key] = u
                nq.move_to_end(u.key, last=False)
                self.num_leaves += 1

    def victim(self, now: float, is_free: Callable[[Unit], bool]) -> Unit | None:
        """The leaf to evict next (its states free: `is_free`), or None."""
        self.demote_expired(now)
        for tier in range(3):
            for key, q in self.queues.items():
                if key[0] == tier:
                    head = _first_free(q, is_free)
                    if head is not None:
                        return head
        return None

    def check_invariants(self) -> None:
        n = 0
        for key, q in self.queues.items():
            for k, u in q.items():
                assert u.leaf and u.key == k and u.node is not None and u.node.unit is u, f"leaf {u!r} stale"
                assert self.queue_key(u) == key, f"leaf {u!r} in queue {key}"
                n += 1
        assert n == self.num_leaves
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
        self.hazard = hazard if hazard is not None else HazardTable(NUM_CLASSES)
        self.warm_start = hazard is not None
        self._events = REFRESH_EVERY if self.warm_start else 0

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
        self.hazard.refresh(lives)
        self._events = 0

    def density(self, unit: Unit, now: float) -> float:
        """Expected hit tokens per byte: P(reuse | class, age) x tokens / bytes."""
        p = self.hazard.reuse_probability(unit.cls, max(0.0, now - unit.last_use))
        pages = max(unit.seg_pages, 1)
        return p * pages * self.page_tokens / (pages * self.page_bytes + self.num_states * self.slot_bytes)

    def victim(self, now: float, is_free: Callable[[Unit], bool]) -> Unit | None:
        if self._events >= REFRESH_EVERY:
            self.refresh(now)
        self.demote_expired(now)
        for tier in range(3):
            best: Unit | None = None
            best_score = (0.0, 0.0)
            for key, q in self.queues.items():
                if key[0] != tier or not q:
                    continue
                head = _first_free(q, is_free)
                if head is None:
                    continue
                score = (self.density(head, now), head.last_use)
                if best is None or score < best_score:
                    best, best_score = head, score
            if best is not None:
                return best
        return None


def _first_free(q: OrderedDict[bytes, Unit], is_free: Callable[[Unit], bool]) -> Unit | None:
    for i, u in enumerate(q.values()):
        if is_free(u):
            return u
        if i >= PROBE:
            break
    return None


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
