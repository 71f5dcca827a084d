"""PrefixMap: the prefix-cache map of a :class:`~mambakv.core.block_pool.BlockPool`, and its KV events.

One dict per KV-cache group: ``block_hash -> block``, or ``{block_id: block}`` when several
blocks of a group carry one hash (block tables are append-only and never de-duplicated, so two
requests that computed the same block each keep their copy)::

    maps[0] = {h1: b4, h2: {5: b5, 9: b9}}     group 0: h1 in block 4, h2 in blocks 5 and 9
    remove(b9) -> False                          h2 still served by b5: maps[0][h2] is b5 again
    remove(b5) -> True                           the last copy of h2 went: BlockRemoved([h2])

A hit needs only one block per group, so a lookup takes the first copy (that lookup is
``BlockPool.get_cached_block``, kept inline in the pool: it is the hottest read). The pool owns one
PrefixMap and decides *when* a block is published or loses its hash (allocation, eviction,
reset); this module keeps the map consistent and, when events are enabled, records the raw
per ``(group, hash)`` stream of :mod:`mambakv.core.events`: BlockStored when the first block of
a group gets a hash, BlockRemoved when the last one loses it, AllBlocksCleared on ``clear``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.errors import InvalidBlockError, InvalidTokenCountError
from mambakv.core.events import AllBlocksCleared, BlockRemoved, KVCacheEvent, stored_events

__all__ = ["MapEntry", "PrefixMap", "map_blocks", "map_state"]

#: one hash of one group: its only block, or ``{block_id: block}`` for several copies
MapEntry = KVCacheBlock | dict[int, KVCacheBlock]


class PrefixMap:
    """The hash -> block maps of every group, with the eviction count and the event list.

    Args:
        record_events: keep BlockStored / BlockRemoved / AllBlocksCleared for ``take_events``.

    Attributes:
        maps: group id -> block hash -> :data:`MapEntry` (what ``BlockPool.cached_block_hash_to_block``
            is; outside code reads it, so it is one dict for the map's whole life).
        num_evictions: blocks that lost their hash through :meth:`remove`.
    """

    __slots__ = ("maps", "num_evictions", "_events")

    def __init__(self, record_events: bool = False) -> None:
        self.maps: dict[int, dict[bytes, MapEntry]] = {}
        self.num_evictions = 0
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    def insert(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], group_id: int, *,
               parent_block_hash: bytes | None, token_ids: Sequence[int] | None, block_size: int,
               lora_id: int | None, lora_name: str | None) -> None:
        """Give ``blocks[i]`` the hash ``block_hashes[i]`` and group `group_id` and map it, skipping
        null blocks and blocks already hashed; record BlockStored for the hashes new to the group
        (``BlockPool.cache_full_blocks`` documents the arguments and the events).

        Raises (nothing changed):
            InvalidBlockError: a block already carries a different hash or group.
            InvalidTokenCountError: `token_ids` of another length than ``len(blocks) * block_size``.
        """
        for block in blocks:  # the common case: only fresh blocks, one cheap pass
            if block.block_hash is not None:
                _check_republish(blocks, block_hashes, group_id)
                break
        if token_ids is not None and len(token_ids) != len(blocks) * block_size:
            raise InvalidTokenCountError(
                f"{len(token_ids)} token ids for {len(blocks)} blocks of {block_size} tokens")
        m = self.maps.setdefault(group_id, {})
        events = self._events
        if events is None:  # the hot path: no event bookkeeping
            map_blocks(m, blocks, block_hashes, group_id)
            return
        new: list[int] = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.is_null or block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.cache_group_id = group_id
            entry = m.get(block_hash)
            if entry is None:
                m[block_hash] = block
                new.append(i)
            elif isinstance(entry, dict):
                entry[block.block_id] = block
            else:
                m[block_hash] = {entry.block_id: entry, block.block_id: block}
        if new:
            events.extend(stored_events(new, block_hashes, group_id, parent_block_hash, token_ids, block_size,
                                        lora_id, lora_name))

    def insert_state(self, blocks: Sequence[KVCacheBlock], block_hash: bytes, group_ids: Sequence[int], *,
                     parent_block_hash: bytes | None, token_ids: Sequence[int] | None, block_size: int,
                     lora_id: int | None, lora_name: str | None) -> None:
        """Give ``blocks[i]`` the hash `block_hash` in group ``group_ids[i]`` (one Mamba state per
        group of a shared policy, all at one boundary): ``insert`` of one block per group, all
        or nothing (``BlockPool.cache_state_blocks`` documents the arguments).

        Raises (nothing changed):
            InvalidBlockError: a block already carries a different hash or group.
            InvalidTokenCountError: `token_ids` of another length than `block_size`.
        """
        for block, group_id in zip(blocks, group_ids):
            if block.block_hash is not None:
                _check_republish([block], [block_hash], group_id)
        if self._events is not None or token_ids is not None:  # events: one insert per group, in order
            if token_ids is not None and len(token_ids) != block_size:
                raise InvalidTokenCountError(f"{len(token_ids)} token ids for 1 block of {block_size} tokens")
            for block, group_id in zip(blocks, group_ids):
                self.insert([block], [block_hash], group_id, parent_block_hash=parent_block_hash, token_ids=token_ids,
                            block_size=block_size, lora_id=lora_id, lora_name=lora_name)
            return
        map_state(self.maps, blocks, block_hash, group_ids)

    def remove(self, block: KVCacheBlock) -> bool:
        """Drop hashed `block` from the map and clear its hash and group (it is about to hold
        something else, or its data was lost); count an eviction. True when it was the group's
        last block with that hash (then BlockRemoved is recorded)."""
        block_hash = block.block_hash
        gid = block.cache_group_id
        m = self.maps[gid]
        entry = m[block_hash]  # type: ignore[index]
        if isinstance(entry, dict):
            del entry[block.block_id]
            if len(entry) == 1:
                m[block_hash] = next(iter(entry.values()))  # type: ignore[index]
            last = False  # another block of the group still serves this hash: no event
        else:
            del m[block_hash]  # type: ignore[arg-type]
            last = True
        block.block_hash = None
        block.cache_group_id = -1
        self.num_evictions += 1
        if last and self._events is not None:
            self._events.append(BlockRemoved([block_hash], group_id=gid))  # type: ignore[list-item]
        return last

    def remove_many(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``remove`` every hashed block of `blocks` (unhashed ones are skipped): one call for a
        bulk pop or a withdrawn superblock, the same map updates and events."""
        maps, events = self.maps, self._events
        n = 0
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            gid = block.cache_group_id
            m = maps[gid]
            entry = m[block_hash]
            n += 1
            block.block_hash = None
            block.cache_group_id = -1
            if isinstance(entry, dict):
                del entry[block.block_id]
                if len(entry) == 1:
                    m[block_hash] = next(iter(entry.values()))
            else:
                del m[block_hash]
                if events is not None:
                    events.append(BlockRemoved([block_hash], group_id=gid))
        self.num_evictions += n

    def clear(self) -> None:
        """Empty every group's map (the same dict object stays) and record AllBlocksCleared.
        The caller clears the blocks' own hashes."""
        self.maps.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded events (always empty when events are off)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def check_invariants(self, num_hashed: int) -> None:
        """Assert: no empty entry; every mapped block carries the hash and group it is mapped
        under; the map holds `num_hashed` blocks (the pool's count of hashed blocks)."""
        mapped = 0
        for gid, m in self.maps.items():
            for h, entry in m.items():
                group = list(entry.values()) if isinstance(entry, dict) else [entry]
                assert group, "empty map entry"
                for b in group:
                    assert b.block_hash == h and b.cache_group_id == gid, f"block {b.block_id} mapped wrongly"
                    mapped += 1
        assert num_hashed == mapped, f"{num_hashed} hashed blocks but {mapped} in the map"


def map_blocks(m: dict[bytes, MapEntry], blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
               group_id: int) -> None:
    """``insert``'s map update without events, its checks done (``mambakv.core.pool_fused`` calls
    it for blocks it just popped): null and already hashed blocks are skipped; a second block of
    a hash turns the entry into ``{block_id: block}``."""
    get = m.get
    for block, block_hash in zip(blocks, block_hashes):
        if block.block_hash is not None or block.is_null:
            continue
        block.block_hash = block_hash
        block.cache_group_id = group_id
        entry = get(block_hash)
        if entry is None:
            m[block_hash] = block
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        else:
            m[block_hash] = {entry.block_id: entry, block.block_id: block}


def map_state(maps: dict[int, dict[bytes, MapEntry]], blocks: Sequence[KVCacheBlock], block_hash: bytes,
              group_ids: Sequence[int]) -> None:
    """``insert_state``'s map update without events (checks done): ``blocks[i]`` under
    `block_hash` in group ``group_ids[i]``."""
    for block, group_id in zip(blocks, group_ids):
        if block.block_hash is not None or block.is_null:
            continue
        m = maps.get(group_id)
        if m is None:
            m = maps[group_id] = {}
        if block_hash in m:  # another copy: map_blocks' entry rules
            map_blocks(m, (block,), (block_hash,), group_id)
            continue
        block.block_hash = block_hash
        block.cache_group_id = group_id
        m[block_hash] = block


def _check_republish(blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], group_id: int) -> None:
    """Raise InvalidBlockError if a block already carries another hash or group."""
    for block, block_hash in zip(blocks, block_hashes):
        if block.block_hash is not None and (block.block_hash != block_hash or block.cache_group_id != group_id):
            raise InvalidBlockError(f"block {block.block_id} is published under another hash or group; "
                                    f"it cannot be published again")
