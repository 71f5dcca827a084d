"""Adding a freed request's chain to the unit index (:mod:`mambakv.core.units`)::

    request's pages   0 ................ d | d+1 ...... n-1 | n ... (a gap: unreachable)
                      nodes, units          | tail: dropped   | dropped
                      (existing ones touched) (unless another chain's nodes)

``d`` is the deepest page with a state in every Mamba group; a state in some groups only (one
was evicted while the request held the others) is dropped: it never hits. Nodes are made only up to ``d``: a
tail page never enters the tree. The whole chain is walked, its hit
included (a unit there may have been evicted and published again while the request ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.retention import Retention
from mambakv.core.unit_types import Node, Unit, unit_class

if TYPE_CHECKING:
    from mambakv.core.units import UnitIndex

__all__ = ["add_chain", "register_chain"]


def _partial(key: bytes, others: list[dict[bytes, object]]) -> bool:
    """`key` has a state in one of the Mamba groups after the first (a plain loop: hot)."""
    for m in others:
        if key in m:
            return True
    return False


def register_chain(ix: UnitIndex, hashes: Sequence[bytes], tables: Sequence[Sequence[KVCacheBlock]], *,
                   retain: Retention, arrival: float, prompt_tokens: int, parent: Unit | None, now: float,
                   start: int = 0) -> None:
    """See the module docstring and ``UnitIndex.register``. `start`: ``hashes[:start]`` are
    nodes already (a host tier's known prefix); ``tables[g][j]`` is then the block at
    ``start + j`` and the walk begins at `start`."""
    n = min(len(hashes), start + min((len(t) for t in tables), default=0))
    nodes, policy = ix.nodes, ix.policy
    assert start == 0 or hashes[start - 1] in nodes, "a known prefix must be nodes"
    # The whole chain is walked, its hit included: while the request ran, a unit on its hit may
    # have been evicted (its state freed by retirement) and another request may have published
    # a state there again; skipping the hit missed that (found by the fuzzer).
    # The reachable prefix: every page cached in every full-attention group.
    i = start
    if len(ix.page_gids) == 1:  # one full-attention group: one map
        pm = ix.pages.cached_block_hash_to_block.get(ix.page_gids[0]) or {}
        while i < n and hashes[i] in pm:
            i += 1
    else:
        page_present = ix.page_present
        while i < n and page_present(hashes[i]):
            i += 1
    state_maps = ix.slots.cached_block_hash_to_block
    first = state_maps.get(ix.state_gids[0]) or {}
    others: list[dict[bytes, object]] = [m for m in (state_maps.get(g) for g in ix.state_gids[1:]) if m]  # type: ignore[misc]  # a partial state may miss the first
    if i < n:  # past a gap nothing is reachable: drop the request's own free pages and free states
        lost = [b for t in tables for b in t[i - start:] if b.block_hash is not None and not b.ref_cnt and not b.is_null]
        if lost:
            ix.pages.drop_cached(lost)
            ix.stats.tail_pages += len(lost)
        for key in hashes[i:]:
            if (key in first or _partial(key, others)) and key not in nodes:
                ix._drop(ix.slots, ix.state_gids, key)
    n = i
    # the deepest checkpoint
    state_present = ix.state_present
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
    new_node, spare = ix.new_node, ix.spare
    fresh = False  # past the tree: nodes are closed under parents, so no later page is a node
    for i in range(start, d + 1):
        key = hashes[i]
        if fresh:  # a new node below the new node before it (its unit, if any, is no leaf yet)
            if spare:  # ix.new_node, inlined
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
            elif ix._drop(ix.slots, ix.state_gids, key):
                ix.stats.partial_states += 1  # part of a state (one group's was evicted): it never hits
        else:
            for m in others:  # inline: once per page of every chain
                if key in m:
                    if ix._drop(ix.slots, ix.state_gids, key):
                        ix.stats.partial_states += 1
                    break
        prev = node
    if last_unit is not None:
        last_unit.prompt_end = True
    # the tail: pages past the deepest checkpoint (another chain's nodes stay)
    blocks: list[KVCacheBlock] = []
    for i in range(d + 1, n):
        key = hashes[i]
        tail_node = nodes.get(key)
        if tail_node is not None:
            prev = tail_node
            continue
        if (key in first or _partial(key, others)) and ix._drop(ix.slots, ix.state_gids, key):
            ix.stats.partial_states += 1
        ix._free_copies(ix.pages, ix.page_gids, key, blocks)
    if blocks:
        ix.pages.drop_cached(blocks)
        ix.stats.tail_pages += len(blocks)
    if prev is not None:
        ix.stats.tail_pages += ix.prune(prev)


def _touch(unit: Unit, retain: Retention, now: float, policy: object) -> None:
    unit.retain = unit.retain.stronger(retain)
    unit.last_use = now
    if unit.leaf:
        policy.touch(unit)  # type: ignore[attr-defined]


def add_chain(ix: UnitIndex, hashes: Sequence[bytes], start: int, positions: Sequence[int], *,
              retain: Retention, now: float, prompt_tokens: int) -> None:
    """A host tier's store (``UnitIndex.add_chain``): every page of ``hashes[:positions[-1] + 1]``
    is cached, ``hashes[:start]`` are nodes, and the new states are exactly at `positions`
    (ascending, none a unit yet; one below `start` starts the walk there). The lean path of ``register_chain``: no presence
    checks, no tails (the chain ends at its deepest state)."""
    nodes, policy = ix.nodes, ix.policy
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
    new_node, spare = ix.new_node, ix.spare
    fresh = False  # past the tree: nodes are closed under parents, so no later page is a node
    for p in positions:
        while j <= p:
            key = hashes[j]
            if fresh:  # the hot case: a new node below the new node before it
                if spare:  # ix.new_node, inlined
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
        ix.prune(unit.node)  # type: ignore[arg-type]  # the deepest unit becomes a leaf
