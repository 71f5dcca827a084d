"""The records of the unit index (:mod:`mambakv.core.units`): segments of pages, units, their classes.

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

__all__ = ["CLASS_NAMES", "NUM_CLASSES", "Segment", "Unit", "UnitStats", "unit_class"]

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


class Segment:
    """A run of cached pages on one chain: ``keys[i]`` is the hash of page ``start + i``, and
    every page but the last has exactly one child, the next page. The tree of the unit index is
    a tree of segments: a chain's pages share a segment until another chain branches off or a
    checkpoint sits, so a long prompt is one object, not one per page::

        chain A   p0 p1 p2 p3 p4 p5 p6 p7        * = a unit (a checkpoint: a segment's last page)
                        *              *
        chain B   p0 .. p4 q5 q6                   B branches off after p4
                              *
        segments  [p0 p1 p2]* - [p3 p4] - [p5 p6 p7]*
                                        - [q5 q6]*

    A segment splits on demand (``UnitIndex``): at a new checkpoint or a branch inside it, and
    it is cut from its last page up by a partial eviction. ``unit`` sits at the last page only;
    ``kids`` holds None (no child), the one child Segment, or a dict (a child's first page hash
    -> Segment) of two or more. ``children`` reads them as a mapping (in insertion order)."""

    __slots__ = ("keys", "start", "end", "parent", "kids", "unit")

    def __init__(self, keys: list[bytes], start: int, parent: Segment | None) -> None:
        self.keys = keys  # shrink it with ``truncate`` only (it keeps ``end``)
        self.start = start  # page index of keys[0] on the chain (tokens = (index + 1) x page_tokens)
        #: the page index of the last page (-1 for the root sentinel, which has no page)
        self.end = start + len(keys) - 1
        self.parent = parent
        self.kids: Segment | dict[bytes, Segment] | None = None
        self.unit: Unit | None = None

    def truncate(self, j: int) -> None:
        """Keep the first `j` pages (0 < j <= len(keys))."""
        del self.keys[j:]
        self.end = self.start + j - 1

    def __repr__(self) -> str:
        return f"Segment(pages {self.start}..{self.end}, unit={self.unit is not None})"

    @property
    def children(self) -> Mapping[bytes, Segment]:
        """The children by their first page hash (read-only: change them with ``add_child`` /
        ``remove_child``)."""
        k = self.kids
        if k is None:
            return _NO_CHILDREN
        if isinstance(k, Segment):
            return {k.keys[0]: k}
        return MappingProxyType(k)

    def add_child(self, seg: Segment, policy: object) -> None:
        """Link `seg` below the last page; a leaf unit here leaves the policy's leaf queues."""
        k = self.kids
        if k is None:
            if self.unit is not None and self.unit.leaf:
                policy.remove_leaf(self.unit)  # type: ignore[attr-defined]
            self.kids = seg
        elif isinstance(k, Segment):
            self.kids = {k.keys[0]: k, seg.keys[0]: seg}
        else:
            k[seg.keys[0]] = seg

    def remove_child(self, seg: Segment) -> None:
        """Unlink the child `seg` (a branch left with one child holds it directly again)."""
        k = self.kids
        if k is seg:
            self.kids = None
            return
        assert isinstance(k, dict), "not a child"
        del k[seg.keys[0]]
        if len(k) == 1:
            self.kids = next(iter(k.values()))


_NO_CHILDREN: Mapping[bytes, Segment] = MappingProxyType({})


class Unit:
    """A checkpoint: states at ``key`` in every Mamba group, and the pages back to the previous
    checkpoint of the chain that made it (``seg_pages``). Alive while ``node`` (the segment it
    ends) is set; a ghost (evicted, kept for learning) after."""

    __slots__ = ("key", "node", "cls", "retain", "last_use", "seg_pages", "depth", "arrival", "prompt_end",
                 "leaf", "tier", "queue_seq")

    def __init__(self, key: bytes, node: Segment | None, cls: int, retain: Retention, last_use: float,
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
        return f"Unit(index={self.index}, cls={self.cls}, last_use={self.last_use})"

    @property
    def index(self) -> int | None:
        """The page index of its checkpoint on the chain (None: a ghost)."""
        return self.node.end if self.node is not None else None


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
