"""Eviction units of the decoupled layout: a Mamba state checkpoint and its pages.

A hybrid hit at position ``p`` needs every attention page up to ``p`` *and* a state at ``p``
(CACHE.md), so a cached page past a chain's deepest checkpoint can never be hit, nor can a state
whose pages are gone. The unit index keeps the cached prefix as a tree of pages keyed by their
chained hash (the page grid: one node per page) and evicts it in units (SGLang's tombstone-leaf
deletion; Marconi, MLSys 2025)::

    chain   p0 - p1 - p2 - p3 - p4 - p5 - p6          * = a state (checkpoint) at that page
                       *              *
    units   U(p2) = {states at p2, pages p0..p2}      interior: p3..p6 hang below it
            U(p5) = {states at p5, pages p3..p5}      a leaf: the policy may evict it
    tail    p6: past the deepest checkpoint, dropped when the request that wrote it is freed

Evicting leaf ``U(p5)`` drops its states, then its pages from ``p5`` up while a page has no other
child, no state and no holder; ``U(p2)`` becomes a leaf. These are invariants whatever the policy
(``check_invariants`` in :mod:`mambakv.core.unit_checks`): every free cached page has a checkpoint
at or below it, every free cached state has all its pages, unless a running request holds the
page (its chain is registered when it is freed). An eviction the unit index did not choose (a
pop of the LRU head when no unit could be evicted, a superblock conversion) is settled by
``settle``: what it made unreachable goes too. The policy (:mod:`mambakv.core.eviction`) picks
the victims; the index only keeps the tree, the leaves and the ghosts of evicted units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set

from mambakv.core.arena_pool import ArenaPool
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import MapEntry
from mambakv.core.eviction import EvictionPolicy
from mambakv.core.retention import Retention
from mambakv.core.unit_types import Node, Unit, UnitStats, unit_class

__all__ = ["Node", "Unit", "UnitIndex", "UnitStats", "unit_class"]


#: most pruned nodes kept for reuse
_SPARE_NODES = 1 << 16


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


class UnitIndex:
    """The page tree, its units and the policy that ranks the leaves.

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
        self.nodes: dict[bytes, Node] = {}
        #: pruned nodes kept for reuse (``new_node``): a reused node is no new GC-tracked object,
        #: so the page churn of a host tier promotes nothing to the old generation
        self.spare: list[Node] = []
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

    def _free_copies(self, pool: ArenaPool, gids: tuple[int, ...], key: bytes, out: list[KVCacheBlock]) -> None:
        out.extend(b for b in _copies(pool.cached_block_hash_to_block, gids, key) if not b.ref_cnt)

    def _drop(self, pool: ArenaPool, gids: tuple[int, ...], key: bytes) -> int:
        """Drop every free copy cached under `key` in `gids`; the blocks freed."""
        blocks: list[KVCacheBlock] = []
        self._free_copies(pool, gids, key, blocks)
        if blocks:
            pool.drop_cached(blocks)
        return len(blocks)

    def checkpoints(self, hashes: Sequence[bytes]) -> list[int]:
        """Page indices of the units on the chain `hashes`, ascending: its deepest node found by
        bisection (a chain's nodes are a prefix of it), then the walk up to the root."""
        nodes = self.nodes
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in nodes:
                lo = mid
            else:
                hi = mid - 1
        positions: list[int] = []
        node = nodes[hashes[lo - 1]] if lo else None
        while node is not None:
            if node.unit is not None:
                positions.append(node.index)
            node = node.parent
        positions.reverse()
        return positions

    def new_node(self, key: bytes, parent: Node | None, index: int) -> Node:
        """``nodes[key]``: a new node (a spare one when there is one), linked by the caller."""
        spare = self.spare
        if spare:
            node = spare.pop()
            node.key, node.parent, node.index = key, parent, index
        else:
            node = Node(key, parent, index)
        self.nodes[key] = node
        return node

    # ------------------------------------------------------------------ admission / free
    def admit(self, hashes: Sequence[bytes], num_prompt_pages: int, hit_pages: int, now: float) -> Unit | None:
        """A request's first allocation: its leaf units on the chain were reused (their life ends
        in a reuse), evicted units on its chain are ghost hits. Returns the deepest unit that
        ended an earlier prompt on the chain (live or ghost), the request's conversation parent."""
        self.now = now
        policy, nodes, page = self.policy, self.nodes, self.page_tokens
        chain = hashes[:min(num_prompt_pages, len(hashes))]
        parent: Unit | None = None
        parent_index = -1
        node = nodes.get(chain[hit_pages - 1]) if 0 < hit_pages <= len(chain) else None
        while node is not None:  # the hit's units: a leaf among them was reused
            unit = node.unit
            if unit is not None:
                if unit.leaf:
                    policy.on_reuse(unit, now, hit_pages * page)
                if unit.prompt_end and parent is None:
                    parent, parent_index = unit, node.index
            node = node.parent
        for i, unit in policy.ghost.pop_present(chain):  # evicted units on the chain: ghost hits
            policy.on_ghost_hit(unit, now, (i + 1 - hit_pages) * page)
            if unit.prompt_end and i > parent_index:
                parent, parent_index = unit, i
        return parent

    def register(self, hashes: Sequence[bytes], tables: Sequence[Sequence[KVCacheBlock]], *, retain: Retention,
                 arrival: float, prompt_tokens: int, parent: Unit | None, now: float, start: int = 0) -> None:
        """A request was freed: add its chain (`hashes`, its full-attention `tables`) to the tree,
        make units of the checkpoints on it, drop its pages past the deepest one
        (:func:`mambakv.core.unit_register.register_chain`; `start`: ``hashes[:start]`` are
        nodes already and ``tables`` begin at `start`)."""
        from mambakv.core.unit_register import register_chain
        self.now = now
        register_chain(self, hashes, tables, retain=retain, arrival=arrival, prompt_tokens=prompt_tokens,
                       parent=parent, now=now, start=start)

    def add_chain(self, hashes: Sequence[bytes], start: int, positions: Sequence[int], *, retain: Retention,
                  now: float, prompt_tokens: int) -> None:
        """A store into this (host) tier: nodes from `start` and units at `positions` of a chain
        whose pages and states were just cached (:func:`mambakv.core.unit_register.add_chain`)."""
        from mambakv.core.unit_register import add_chain
        self.now = now
        add_chain(self, hashes, start, positions, retain=retain, now=now, prompt_tokens=prompt_tokens)

    # ------------------------------------------------------------------ eviction
    def evict_unit(self, unit: Unit, *, chosen: bool = True) -> tuple[int, int]:
        """Drop `unit`'s states and the pages only it needed; it becomes a ghost.
        Returns ``(pages, slots)`` freed. `chosen`: the policy picked it (else a cascade)."""
        node = unit.node
        assert node is not None and node.unit is unit
        if self.before_evict is not None:
            self.before_evict(unit)
        slots = self._drop(self.slots, self.state_gids, unit.key)
        node.unit = None
        self.policy.on_evict(unit, self.now, chosen=chosen)
        pages = self.prune(node)
        return pages, slots

    def prune(self, node: Node) -> int:
        """Drop pages from `node` up while a page has no child, no state and no holder; a unit
        left without children becomes a leaf. Returns the pages freed."""
        nodes, policy, pages, gids, spare = self.nodes, self.policy, self.pages, self.page_gids, self.spare
        maps = pages.cached_block_hash_to_block
        blocks: list[KVCacheBlock] = []
        n: Node | None = node
        single = maps.get(gids[0]) if len(gids) == 1 else None
        while n is not None and n.kids is None and n.unit is None:
            key = n.key
            e = single.get(key) if single is not None else None
            if e is not None and not isinstance(e, dict):  # one copy in the one group: the common case
                if e.ref_cnt:
                    break
                blocks.append(e)
            elif _held(maps, gids, key):
                break
            else:
                self._free_copies(pages, gids, key, blocks)
            del nodes[key]
            parent = n.parent
            if parent is not None:
                if parent.kids is n:
                    parent.kids = None
                else:
                    parent.remove_child(n)
                n.parent = None
            if len(spare) < _SPARE_NODES:  # no children, no unit: as new once re-keyed
                spare.append(n)
            n = parent
        else:
            if n is not None and n.unit is not None and n.kids is None and not n.unit.leaf:
                n.unit.last_use = self.now  # its life as a leaf starts now (ages are since then)
                policy.add_leaf(n.unit)
        if blocks:
            pages.drop_cached(blocks)
        return len(blocks)

    def settle(self) -> None:
        """Follow up the evictions the index did not choose (recorded by the pools): a lost page
        takes its subtree, a lost state its unit."""
        pages, slots = self.pages.prefix_map, self.slots.prefix_map
        while pages.lost or slots.lost:  # type: ignore[attr-defined]
            lost_pages, pages.lost = pages.lost, []  # type: ignore[attr-defined]
            lost_states, slots.lost = slots.lost, []  # type: ignore[attr-defined]
            for key in lost_pages:
                node = self.nodes.get(key)
                if node is not None and not self.page_present(key):
                    self._break(node)
            for key in lost_states:
                node = self.nodes.get(key)
                if node is not None and node.unit is not None:
                    if not self.state_present(key):
                        self.stats.cascades += 1
                        self.evict_unit(node.unit, chosen=False)
                elif not self.state_present(key) and self._drop(self.slots, self.state_gids, key):
                    self.stats.partial_states += 1

    def _break(self, node: Node) -> None:
        """`node`'s page is gone: nothing below it can be hit."""
        self.stats.cascades += 1
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.unit is not None:
                self._drop(self.slots, self.state_gids, n.key)
                unit, n.unit = n.unit, None
                self.policy.on_evict(unit, self.now, chosen=False)
            self._drop(self.pages, self.page_gids, n.key)
            del self.nodes[n.key]
        parent = node.parent
        if parent is not None:
            parent.remove_child(node)
            self.prune(parent)

    def clear(self) -> None:
        """Forget every node (the prefix cache was reset); ghosts and learned tables stay."""
        for node in self.nodes.values():
            if node.unit is not None:
                self.policy.on_evict(node.unit, self.now, chosen=False)
        self.nodes.clear()
        self.pages.prefix_map.lost.clear()  # type: ignore[attr-defined]
        self.slots.prefix_map.lost.clear()  # type: ignore[attr-defined]

    def check_invariants(self, live_keys: Set[bytes] = frozenset()) -> None:
        """:func:`mambakv.core.unit_checks.check_units` (`live_keys`: the running chains' hashes)."""
        from mambakv.core.unit_checks import check_units
        check_units(self, live_keys)
