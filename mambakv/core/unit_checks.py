"""The unit invariants (:mod:`mambakv.core.units`), checked by ``UnitIndex.check_invariants``.

After every coordinator call, whatever the policy:

1. the tree: each node's page is cached in every full-attention group, its parent is the page
   before it on the chain, children and parents agree; a unit's node has a state in every Mamba
   group; the leaf queues hold exactly the units without children;
2. no cached page past a chain's deepest checkpoint: a free cached page has a node, and a
   checkpoint at or below it;
3. no cached state whose pages are gone: a free cached state has a unit whose node reaches the
   root;

except on a running request's chain (a copy of the page is in a table, or the hash is on a live
request's chain): it registers when freed.

A node has a unit iff every Mamba group caches a state at its hash, except while a running
request that published the state still holds the page (it registers when freed).
"""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING

from mambakv.core.block import KVCacheBlock
from mambakv.core.unit_types import Node

if TYPE_CHECKING:
    from mambakv.core.units import UnitIndex

__all__ = ["check_units"]


def _blocks(entry: object) -> list[KVCacheBlock]:
    return list(entry.values()) if isinstance(entry, dict) else [entry]  # type: ignore[list-item]


def check_units(ix: UnitIndex, live_keys: Set[bytes] = frozenset()) -> None:
    """Assert the invariants of the module docstring (O(cached blocks + nodes)). `live_keys`: the
    page-grid hashes of the running requests' chains (what they will register when freed)."""
    nodes = ix.nodes
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
        assert ix.page_present(key), f"node {node.index}: its page is not cached"
        p = node.parent
        if p is None:
            assert node.index == 0, f"node {node.index} has no parent"
        else:
            assert nodes.get(p.key) is p and p.children.get(key) is node and p.index == node.index - 1, \
                f"node {node.index}: parent link"
        for ck, c in node.children.items():
            assert c.parent is node and nodes.get(ck) is c, f"node {node.index}: child link"
        if node.unit is not None:
            assert ix.state_present(key), f"node {node.index}: a unit without a state in every group"
        elif ix.state_present(key):  # published on a running chain (a junction): a unit when it is freed
            assert key in live_keys or ix.page_held(key), f"node {node.index}: a state in every group but no unit"
        if node.unit is not None:
            u = node.unit
            assert u.node is node and u.key == key
            assert u.leaf == (not node.children), f"unit at {node.index}: leaf flag {u.leaf} with {len(node.children)} children"
            leaves += u.leaf
    assert leaves == ix.policy.num_leaves, f"{leaves} leaf units, policy queues {ix.policy.num_leaves}"
    ix.policy.check_invariants()

    page_maps = ix.pages.cached_block_hash_to_block
    for gid in ix.page_gids:
        for key, entry in page_maps.get(gid, {}).items():
            if all(b.ref_cnt == 0 for b in _blocks(entry)) and key not in live_keys and not ix.page_held(key):
                page_node = nodes.get(key)
                assert page_node is not None, "a free cached page outside the tree"
                assert below(page_node), f"a free cached page at {page_node.index} past its chain's deepest checkpoint"
    state_maps = ix.slots.cached_block_hash_to_block
    for gid in ix.state_gids:
        for key, entry in state_maps.get(gid, {}).items():
            if any(b.ref_cnt == 0 for b in _blocks(entry)) and key not in live_keys and not ix.page_held(key):
                state_node = nodes.get(key)
                assert state_node is not None and state_node.unit is not None, "a free cached state without its unit"
                n: Node | None = state_node
                while n is not None and n.parent is not None:
                    n = n.parent
                assert n is not None and n.index == 0, "a free cached state whose chain does not reach the root"
