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
child, no state and no holder; ``U(p2)`` becomes a leaf. An eviction the unit index did not
choose (a pop of the LRU head when no unit could be evicted, a superblock conversion) is settled
by ``settle``: what it made unreachable goes too. The policy (:mod:`mambakv.core.eviction`)
picks the victims; the index only keeps the tree, the leaves and the ghosts of evicted units.

The invariants, after every coordinator call whatever the policy (``check_invariants``):

1. the tree: each node's page is cached in every full-attention group, its parent is the page
   before it on the chain, children and parents agree; a unit's node has a state in every Mamba
   group; the leaf queues hold exactly the units without children;
2. no cached page past a chain's deepest checkpoint: a free cached page has a node, and a
   checkpoint at or below it;
3. no cached state whose pages are gone: a free cached state has a unit whose node reaches the
   root;

except on a running request's chain (a copy of the page is in a table, or the hash is on a live
request's chain): it registers when freed. A node has a unit iff every Mamba group caches a state
at its hash, except while a running request that published the state still holds the page.
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


def _blocks(entry: object) -> list[KVCacheBlock]:
    return list(entry.values()) if isinstance(entry, dict) else [entry]  # type: ignore[list-item]


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
        make units of the checkpoints on it, drop its pages past the deepest one::

            request's pages   0 ................ d | d+1 ...... n-1 | n ... (a gap: unreachable)
                              nodes, units          | tail: dropped   | dropped
                              (existing ones touched) (unless another chain's nodes)

        ``d`` is the deepest page with a state in every Mamba group; a state in some groups only
        (one was evicted while the request held the others) is dropped: it never hits. Nodes are
        made only up to ``d``: a tail page never enters the tree. The whole chain is walked, its
        hit included (a unit there may have been evicted and published again while the request
        ran). `start`: ``hashes[:start]`` are nodes already (a host tier's known prefix);
        ``tables[g][j]`` is then the block at ``start + j`` and the walk begins at `start`."""
        self.now = now

        n = min(len(hashes), start + min((len(t) for t in tables), default=0))
        nodes, policy = self.nodes, self.policy
        assert start == 0 or hashes[start - 1] in nodes, "a known prefix must be nodes"
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
            for key in hashes[i:]:  # another chain's node keeps a whole state (its unit), not a partial one
                if (key in first or _partial_state(key, others)) and (key not in nodes
                                                                      or not self.state_present(key)):
                    self._drop(self.slots, self.state_gids, key)
        n = i
        # the deepest checkpoint
        state_present = self.state_present
        d = n - 1
        while d >= start and not (hashes[d] in first and state_present(hashes[d])):
            d -= 1
        if d < start:  # no new checkpoint: the new pages are a tail
            d = start - 1
        depth = parent.depth + 1 if parent is not None else 1
        gap = arrival - parent.arrival if parent is not None else None
        cls = unit_class(depth, gap, prompt_tokens)
        prev: Node | None = nodes[hashes[start - 1]] if start else None
        last_unit: Unit | None = None
        last_index = -1  # the chain's previous checkpoint (a unit's pages are those since it)
        up = prev
        while up is not None and up.unit is None:
            up = up.parent
        if up is not None:
            last_index = up.index
        new_node, spare = self.new_node, self.spare
        fresh = False  # past the tree: nodes are closed under parents, so no later page is a node
        for i in range(start, d + 1):
            key = hashes[i]
            if fresh:  # a new node below the new node before it (its unit, if any, is no leaf yet)
                if spare:  # self.new_node, inlined
                    node = spare.pop()
                    node.key, node.parent, node.index = key, prev, i
                else:
                    node = Node(key, prev, i)
                nodes[key] = prev.kids = node  # type: ignore[union-attr]
            else:
                got = nodes.get(key)
                if got is not None:
                    node = got
                else:
                    fresh = True
                    node = new_node(key, prev, i)
                    if prev is not None:
                        prev.add_child(node, policy)  # a leaf unit gets a child: out of the leaf queues
            if key in first:
                if state_present(key):
                    unit = node.unit
                    if unit is None:
                        unit = node.unit = Unit(key, node, cls, retain, now, i - last_index, depth, arrival)
                    else:
                        _touch(unit, retain, now, policy)
                    last_unit, last_index = unit, i
                elif self._drop(self.slots, self.state_gids, key):
                    self.stats.partial_states += 1  # part of a state (one group's was evicted): it never hits
            else:
                for m in others:  # inline: once per page of every chain
                    if key in m:
                        if self._drop(self.slots, self.state_gids, key):
                            self.stats.partial_states += 1
                        break
            prev = node
        if last_unit is not None:
            last_unit.prompt_end = True
        # the tail: pages past the deepest checkpoint (another chain's nodes stay, its partial states go)
        blocks: list[KVCacheBlock] = []
        for i in range(d + 1, n):
            key = hashes[i]
            has_state = key in first or _partial_state(key, others)
            tail_node = nodes.get(key)
            if tail_node is not None:  # another chain's page: it and its whole states stay, a partial one goes
                if has_state and not state_present(key) and self._drop(self.slots, self.state_gids, key):
                    self.stats.partial_states += 1
                prev = tail_node
                continue
            if has_state and self._drop(self.slots, self.state_gids, key):
                self.stats.partial_states += 1
            self._free_copies(self.pages, self.page_gids, key, blocks)
        if blocks:
            self.pages.drop_cached(blocks)
            self.stats.tail_pages += len(blocks)
        if prev is not None:
            self.stats.tail_pages += self.prune(prev)

    def add_chain(self, hashes: Sequence[bytes], start: int, positions: Sequence[int], *, retain: Retention,
                  now: float, prompt_tokens: int) -> None:
        """A store into this (host) tier: every page of ``hashes[:positions[-1] + 1]`` is cached,
        ``hashes[:start]`` are nodes, and the new states are exactly at `positions` (ascending,
        none a unit yet; one below `start` starts the walk there): nodes from `start` and units
        at `positions`. The lean form of ``register``: no presence checks, no tails (the chain
        ends at its deepest state)."""
        self.now = now

        nodes, policy = self.nodes, self.policy
        start = min(start, positions[0])  # a state above the known prefix: the walk starts there
        prev: Node | None = nodes[hashes[start - 1]] if start else None
        last_index = -1
        up = prev
        while up is not None and up.unit is None:
            up = up.parent
        if up is not None:
            last_index = up.index
        cls = unit_class(1, None, prompt_tokens)
        unit: Unit | None = None
        j = start  # the next page to make a node of
        new_node, spare = self.new_node, self.spare
        fresh = False  # past the tree: nodes are closed under parents, so no later page is a node
        for p in positions:
            while j <= p:
                key = hashes[j]
                if fresh:  # the hot case: a new node below the new node before it
                    if spare:  # self.new_node, inlined
                        node = spare.pop()
                        node.key, node.parent, node.index = key, prev, j
                    else:
                        node = Node(key, prev, j)
                    nodes[key] = prev.kids = node  # type: ignore[union-attr]
                else:
                    got = nodes.get(key)
                    if got is not None:
                        node = got
                    else:
                        fresh = True
                        node = new_node(key, prev, j)
                        if prev is not None:
                            prev.add_child(node, policy)  # a leaf unit gets a child: out of the leaf queues
                prev = node
                j += 1
            assert prev is not None and prev.index == p and prev.unit is None, f"page {p} is a unit already"
            unit = prev.unit = Unit(prev.key, prev, cls, retain, now, p - last_index, 1, now)
            last_index = p
        if unit is not None:
            unit.prompt_end = True
            self.prune(unit.node)  # type: ignore[arg-type]  # the deepest unit becomes a leaf

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
        """Assert the invariants of the module docstring, O(cached blocks + nodes). `live_keys`:
        the page-grid hashes of the running requests' chains (what they will register when freed).

        Raises:
            AssertionError: an invariant is broken."""

        nodes = self.nodes
        has_checkpoint: dict[bytes, bool] = {}

        def below(node: Node) -> bool:  # a checkpoint at or below `node` (iterative post-order)
            stack = [(node, False)]
            while stack:
                n, done = stack.pop()
                if n.key in has_checkpoint:
                    continue
                if done:
                    has_checkpoint[n.key] = n.unit is not None or any(has_checkpoint[c] for c in n.children)
                else:
                    stack.append((n, True))
                    stack.extend((c, False) for c in n.children.values())
            return has_checkpoint[node.key]

        leaves = 0
        for key, node in nodes.items():
            assert node.key == key
            assert self.page_present(key), f"node {node.index}: its page is not cached"
            p = node.parent
            if p is None:
                assert node.index == 0, f"node {node.index} has no parent"
            else:
                assert nodes.get(p.key) is p and p.children.get(key) is node and p.index == node.index - 1, \
                    f"node {node.index}: parent link"
            for ck, c in node.children.items():
                assert c.parent is node and nodes.get(ck) is c, f"node {node.index}: child link"
            if node.unit is not None:
                assert self.state_present(key), f"node {node.index}: a unit without a state in every group"
            elif self.state_present(key):  # published on a running chain (a junction): a unit when it is freed
                assert key in live_keys or self.page_held(key), f"node {node.index}: a state in every group but no unit"
            if node.unit is not None:
                u = node.unit
                assert u.node is node and u.key == key
                assert u.leaf == (not node.children), f"unit at {node.index}: leaf flag {u.leaf} with {len(node.children)} children"
                leaves += u.leaf
        assert leaves == self.policy.num_leaves, f"{leaves} leaf units, policy queues {self.policy.num_leaves}"
        self.policy.check_invariants()

        page_maps = self.pages.cached_block_hash_to_block
        for gid in self.page_gids:
            for key, entry in page_maps.get(gid, {}).items():
                if all(b.ref_cnt == 0 for b in _blocks(entry)) and key not in live_keys and not self.page_held(key):
                    page_node = nodes.get(key)
                    assert page_node is not None, "a free cached page outside the tree"
                    assert below(page_node), f"a free cached page at {page_node.index} past its chain's deepest checkpoint"
        state_maps = self.slots.cached_block_hash_to_block
        for gid in self.state_gids:
            for key, entry in state_maps.get(gid, {}).items():
                if any(b.ref_cnt == 0 for b in _blocks(entry)) and key not in live_keys and not self.page_held(key):
                    state_node = nodes.get(key)
                    assert state_node is not None and state_node.unit is not None, "a free cached state without its unit"
                    n: Node | None = state_node
                    while n is not None and n.parent is not None:
                        n = n.parent
                    assert n is not None and n.index == 0, "a free cached state whose chain does not reach the root"
