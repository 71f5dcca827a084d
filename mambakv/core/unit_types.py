"""The records of the unit index (:mod:`mambakv.core.units`): page nodes, units, their classes.

A unit's *class* is what the cache can see of its future when the request that wrote it is
freed (CACHE.md: P(a request is continued) is 0.33 for a first turn, 0.21 under 2k tokens,
0.49-0.68 deeper)::

    field          bins                                   from
    depth          1 | 2 | 3+                             earlier prompts the chain extends, plus one
    gap            none | < 60 s | < 300 s | >= 300 s     arrival minus the parent prompt's arrival
    prompt length  < 2k | < 8k | < 32k | >= 32k tokens    the request's prompt

``class = (depth_bin x 4 + gap_bin) x 4 + length_bin``: 48 ids (a first turn has no gap, so 28
are used).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mambakv.core.retention import Retention

__all__ = ["CLASS_NAMES", "NUM_CLASSES", "Node", "Unit", "UnitStats", "unit_class"]

_GAPS = (60.0, 300.0)
_LENGTHS = (2048, 8192, 32768)
NUM_CLASSES = 48


def unit_class(depth: int, gap_s: float | None, prompt_tokens: int) -> int:
    """The class id of a unit (see the module docstring)."""
    d = 0 if depth <= 1 else 1 if depth == 2 else 2
    g = 0 if gap_s is None else 1 if gap_s < _GAPS[0] else 2 if gap_s < _GAPS[1] else 3
    n = 0 if prompt_tokens < _LENGTHS[0] else 1 if prompt_tokens < _LENGTHS[1] else 2 if prompt_tokens < _LENGTHS[2] else 3
    return (d * 4 + g) * 4 + n


def _class_name(cls: int) -> str:
    d, rest = divmod(cls, 16)
    g, n = divmod(rest, 4)
    return (f"depth {('1', '2', '3+')[d]}, gap {('none', '<60s', '<300s', '>=300s')[g]}, "
            f"prompt {('<2k', '<8k', '<32k', '>=32k')[n]}")


#: class id -> a readable name (JSON metrics)
CLASS_NAMES = tuple(_class_name(c) for c in range(NUM_CLASSES))


class Node:
    """One cached page hash of the tree: its parent, children (by hash) and unit (if a
    checkpoint).

    Most pages have one child: ``kids`` holds None (no child), the one child Node, or a dict
    (hash -> Node) of two or more (a branch point), so a chain costs one GC-tracked object per
    page rather than two. ``children`` reads them as a mapping (in insertion order)."""

    __slots__ = ("key", "parent", "kids", "index", "unit")

    def __init__(self, key: bytes, parent: Node | None, index: int) -> None:
        self.key = key
        self.parent = parent
        self.index = index  # page index on the chain (tokens = (index + 1) x page_tokens)
        self.kids: Node | dict[bytes, Node] | None = None
        self.unit: Unit | None = None

    @property
    def children(self) -> Mapping[bytes, Node]:
        """The children by hash (read-only: change them with ``add_child`` / ``remove_child``)."""
        k = self.kids
        if k is None:
            return _NO_CHILDREN
        if isinstance(k, Node):
            return {k.key: k}
        return MappingProxyType(k)

    def add_child(self, node: Node, policy: object) -> None:
        """Link `node` below this one; a leaf unit here leaves the policy's leaf queues."""
        k = self.kids
        if k is None:
            if self.unit is not None and self.unit.leaf:
                policy.remove_leaf(self.unit)  # type: ignore[attr-defined]
            self.kids = node
        elif isinstance(k, Node):
            self.kids = {k.key: k, node.key: node}
        else:
            k[node.key] = node

    def remove_child(self, node: Node) -> None:
        """Unlink the child `node` (a branch left with one child holds it directly again)."""
        k = self.kids
        if k is node:
            self.kids = None
            return
        assert isinstance(k, dict), "not a child"
        del k[node.key]
        if len(k) == 1:
            self.kids = next(iter(k.values()))


_NO_CHILDREN: Mapping[bytes, Node] = MappingProxyType({})


class Unit:
    """A checkpoint: states at ``key`` in every Mamba group, and the pages back to the previous
    checkpoint of the chain that made it (``seg_pages``). Alive while ``node`` is set; a ghost
    (evicted, kept for learning) after."""

    __slots__ = ("key", "node", "cls", "retain", "last_use", "seg_pages", "depth", "arrival", "prompt_end",
                 "leaf", "tier", "queue_seq")

    def __init__(self, key: bytes, node: Node | None, cls: int, retain: Retention, last_use: float,
                 seg_pages: int, depth: int, arrival: float) -> None:
        self.key = key
        self.node = node
        self.cls = cls
        self.retain = retain
        self.last_use = last_use  # seconds (the engine's clock)
        self.seg_pages = seg_pages
        self.depth = depth
        self.arrival = arrival
        self.prompt_end = False  # the deepest checkpoint of a request's prompt
        self.leaf = False  # in the policy's leaf queues
        self.tier = retain.tier  # the queue tier it is in (a ttl hint decays)
        self.queue_seq = 0  # its live entry in a LeafQueue (0: in none)

    def __repr__(self) -> str:
        return f"Unit(index={self.node.index if self.node else None}, cls={self.cls}, last_use={self.last_use})"


@dataclass
class UnitStats:
    """What the unit index and its policy did (``SuperblockArena.unit_stats``)."""

    evictions: int = 0           # units the policy chose
    cascade_evictions: int = 0   # units lost to an eviction it did not choose
    cascades: int = 0            # such evictions followed up
    tail_pages: int = 0          # pages dropped past a chain's deepest checkpoint
    partial_states: int = 0      # states dropped because another group's state at the position was gone
    reuses: int = 0              # leaf units reused by a later request
    ghost_hits: int = 0          # requests that passed an evicted unit (a hit it would have had)
    ghost_hit_tokens: int = 0    # tokens those hits would have added
    evictions_by_class: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)
    reuses_by_class: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)
    hit_tokens_by_class: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)
    ghost_hits_by_class: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)

    def to_json(self) -> dict[str, object]:
        by_class = {CLASS_NAMES[c]: {"evictions": self.evictions_by_class[c], "reuses": self.reuses_by_class[c],
                                     "hit_tokens": self.hit_tokens_by_class[c],
                                     "ghost_hits": self.ghost_hits_by_class[c]}
                    for c in range(NUM_CLASSES)
                    if self.evictions_by_class[c] or self.reuses_by_class[c] or self.ghost_hits_by_class[c]}
        return {"evictions": self.evictions, "cascade_evictions": self.cascade_evictions, "cascades": self.cascades,
                "tail_pages": self.tail_pages, "partial_states": self.partial_states, "reuses": self.reuses,
                "ghost_hits": self.ghost_hits, "ghost_hit_tokens": self.ghost_hit_tokens, "by_class": by_class}
