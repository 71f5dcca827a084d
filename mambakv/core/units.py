"""Eviction units of the decoupled layout: a Mamba state checkpoint and its pages.

A hybrid hit at position ``p`` needs every attention page up to ``p`` *and* a state at ``p``
(CACHE.md), so a cached page past a chain's deepest checkpoint can never be hit, nor can a state
whose pages are gone. The unit index keeps the cached prefix as a tree of pages keyed by their
chained hash (the page grid) and evicts it in units (SGLang's tombstone-leaf deletion; Marconi,
MLSys 2025)::

    chain   p0 - p1 - p2 - p3 - p4 - p5 - p6          * = a state (checkpoint) at that page
                       *              *
    units   U(p2) = {states at p2, pages p0..p2}      interior: p3..p6 hang below it
            U(p5) = {states at p5, pages p3..p5}      a leaf: the policy may evict it
    tail    p6: past the deepest checkpoint, dropped when the request that wrote it is freed

Evicting leaf ``U(p5)`` drops its states, then its pages from ``p5`` up while a page has no other
child, no state and no holder; ``U(p2)`` becomes a leaf. An eviction the unit index did not
choose (a pop of the LRU head when no unit could be evicted, a superblock conversion) is settled
by ``settle``: what it made unreachable goes too. The policy (:mod:`mambakv.core.eviction`)
picks the victims; the index only keeps the tree, the leaves and the ghosts of evicted units.

The tree is kept by segments (:class:`~mambakv.core.unit_types.Segment`), not by page: a run of
pages each the only child of the one before is one object, split where another chain branches
off, where a checkpoint sits (a unit is always a segment's last page) or where a partial eviction
cuts it. In the picture above, one request's chain is two segments, ``[p0 p1 p2]`` and
``[p3 p4 p5]`` (``p6`` is dropped). Registering, evicting and pruning cost per segment plus one
dict entry per page (``where``: page hash -> its segment) and one pool call per segment's pages,
so the 64-token page grid (8.5x finer than a 544-token block) costs the tree almost nothing more.

The invariants, after every coordinator call whatever the policy (``check_invariants``):

1. the tree: each page of a segment is cached in every full-attention group and indexed to it
   (``where``), a segment starts the page after its parent's last one, children and parents
   agree; a unit is its segment's last page, with a state in every Mamba group; the leaf queues
   hold exactly the units without children;
2. no cached page past a chain's deepest checkpoint: a free cached page is in the tree, with a
   checkpoint at or below it;
3. no cached state whose pages are gone: a free cached state has a unit whose segment reaches
   the root;

except on a running request's chain (a copy of the page is in a table, or the hash is on a live
request's chain): it registers when freed. A page is a unit iff every Mamba group caches a state
at its hash, except while a running request that published the state still holds the page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set
from itertools import repeat
from operator import attrgetter

from mambakv.core.arena_pool import ArenaPool
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import MapEntry
from mambakv.core.eviction import EvictionPolicy
from mambakv.core.retention import Retention
from mambakv.core.unit_types import Segment, Unit, UnitStats, unit_class

__all__ = ["Segment", "Unit", "UnitIndex", "UnitStats", "unit_class"]


_REF_CNT = attrgetter("ref_cnt")


def _in_every(maps: dict[int, dict[bytes, MapEntry]], gids: tuple[int, ...], key: bytes) -> bool:
    """Every group of `gids` caches a block under `key`."""
    for gid in gids:
        m = maps.get(gid)
        if m is None or key not in m:
            return False
    return True


def _copies(maps: dict[int, dict[bytes, MapEntry]], gids: tuple[int, ...], key: bytes) -> Iterator[KVCacheBlock]:
    """Every block cached under `key` in the groups `gids` (a hash may have several copies)."""
    for gid in gids:
        m = maps.get(gid)
        e = m.get(key) if m is not None else None
        if e is None:
            continue
        if isinstance(e, dict):
            yield from e.values()
        else:
            yield e


def _held(maps: dict[int, dict[bytes, MapEntry]], gids: tuple[int, ...], key: bytes) -> bool:
    """A copy cached under `key` in one of `gids` is in a table."""
    return any(b.ref_cnt for b in _copies(maps, gids, key))


def _partial_state(key: bytes, others: list[dict[bytes, object]]) -> bool:
    """`key` has a state in one of the Mamba groups after the first (a plain loop: hot)."""
    for m in others:
        if key in m:
            return True
    return False


def _touch(unit: Unit, retain: Retention, now: float, policy: object) -> None:
    unit.retain = unit.retain.stronger(retain)
    unit.last_use = now
    if unit.leaf:
        policy.touch(unit)  # type: ignore[attr-defined]


def _as_list(keys: Sequence[bytes]) -> list[bytes]:
    return keys if isinstance(keys, list) else list(keys)


def _blocks(entry: object) -> list[KVCacheBlock]:
    return list(entry.values()) if isinstance(entry, dict) else [entry]  # type: ignore[list-item]


class UnitIndex:
    """The segment tree of cached pages, its units and the policy that ranks the leaves.

    Args:
        pages / slots: the arena's page and state-slot pools.
        page_gids: the full-attention group ids (their pages make a unit's chain).
        state_gids: the Mamba group ids (a checkpoint has a state in each).
        page_tokens: tokens per page.
        page_bytes / slot_bytes: bytes a page / a state slot occupies (a slot: its superblock).
        policy: an :class:`~mambakv.core.eviction.EvictionPolicy`.
    """

    def __init__(self, pages: ArenaPool, slots: ArenaPool, page_gids: Sequence[int], state_gids: Sequence[int], *,
                 page_tokens: int, page_bytes: int, slot_bytes: int, policy: EvictionPolicy) -> None:
        self.pages, self.slots = pages, slots
        self.page_gids, self.state_gids = tuple(page_gids), tuple(state_gids)
        self.page_tokens, self.page_bytes, self.slot_bytes = page_tokens, page_bytes, slot_bytes
        self.policy = policy
        #: the sentinel above page 0 (no page, no unit): its kids are the chains' first segments
        self.root = Segment([], 0, None)
        #: page hash -> the segment holding it (in the order the pages joined the tree)
        self.where: dict[bytes, Segment] = {}
        self.stats = UnitStats()
        policy.configure(page_tokens=page_tokens, page_bytes=page_bytes, slot_bytes=slot_bytes,
                         num_states=len(self.state_gids), stats=self.stats)
        #: seconds: the engine's clock, set by the coordinator from each call's ``now``
        self.now = 0.0
        #: called with a unit about to be evicted, its blocks still cached (a host tier's
        #: write-on-evict store); None: nothing
        self.before_evict: Callable[[Unit], None] | None = None

    # ------------------------------------------------------------------ lookups
    # Plain loops over the groups' maps, no lists: they run once or more per page of every chain.
    def page_present(self, key: bytes) -> bool:
        return _in_every(self.pages.cached_block_hash_to_block, self.page_gids, key)

    def page_held(self, key: bytes) -> bool:
        return _held(self.pages.cached_block_hash_to_block, self.page_gids, key)

    def state_present(self, key: bytes) -> bool:
        return _in_every(self.slots.cached_block_hash_to_block, self.state_gids, key)

    def state_free(self, key: bytes) -> bool:
        """No copy of the state at `key` is in a table."""
        return not _held(self.slots.cached_block_hash_to_block, self.state_gids, key)

    @property
    def num_pages(self) -> int:
        """Pages in the tree."""
        return len(self.where)

    def has_page(self, key: bytes) -> bool:
        """The page hash `key` is in the tree."""
        return key in self.where

    def unit_at(self, key: bytes) -> Unit | None:
        """The live unit whose checkpoint is the page hash `key`, or None."""
        seg = self.where.get(key)
        if seg is None or seg.unit is None or seg.keys[-1] != key:
            return None
        return seg.unit

    def page_entries(self) -> Iterator[tuple[bytes, int, Unit | None]]:
        """Every page of the tree as ``(hash, page index, the unit checkpointed there or None)``:
        segments parents first, each one's pages in chain order. O(pages)."""
        for seg in self.segments():
            last = len(seg.keys) - 1
            for i, key in enumerate(seg.keys):
                yield key, seg.start + i, seg.unit if i == last else None

    def segments(self) -> Iterator[Segment]:
        """Every segment of the tree, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            seg = stack.pop()
            yield seg
            stack.extend(seg.children.values())

    def live_units(self) -> Iterator[Unit]:
        """Every live unit, parents before children."""
        return (seg.unit for seg in self.segments() if seg.unit is not None)

    def chain_keys(self, key: bytes) -> list[bytes]:
        """The page hashes from page 0 down to the tree's page `key`, in chain order.

        Raises:
            KeyError: `key` is not in the tree."""
        seg = self.where[key]
        parts = [seg.keys[:seg.keys.index(key) + 1]]
        seg = seg.parent  # type: ignore[assignment]
        while seg is not None:
            parts.append(seg.keys)
            seg = seg.parent  # type: ignore[assignment]
        return [k for part in reversed(parts) for k in part]

    def _free_copies(self, pool: ArenaPool, gids: tuple[int, ...], key: bytes, out: list[KVCacheBlock]) -> None:
        out.extend(b for b in _copies(pool.cached_block_hash_to_block, gids, key) if not b.ref_cnt)

    def _drop(self, pool: ArenaPool, gids: tuple[int, ...], key: bytes) -> int:
        """Drop every free copy cached under `key` in `gids`; the blocks freed."""
        blocks: list[KVCacheBlock] = []
        self._free_copies(pool, gids, key, blocks)
        if blocks:
            pool.drop_cached(blocks)
        return len(blocks)

    def _depth(self, hashes: Sequence[bytes], lo: int, hi: int) -> int:
        """How many pages of the chain `hashes` are in the tree, given ``lo <= it <= hi``: the
        tree is closed under parents and a chained hash names its whole prefix, so a chain's
        pages in the tree are a prefix of it, found by bisection."""
        where = self.where
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in where:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def checkpoints(self, hashes: Sequence[bytes]) -> list[int]:
        """Page indices of the units on the chain `hashes`, ascending: its deepest page in the
        tree, then the walk up the segments to the root."""
        lo = self._depth(hashes, 0, len(hashes))
        if not lo:
            return []
        seg: Segment | None = self.where[hashes[lo - 1]]
        if seg.end > lo - 1:  # type: ignore[union-attr]  # its unit is past the chain
            seg = seg.parent  # type: ignore[union-attr]
        positions: list[int] = []
        while seg is not None:
            if seg.unit is not None:
                positions.append(seg.end)
            seg = seg.parent
        positions.reverse()
        return positions

    def _split(self, seg: Segment, i: int) -> Segment:
        """Make page `i` (of `seg`, not its last) the end of `seg`: the pages below it become a
        new child segment that takes the kids and the unit. Returns `seg`. O(pages moved)."""
        keys = seg.keys
        j = i - seg.start + 1
        low = Segment(keys[j:], i + 1, seg)
        seg.truncate(j)
        low.kids, seg.kids = seg.kids, low
        low.unit, seg.unit = seg.unit, None
        if low.unit is not None:
            low.unit.node = low
        for c in low.children.values():
            c.parent = low
        self.where.update(zip(low.keys, repeat(low)))
        return seg

    def _cut(self, key: bytes, i: int) -> Segment:
        """The segment that ends at page `i` (hash `key`, in the tree), split there if needed."""
        seg = self.where[key]
        return self._split(seg, i) if i < seg.end else seg

    def _grow(self, parent: Segment, keys: list[bytes], start: int) -> Segment:
        """A new segment of `keys` (pages from `start`) below `parent`'s last page."""
        seg = Segment(keys, start, parent)
        self.where.update(zip(keys, repeat(seg)))
        parent.add_child(seg, self.policy)  # a leaf unit gets a child: out of the leaf queues
        return seg

    def _extend(self, keys: list[bytes], t: int, j: int, below: Segment | None) -> Segment:
        """A new segment of the chain's pages up to `j`, past the tree (which holds ``keys[:t]``):
        below `below`, the previous new segment (its unit has no leaf yet), or, for the first
        (None), below page ``t - 1`` (split there; the root for ``t == 0``)."""
        if below is None:
            return self._grow(self._cut(keys[t - 1], t - 1) if t else self.root, keys[t:j + 1], t)
        seg = Segment(keys[below.end + 1:j + 1], below.end + 1, below)
        self.where.update(zip(seg.keys, repeat(seg)))
        below.kids = seg
        return seg

    @staticmethod
    def _last_unit_index(seg: Segment | None) -> int:
        """The page index of the deepest unit at or above `seg`'s last page, -1 if none."""
        while seg is not None and seg.unit is None:
            seg = seg.parent
        return seg.end if seg is not None else -1

    def _above(self, key: bytes, i: int) -> Segment:
        """The segment whose last page is at or above page `i` (hash `key`, in the tree) on the
        chain and whose unit, if any, is on the chain up to `i`."""
        seg = self.where[key]
        return seg if seg.end == i else seg.parent  # type: ignore[return-value]

    # ------------------------------------------------------------------ admission / free
    def admit(self, hashes: Sequence[bytes], num_prompt_pages: int, hit_pages: int, now: float) -> Unit | None:
        """A request's first allocation: its leaf units on the chain were reused (their life ends
        in a reuse), evicted units on its chain are ghost hits. Returns the deepest unit that
        ended an earlier prompt on the chain (live or ghost), the request's conversation parent."""
        self.now = now
        policy, page = self.policy, self.page_tokens
        chain = hashes[:min(num_prompt_pages, len(hashes))]
        parent: Unit | None = None
        parent_index = -1
        seg: Segment | None = None
        if 0 < hit_pages <= len(chain):
            key = chain[hit_pages - 1]
            if key in self.where:
                seg = self._above(key, hit_pages - 1)
        while seg is not None:  # the hit's units: a leaf among them was reused
            unit = seg.unit
            if unit is not None:
                if unit.leaf:
                    policy.on_reuse(unit, now, hit_pages * page)
                if unit.prompt_end and parent is None:
                    parent, parent_index = unit, seg.end
            seg = seg.parent
        for i, unit in policy.ghost.pop_present(chain):  # evicted units on the chain: ghost hits
            policy.on_ghost_hit(unit, now, (i + 1 - hit_pages) * page)
            if unit.prompt_end and i > parent_index:
                parent, parent_index = unit, i
        return parent

    def register(self, hashes: Sequence[bytes], tables: Sequence[Sequence[KVCacheBlock]], *, retain: Retention,
                 arrival: float, prompt_tokens: int, parent: Unit | None, now: float, start: int = 0) -> None:
        """A request was freed: add its chain (`hashes`, its full-attention `tables`) to the tree,
        make units of the checkpoints on it, drop its pages past the deepest one::

            request's pages   0 ........ t-1 | t ...... d | d+1 ...... n-1 | n ... (a gap: unreachable)
                              in the tree      new segments | tail: dropped   | dropped
                              (units touched,  one per unit  (unless in the tree)
                               split at new ones)

        ``d`` is the deepest page with a state in every Mamba group; a state in some groups only
        (one was evicted while the request held the others) is dropped: it never hits. Pages join
        the tree only up to ``d``: a tail page never does. The whole chain is walked, its hit
        included (a unit there may have been evicted and published again while the request ran).
        `start`: ``hashes[:start]`` are in the tree already (a host tier's known prefix);
        ``tables[g][j]`` is then the block at ``start + j`` and the walk begins at `start`.
        Cost: one dict lookup per page, then work per state and per segment."""
        self.now = now

        n = min(len(hashes), start + min((len(t) for t in tables), default=0))
        where, policy = self.where, self.policy
        assert start == 0 or hashes[start - 1] in where, "a known prefix must be in the tree"
        # The whole chain is walked, its hit included: while the request ran, a unit on its hit may
        # have been evicted (its state freed by retirement) and another request may have published
        # a state there again; skipping the hit missed that (found by the fuzzer).
        # The reachable prefix: every page cached in every full-attention group.
        i = start
        if len(self.page_gids) == 1:  # one full-attention group: one map
            pm = self.pages.cached_block_hash_to_block.get(self.page_gids[0]) or {}
            while i < n and hashes[i] in pm:
                i += 1
        else:
            page_present = self.page_present
            while i < n and page_present(hashes[i]):
                i += 1
        state_maps = self.slots.cached_block_hash_to_block
        first = state_maps.get(self.state_gids[0]) or {}
        others: list[dict[bytes, object]] = [m for m in (state_maps.get(g) for g in self.state_gids[1:]) if m]  # type: ignore[misc]  # a partial state may miss the first
        if i < n:  # past a gap nothing is reachable: drop the request's own free pages and free states
            lost = [b for t in tables for b in t[i - start:] if b.block_hash is not None and not b.ref_cnt and not b.is_null]
            if lost:
                self.pages.drop_cached(lost)
                self.stats.tail_pages += len(lost)
            for key in hashes[i:]:  # a page in the tree keeps a whole state (its unit), not a partial one
                if (key in first or _partial_state(key, others)) and (key not in where
                                                                      or not self.state_present(key)):
                    self._drop(self.slots, self.state_gids, key)
        n = i
        keys = _as_list(hashes[:n])  # one read of the chain (a BlockHashView reads per page)
        # the deepest checkpoint
        state_present = self.state_present
        d = n - 1
        while d >= start and not (keys[d] in first and state_present(keys[d])):
            d -= 1
        if d < start:  # no new checkpoint: the new pages are a tail
            d = start - 1
        t = self._depth(keys, start, n)  # keys[:t] are in the tree
        depth = parent.depth + 1 if parent is not None else 1
        gap = arrival - parent.arrival if parent is not None else None
        cls = unit_class(depth, gap, prompt_tokens)
        last_index = self._last_unit_index(self._above(keys[start - 1], start - 1)) if start else -1
        last_unit: Unit | None = None
        # the pages with a state (in some group) up to d, ascending: units, or partial states dropped
        span = range(start, d + 1)
        marked = [j for j in span if keys[j] in first]
        if others:  # one membership pass per group (no call per page), merged ascending
            with_state = set(marked)
            for m in others:
                with_state.update([j for j in span if keys[j] in m])
            marked = sorted(with_state)
        grow: Segment | None = None  # the last new segment (past the tree): the next one hangs below it
        for j in marked:
            key = keys[j]
            if key not in first or not state_present(key):
                if self._drop(self.slots, self.state_gids, key):
                    self.stats.partial_states += 1  # part of a state (one group's was evicted): it never hits
                continue
            if j < t:  # in the tree: a unit there is touched, a new one splits its segment
                seg = self._cut(key, j)
                unit = seg.unit
                if unit is None:
                    unit = seg.unit = Unit(key, seg, cls, retain, now, j - last_index, depth, arrival)
                else:
                    _touch(unit, retain, now, policy)
            else:  # past the tree: a new segment ends at each new unit
                seg = grow = self._extend(keys, t, j, grow)
                unit = seg.unit = Unit(key, seg, cls, retain, now, j - last_index, depth, arrival)
            last_unit, last_index = unit, j
        if last_unit is not None:
            last_unit.prompt_end = True
        # the tail: pages past the deepest checkpoint (the tree's pages stay with their whole
        # states, their partial states go; the rest go)
        blocks: list[KVCacheBlock] = []
        for j in range(d + 1, n):
            key = keys[j]
            has_state = key in first or _partial_state(key, others)
            if j < t:
                if has_state and not state_present(key) and self._drop(self.slots, self.state_gids, key):
                    self.stats.partial_states += 1
                continue
            if has_state and self._drop(self.slots, self.state_gids, key):
                self.stats.partial_states += 1
            self._free_copies(self.pages, self.page_gids, key, blocks)
        if blocks:
            self.pages.drop_cached(blocks)
            self.stats.tail_pages += len(blocks)
        last = max(d, min(t, n) - 1)  # the deepest page of the chain in the tree now
        if last >= 0:
            seg = where[keys[last]]
            if seg.end == last:
                self.stats.tail_pages += self.prune(seg)

    def add_chain(self, hashes: Sequence[bytes], start: int, positions: Sequence[int], *, retain: Retention,
                  now: float, prompt_tokens: int) -> None:
        """A store into this (host) tier: every page of ``hashes[:positions[-1] + 1]`` is cached,
        ``hashes[:start]`` are in the tree, and the new states are exactly at `positions`
        (ascending, none a unit yet; one below `start` starts the walk there): the pages join
        the tree from `start`, units at `positions`. The lean form of ``register``: no presence
        checks, no tails (the chain ends at its deepest state)."""
        self.now = now
        start = min(start, positions[0])  # a state above the known prefix: the walk starts there
        end = positions[-1] + 1
        keys = _as_list(hashes[:end])
        t = self._depth(keys, start, end)  # keys[:t] are in the tree
        last_index = self._last_unit_index(self._above(keys[start - 1], start - 1)) if start else -1
        cls = unit_class(1, None, prompt_tokens)
        unit: Unit | None = None
        grow: Segment | None = None
        for p in positions:
            if p < t:
                seg = self._cut(keys[p], p)
            else:
                seg = grow = self._extend(keys, t, p, grow)
            assert seg.unit is None, f"page {p} is a unit already"
            unit = seg.unit = Unit(seg.keys[-1], seg, cls, retain, now, p - last_index, 1, now)
            last_index = p
        if unit is not None:
            unit.prompt_end = True
            self.prune(unit.node)  # type: ignore[arg-type]  # the deepest unit becomes a leaf

    # ------------------------------------------------------------------ eviction
    def evict_unit(self, unit: Unit, *, chosen: bool = True) -> tuple[int, int]:
        """Drop `unit`'s states and the pages only it needed; it becomes a ghost.
        Returns ``(pages, slots)`` freed. `chosen`: the policy picked it (else a cascade)."""
        seg = unit.node
        assert seg is not None and seg.unit is unit
        if self.before_evict is not None:
            self.before_evict(unit)
        slots = self._drop(self.slots, self.state_gids, unit.key)
        seg.unit = None
        self.policy.on_evict(unit, self.now, chosen=chosen)
        pages = self.prune(seg)
        return pages, slots

    def prune_page(self, key: bytes) -> int:
        """``prune`` from the tree's page `key` (nothing if it is not in the tree or has a child)."""
        seg = self.where.get(key)
        if seg is None or seg.keys[-1] != key:
            return 0
        return self.prune(seg)

    def prune(self, seg: Segment) -> int:
        """Drop pages from `seg`'s last page up while a page has no child, no state and no holder,
        one pool call for them all; a unit left without children becomes a leaf. Returns the
        pages freed::

            [a0 a1 a2]*  ->  [b0 b1 b2 b3]          b3: no child, no unit: pruned from
                                  ^ held            b1 is held: b2, b3 go, the segment ends at b1

            with nothing held: all of [b0..b3] goes, then [a0 a1 a2] ends in a unit with no
            child left: it becomes a leaf
        """
        where, policy, pages, gids, root = self.where, self.policy, self.pages, self.page_gids, self.root
        maps = pages.cached_block_hash_to_block
        blocks: list[KVCacheBlock] = []
        single = maps.get(gids[0]) if len(gids) == 1 else None
        s = seg
        while s is not root and s.kids is None and s.unit is None:
            keys = s.keys
            if single is not None:  # one full-attention group: the whole segment in one pass
                run = list(map(single.get, reversed(keys)))
                try:
                    held = any(map(_REF_CNT, run))
                except AttributeError:  # a page with several copies (a dict) or none: page by page
                    held = True
                if not held:
                    blocks += run  # type: ignore[arg-type]  # each one a block: its ref_cnt was read
                    j = 0
                else:
                    j = self._free_tail(keys, single, maps, gids, blocks)
            else:
                j = self._free_tail(keys, None, maps, gids, blocks)
            for key in keys[j:]:
                del where[key]
            if j:  # a held page: the segment now ends there
                s.truncate(j)
                break
            parent = s.parent
            assert parent is not None
            parent.remove_child(s)
            s.parent = None
            s = parent
        else:
            if s.unit is not None and s.kids is None and not s.unit.leaf:
                s.unit.last_use = self.now  # its life as a leaf starts now (ages are since then)
                policy.add_leaf(s.unit)
        if blocks:
            pages.drop_cached(blocks)
        return len(blocks)

    def _free_tail(self, keys: list[bytes], single: dict[bytes, MapEntry] | None,
                   maps: dict[int, dict[bytes, MapEntry]], gids: tuple[int, ...], blocks: list[KVCacheBlock]) -> int:
        """Collect the free copies of `keys`' pages from the last one up until a held page;
        returns how many pages stay (the held page and those above it)."""
        j = len(keys)
        while j:
            key = keys[j - 1]
            e = single.get(key) if single is not None else None
            if e is not None and not isinstance(e, dict):  # one copy in the one group
                if e.ref_cnt:
                    break
                blocks.append(e)
            elif _held(maps, gids, key):
                break
            else:
                self._free_copies(self.pages, gids, key, blocks)
            j -= 1
        return j

    def settle(self) -> None:
        """Follow up the evictions the index did not choose (recorded by the pools): a lost page
        takes its subtree, a lost state its unit."""
        pages, slots = self.pages.prefix_map, self.slots.prefix_map
        where = self.where
        while pages.lost or slots.lost:  # type: ignore[attr-defined]
            lost_pages, pages.lost = pages.lost, []  # type: ignore[attr-defined]
            lost_states, slots.lost = slots.lost, []  # type: ignore[attr-defined]
            for key in lost_pages:
                seg = where.get(key)
                if seg is not None and not self.page_present(key):
                    self._break(seg, seg.keys.index(key))
            for key in lost_states:
                unit = self.unit_at(key)
                if unit is not None:
                    if not self.state_present(key):
                        self.stats.cascades += 1
                        self.evict_unit(unit, chosen=False)
                elif not self.state_present(key) and self._drop(self.slots, self.state_gids, key):
                    self.stats.partial_states += 1

    def _break(self, seg: Segment, j: int) -> None:
        """The page ``seg.keys[j]`` is gone: nothing below it can be hit (its pages and units go,
        in depth-first order, each page's copies after its unit's states)."""
        self.stats.cascades += 1
        where = self.where
        stack = [(seg, j)]
        while stack:
            s, k = stack.pop()
            stack.extend((c, 0) for c in s.children.values())
            keys = s.keys
            for key in keys[k:-1]:
                self._drop(self.pages, self.page_gids, key)
                del where[key]
            if s.unit is not None:
                self._drop(self.slots, self.state_gids, keys[-1])
                unit, s.unit = s.unit, None
                self.policy.on_evict(unit, self.now, chosen=False)
            self._drop(self.pages, self.page_gids, keys[-1])
            del where[keys[-1]]
        seg.kids = None
        if j:
            seg.truncate(j)
            self.prune(seg)
        else:
            parent = seg.parent
            assert parent is not None
            parent.remove_child(seg)
            seg.parent = None
            self.prune(parent)

    def clear(self) -> None:
        """Forget every segment (the prefix cache was reset); ghosts and learned tables stay."""
        for key, seg in self.where.items():  # units in the order their pages joined the tree
            if seg.unit is not None and seg.keys[-1] == key:
                self.policy.on_evict(seg.unit, self.now, chosen=False)
        self.where.clear()
        self.root.kids = None
        self.pages.prefix_map.lost.clear()  # type: ignore[attr-defined]
        self.slots.prefix_map.lost.clear()  # type: ignore[attr-defined]

    def check_invariants(self, live_keys: Set[bytes] = frozenset()) -> None:
        """Assert the invariants of the module docstring, O(cached blocks + pages). `live_keys`:
        the page-grid hashes of the running requests' chains (what they will register when freed).

        Raises:
            AssertionError: an invariant is broken."""
        root, where = self.root, self.where
        assert root.unit is None and not root.keys and root.parent is None
        # every segment once, parents first; the checkpoint flags bottom-up
        order: list[Segment] = []
        stack = [root]
        while stack:
            s = stack.pop()
            order.append(s)
            for ck, c in s.children.items():
                assert c.parent is s and c.keys and c.keys[0] == ck, f"{c!r}: child link"
                assert c.start == s.end + 1, f"{c!r} does not start below {s!r}"
                assert c.end == c.start + len(c.keys) - 1, f"{c!r}: end is not its last page"
                stack.append(c)
        has_checkpoint: dict[int, bool] = {}
        for s in reversed(order):
            has_checkpoint[id(s)] = s.unit is not None or any(has_checkpoint[id(c)] for c in s.children.values())
        num_pages = leaves = 0
        for s in order[1:]:
            num_pages += len(s.keys)
            for key in s.keys:
                assert where.get(key) is s, f"{s!r}: a page indexed to another segment"
                assert self.page_present(key), f"{s!r}: a page is not cached"
            for key in s.keys[:-1]:  # no unit inside a segment
                if self.state_present(key):  # published on a running chain (a junction): a unit when it is freed
                    assert key in live_keys or self.page_held(key), f"{s!r}: a state in every group but no unit"
            u = s.unit
            if u is not None:
                assert u.node is s and u.key == s.keys[-1], f"{s!r}: unit link"
                assert self.state_present(u.key), f"{s!r}: a unit without a state in every group"
                assert u.leaf == (s.kids is None), f"unit at {s.end}: leaf flag {u.leaf} with {len(s.children)} children"
                leaves += u.leaf
            elif self.state_present(s.keys[-1]):
                assert s.keys[-1] in live_keys or self.page_held(s.keys[-1]), f"{s!r}: a state in every group but no unit"
        assert num_pages == len(where), f"{len(where)} pages indexed, {num_pages} in the segments"
        assert leaves == self.policy.num_leaves, f"{leaves} leaf units, policy queues {self.policy.num_leaves}"
        self.policy.check_invariants()

        page_maps = self.pages.cached_block_hash_to_block
        for gid in self.page_gids:
            for key, entry in page_maps.get(gid, {}).items():
                if all(b.ref_cnt == 0 for b in _blocks(entry)) and key not in live_keys and not self.page_held(key):
                    page_seg = where.get(key)
                    assert page_seg is not None, "a free cached page outside the tree"
                    assert has_checkpoint[id(page_seg)], \
                        f"a free cached page in {page_seg!r} past its chain's deepest checkpoint"
        state_maps = self.slots.cached_block_hash_to_block
        for gid in self.state_gids:
            for key, entry in state_maps.get(gid, {}).items():
                if any(b.ref_cnt == 0 for b in _blocks(entry)) and key not in live_keys and not self.page_held(key):
                    assert self.unit_at(key) is not None, "a free cached state without its unit"
                    up: Segment | None = where[key]
                    while up is not None and up is not root:
                        up = up.parent
                    assert up is root, "a free cached state whose chain does not reach the root"
