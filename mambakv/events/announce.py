"""What a cache-aware router is told about a hybrid model: only what can be hit.

The raw stream (``BlockPool.take_events()``) is per (group, hash). A router such as Dynamo's
keeps one radix tree of blocks per worker and scores a prompt by how many leading blocks match.
For full attention + Mamba that over-promises: a prefix is a hit only where a Mamba state
was checkpointed and the attention chain up to it is cached. So this filter announces:

    checkpoint  a key k at depth d (blocks of `block_size` tokens from the root) such that
                every full-attention group caches the whole chain root..k, every state (Mamba)
                group caches a state under k, and d * block_size is a multiple of the
                coordinator's hit alignment;
    announced   the attention blocks root..k of every checkpoint k, nothing else.

A block is withdrawn as soon as no checkpoint at or below it is left (its last state evicted,
or an attention block of the chain evicted), deepest first. Without state groups every cached
attention chain is its own checkpoint (the rule reduces to "blocks whose whole chain is cached")::

    attention  a0 - a1 - a2 - a3           states at a1 and a3 (Mamba block = attention block)
    announced  a0 a1 a2 a3
    evict the state at a3 -> BlockRemoved([a3, a2])    (a1 is still a checkpoint)
    evict attention a0    -> BlockRemoved([a1, a0])    (nothing below a0 can be hit)

So for a prompt, a router's overlap (leading announced blocks) is never less than what
``get_computed_blocks`` hits, and equals it when the deepest matched block is a checkpoint.
Sliding-window groups are not consulted (their hits can only be shorter: the overlap stays an
upper bound), nor is the EAGLE back-off.

Announced events are core events (``mambakv.core.events``) of the first full-attention group,
attention block size, ``block_size`` token ids per hash, parents chained, so that a consumer
never sees a block whose parent it was not told about.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mambakv.core.errors import InvalidSpecError
from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from mambakv.core.spec import FullAttentionSpec, MambaSpec
from mambakv.events.announce_forest import ForestNode

if TYPE_CHECKING:
    from mambakv.coordinator import KVCacheCoordinator

__all__ = ["RouterAnnouncer"]


class RouterAnnouncer:
    """Turns raw event batches into the router view (module docstring).

    Args:
        attention_groups: ids of the full-attention groups (at least one).
        state_groups: ids of the Mamba groups (possibly none).
        block_size: the attention block size (tokens per announced block).
        alignment_tokens: hits end on a multiple of this (``KVCacheCoordinator.alignment_tokens``).

    Raises:
        InvalidSpecError: no attention group, or a bad size.

    Not thread-safe: feed it from one thread (the publisher calls it in ``publish``).
    """

    def __init__(self, attention_groups: Sequence[int], state_groups: Sequence[int], *, block_size: int,
                 alignment_tokens: int | None = None) -> None:
        if not attention_groups:
            raise InvalidSpecError("the router view needs a full-attention group (publish the raw stream instead)")
        if block_size <= 0 or (alignment_tokens is not None and alignment_tokens <= 0):
            raise InvalidSpecError(f"bad block size {block_size} / alignment {alignment_tokens}")
        self.attention_groups = frozenset(attention_groups)
        self.state_groups = frozenset(state_groups)
        self.group_id = min(attention_groups)
        self.block_size = block_size
        self.alignment_tokens = alignment_tokens or block_size
        self._num_attn = len(self.attention_groups)
        self._num_states = len(self.state_groups)
        self._nodes: dict[bytes, ForestNode] = {}
        self._out: list[KVCacheEvent] = []

    @classmethod
    def for_coordinator(cls, coord: KVCacheCoordinator) -> RouterAnnouncer:
        """The announcer of a ``KVCacheCoordinator``'s groups.

        Raises:
            InvalidSpecError: the model has no full-attention group, or its full-attention
                groups differ in block size.
        """
        specs = [g.kv_cache_spec for g in coord.kv_cache_config.kv_cache_groups]
        attn = [i for i, s in enumerate(specs) if isinstance(s, FullAttentionSpec)]
        states = [i for i, s in enumerate(specs) if isinstance(s, MambaSpec)]
        sizes = {specs[i].block_size for i in attn}
        if len(sizes) > 1:
            raise InvalidSpecError(f"full-attention groups with different block sizes {sorted(sizes)}")
        if not attn:
            raise InvalidSpecError("the router view needs a full-attention group (publish the raw stream instead)")
        return cls(attn, states, block_size=sizes.pop(), alignment_tokens=coord.alignment_tokens)

    # ------------------------------------------------------------------ feeding
    def feed(self, events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
        """Apply raw events; return the router events they cause, in order."""
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.group_id in self.attention_groups:
                    self._attention_stored(ev)
                elif ev.group_id in self.state_groups:
                    for key in ev.block_hashes:
                        self._state_changed(self._node(key), +1)
            elif isinstance(ev, BlockRemoved):
                if ev.group_id in self.attention_groups:
                    for key in ev.block_hashes:
                        node = self._nodes.get(key)
                        if node is not None:
                            self._attention_removed(node)
                elif ev.group_id in self.state_groups:
                    for key in ev.block_hashes:
                        node = self._nodes.get(key)
                        if node is not None:
                            self._state_changed(node, -1)
            elif isinstance(ev, AllBlocksCleared):
                self._nodes.clear()
                self._out.append(AllBlocksCleared())
        out, self._out = self._out, []
        return out

    def snapshot(self) -> list[KVCacheEvent]:
        """``AllBlocksCleared`` then every announced block, parents first: what a consumer
        that lost events needs to hold the view again (the publisher sends it after a drop)."""
        out: list[KVCacheEvent] = [AllBlocksCleared()]
        roots = [n for n in self._nodes.values() if n.need > 0 and n.parent is None]
        stack = roots[::-1]
        while stack:
            n = stack.pop()
            out.append(self._stored([n], None if n.parent is None else n.parent.key))
            stack.extend(c for c in n.children.values() if c.need > 0)
        return out

    def announced_keys(self) -> set[bytes]:
        """The keys announced to routers now (read-only view, for checks and tests)."""
        return {n.key for n in self._nodes.values() if n.need > 0}

    @property
    def num_tracked(self) -> int:
        """Keys the announcer remembers (announced or not): 0 once nothing is cached."""
        return len(self._nodes)

    @property
    def num_announced(self) -> int:
        return sum(1 for n in self._nodes.values() if n.need > 0)

    # ------------------------------------------------------------------ the forest
    def _node(self, key: bytes) -> ForestNode:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = ForestNode(key)
        return node

    def _attention_stored(self, ev: BlockStored) -> None:
        bs = ev.block_size
        # Without its tokens a block cannot be announced (a router hashes them): it stays
        # unknown, so nothing below it is announced either.
        has_tokens = bs > 0 and len(ev.token_ids) == len(ev.block_hashes) * bs
        parent = None if ev.parent_block_hash is None else self._node(ev.parent_block_hash)
        for i, key in enumerate(ev.block_hashes):
            node = self._node(key)
            if node.tokens is None and has_tokens:
                node.tokens = list(ev.token_ids[i * bs : (i + 1) * bs])
                node.lora_id, node.lora_name = ev.lora_id, ev.lora_name
                if parent is not None:
                    node.parent = parent
                    parent.children[key] = node
            node.attn += 1
            if node.attn == self._num_attn:
                self._mark_ok(node)  # a root (tokens known, no parent) or below an ok parent
            parent = node

    def _mark_ok(self, top: ForestNode) -> None:
        """`top`'s chain became fully cached: it and every fully cached descendant reachable
        through fully cached nodes become ok; checkpoints among them are activated (parents
        first, so each announcement extends an announced chain)."""
        stack = [top]
        while stack:
            n = stack.pop()
            if n.ok or n.attn < self._num_attn or n.tokens is None:
                continue
            if n.parent is None:
                n.depth = 1
            elif n.parent.ok:
                n.depth = n.parent.depth + 1
            else:
                continue
            n.ok = True
            self._update_valid(n)
            stack.extend(n.children.values())

    def _attention_removed(self, node: ForestNode) -> None:
        node.attn -= 1
        if node.ok:
            # Deepest first: every ok descendant loses its chain.
            order: list[ForestNode] = []
            stack = [node]
            while stack:
                n = stack.pop()
                if not n.ok:
                    continue
                order.append(n)
                stack.extend(n.children.values())
            for n in reversed(order):
                n.ok = False
                self._update_valid(n)
        self._maybe_drop(node)

    def _state_changed(self, node: ForestNode, delta: int) -> None:
        node.states += delta
        self._update_valid(node)
        if delta < 0:
            self._maybe_drop(node)

    def _update_valid(self, n: ForestNode) -> None:
        valid = (n.ok and n.states >= self._num_states
                 and (n.depth * self.block_size) % self.alignment_tokens == 0)
        if valid == n.valid:
            return
        n.valid = valid
        if valid:
            self._activate(n)
        else:
            self._deactivate(n)

    def _activate(self, n: ForestNode) -> None:
        """Add one to `n`'s need; announce the chain of nodes that become needed."""
        chain = []
        while n is not None:
            n.need += 1
            if n.need > 1:
                break
            chain.append(n)
            n = n.parent  # type: ignore[assignment]
        if chain:
            chain.reverse()
            top = chain[0]
            self._out.append(self._stored(chain, None if top.parent is None else top.parent.key))

    def _deactivate(self, n: ForestNode) -> None:
        """Subtract one from `n`'s need; withdraw the nodes no longer needed, deepest first."""
        gone = []
        while n is not None:
            n.need -= 1
            if n.need > 0:
                break
            gone.append(n.key)
            n = n.parent  # type: ignore[assignment]
        if gone:
            self._out.append(BlockRemoved(gone, group_id=self.group_id))

    def _stored(self, chain: list[ForestNode], parent: bytes | None) -> BlockStored:
        tokens: list[int] = []
        for n in chain:
            tokens.extend(n.tokens)  # type: ignore[arg-type]
        last = chain[-1]
        return BlockStored([n.key for n in chain], parent, tokens, self.block_size, last.lora_id,
                           group_id=self.group_id, lora_name=last.lora_name)

    def _maybe_drop(self, node: ForestNode | None) -> None:
        """Forget nodes that nothing caches and nothing hangs below (walking up)."""
        while node is not None and node.attn == 0 and node.states == 0 and not node.children:
            assert node.need == 0
            del self._nodes[node.key]
            parent = node.parent
            if parent is not None:
                del parent.children[node.key]
            node = parent

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Assert: ok == chain fully cached; need == valid + needed children; announced nodes
        are closed under parents."""
        for n in self._nodes.values():
            chain_ok = n.attn >= self._num_attn and n.tokens is not None and (n.parent is None or n.parent.ok)
            assert n.ok == chain_ok, f"ok flag of {n.key.hex()} is {n.ok}"
            assert n.need == int(n.valid) + sum(1 for c in n.children.values() if c.need > 0)
            assert n.need == 0 or n.parent is None or n.parent.need > 0
            assert n.parent is None or n.parent.children.get(n.key) is n
