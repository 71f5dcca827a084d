"""Blocks and the free-block queue: the bottom layer, no dependencies.

The free queue is an intrusive doubly linked list threaded through the blocks' own
``prev_free_block`` / ``next_free_block`` fields, between two sentinel nodes, so that every
operation is O(1) and branch-free: no ``deque.remove`` (O(n)), no allocation per operation.

Queue position *is* the eviction order: the head is reused first (DESIGN.md section 3)::

    head-sentinel <-> b5 <-> b4 <-> b6 <-> ... <-> b1 <-> tail-sentinel
                      ^ popleft() takes this one            append() goes here ^

A pool's never-used blocks need not exist yet (the cost of a pool grows with what is used): the
queue may end its initial blocks with a *fresh run* of ``num_fresh`` blocks, stood for by one
marker node (block id -2) at their place in the order. Nothing is ever linked inside the run,
so it stays contiguous: blocks prepended go before it, blocks appended after it. A walk that
reaches the marker makes the blocks it needs (``spill``) and links them just before it::

    head <-> u1 <-> [fresh: 7 8 9 ... N-1] <-> h1 <-> h2 <-> tail
    popleft_n(3):   u1, then 7 and 8 are made (the run starts at 9 now)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from mambakv.core.errors import BlockNotFreeError, DoubleFreeError, InvalidSpecError, OutOfBlocksError


class KVCacheBlock:
    """One block of cache memory.

    Attributes:
        block_id: index in the pool, ``0 .. num_blocks - 1``; block 0 is the null block.
        ref_cnt: number of block tables holding the block; 0 means it is in the free queue.
        block_hash: prefix-cache key (16-byte digest) while the block is published, else None.
        cache_group_id: KV-cache group whose prefix-cache map holds ``block_hash`` (-1 if none).
        is_null: True only for block 0.
        pool_id: the id of the BlockPool that created the block (-1 for a block made alone):
            the pool refuses another pool's blocks with one compare.

    Blocks compare and hash by identity (no field equality): a list ``remove`` or ``in``
    never walks fields.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "cache_group_id",
        "is_null",
        "pool_id",
        "prev_free_block",
        "next_free_block",
    )

    def __init__(self, block_id: int, pool_id: int = -1) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.cache_group_id = -1
        self.is_null = False
        self.pool_id = pool_id
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}{', null' if self.is_null else ''})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with two sentinels.

    Every operation is O(1) per block. The given blocks are queued in list order at
    construction, then (``num_fresh > 0``) a fresh run of that many blocks that
    ``make_fresh(n)`` creates on demand, ``n`` at a time, in queue order (see the module
    docstring). ``num_free_blocks`` is the queue length, the fresh run included.
    """

    __slots__ = ("num_free_blocks", "num_fresh", "_head", "_tail", "head", "tail", "_fresh", "_make_fresh")

    def __init__(self, blocks: Sequence[KVCacheBlock], *, num_fresh: int = 0,
                 make_fresh: Callable[[int], list[KVCacheBlock]] | None = None) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        #: the head sentinel (block id -1): ``head.next_free_block`` is the block reused first
        #: (for the pool's batch walks, ``BlockPool.get_new_blocks``; never rebind it)
        self.head = self._head
        #: the tail sentinel (block id -1): ``tail.prev_free_block`` is the block reused last
        #: (never rebind it)
        self.tail = self._tail
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)
        #: blocks of the fresh run not made yet; its marker (block id -2) is linked while > 0
        self.num_fresh = 0
        self._fresh = KVCacheBlock(-2)
        self._make_fresh = make_fresh
        if num_fresh > 0:
            if make_fresh is None:
                raise InvalidSpecError("a fresh run needs make_fresh")
            self._link_run(self._tail.prev_free_block, [self._fresh], self._tail)
            self.num_fresh = num_fresh
            self.num_free_blocks += num_fresh - 1  # the marker stands for num_fresh blocks

    def spill(self, n: int) -> None:
        """Make the first ``min(n, num_fresh)`` blocks of the fresh run and link them, in
        order, at its place (just before the marker); the marker leaves the queue with the
        run's last block. The queue's order and count are unchanged."""
        n = min(n, self.num_fresh)
        if n <= 0:
            return
        made = self._make_fresh(n)  # type: ignore[misc]
        marker = self._fresh
        prev = marker.prev_free_block
        for block in made:
            prev.next_free_block = block  # type: ignore[union-attr]
            block.prev_free_block = prev
            prev = block
        self.num_fresh -= n
        if self.num_fresh:
            prev.next_free_block = marker  # type: ignore[union-attr]
            marker.prev_free_block = prev
        else:  # the run is used up: the marker goes
            after = marker.next_free_block
            prev.next_free_block = after  # type: ignore[union-attr]
            after.prev_free_block = prev  # type: ignore[union-attr]
            marker.prev_free_block = marker.next_free_block = None

    def ensure_front(self, n: int) -> None:
        """Make sure the first `n` queue positions are real blocks (spill the fresh run if the
        marker lies among them): what a walk of `n` blocks from the head calls first. O(1)
        without a fresh run, else O(min(n, position of the marker))."""
        if not self.num_fresh:
            return
        node = self._head.next_free_block
        marker, tail = self._fresh, self._tail
        for i in range(n):
            if node is marker:
                self.spill(n - i)
                return
            if node is tail:
                return
            node = node.next_free_block  # type: ignore[union-attr]

    def popleft(self) -> KVCacheBlock:
        """Take the head block (the next one to reuse). Raises OutOfBlocksError if empty."""
        block = self._head.next_free_block
        if block is self._fresh:
            self.spill(1)
            block = self._head.next_free_block
        if block is self._tail or block is None:
            raise OutOfBlocksError("no free blocks")
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    @property
    def sentinels(self) -> tuple[KVCacheBlock, KVCacheBlock]:
        """``(head, tail)``: the two sentinel nodes (block id -1) the queue is linked between;
        read-only, for invariant checks and tests (they are never in the queue's count)."""
        return self._head, self._tail

    def first(self) -> KVCacheBlock | None:
        """The head block (the next one ``popleft`` takes; made now if it is the fresh run's),
        or None when empty; changes nothing else."""
        block = self._head.next_free_block
        if block is self._fresh:
            self.spill(1)
            block = self._head.next_free_block
        return None if block is self._tail or block is None else block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first `n` blocks in queue order. Raises OutOfBlocksError (nothing taken)
        if fewer than `n` are free."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        if n <= 0:
            return []
        if self.num_fresh:
            self.ensure_front(n)
        out: list[KVCacheBlock | None] = [None] * n
        block = self._head.next_free_block
        for i in range(n):
            out[i] = block
            nxt = block.next_free_block  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue (revive a cached block).
        Raises BlockNotFreeError if it is not in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise BlockNotFreeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (reused last).

        Raises:
            DoubleFreeError: `block` is already in the queue (nothing changed).
        """
        if block.prev_free_block is not None:
            raise DoubleFreeError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock], *, checked: bool = True) -> None:
        """Put `blocks` at the tail, in order (the last one is reused last).

        `checked=False` skips ``_check_insertable``; only for a caller that guarantees distinct
        blocks none of which is queued (BlockPool.free_blocks: every block had ref count >= 1,
        and it refuses duplicates).

        Raises:
            DoubleFreeError: a block is already queued, or listed twice; nothing changed.
        """
        if checked:
            blocks = self._check_insertable(blocks)
        self._link_run(self._tail.prev_free_block, blocks, self._tail)  # type: ignore[arg-type]

    def prepend_n(self, blocks: Sequence[KVCacheBlock], *, checked: bool = True) -> None:
        """Put `blocks` at the head, keeping their order: ``blocks[0]`` is reused first.
        `checked=False`: as for ``append_n``.

        Raises:
            DoubleFreeError: a block is already queued, or listed twice; nothing changed.
        """
        if checked:
            blocks = self._check_insertable(blocks)
        self._link_run(self._head, blocks, self._head.next_free_block)  # type: ignore[arg-type]

    def append_unchecked(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``append_n(blocks, checked=False)`` without the keyword (BlockPool's requeue of freed
        blocks, once per free)."""
        self._link_run(self._tail.prev_free_block, blocks, self._tail)  # type: ignore[arg-type]

    def prepend_unchecked(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``prepend_n(blocks, checked=False)`` without the keyword (the same requeue)."""
        self._link_run(self._head, blocks, self._head.next_free_block)  # type: ignore[arg-type]

    def insert_before(self, node: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        """Put `blocks`, in order, right before `node` (a queued block, or the tail sentinel).

        Raises:
            DoubleFreeError: a block is already queued, or listed twice; nothing changed.
            BlockNotFreeError: `node` is neither queued nor the tail sentinel; nothing changed.
        """
        blocks = self._check_insertable(blocks)
        prev = node.prev_free_block
        if prev is None:
            raise BlockNotFreeError(f"block {node.block_id} is not in the free queue")
        self._link_run(prev, blocks, node)

    def _link_run(self, prev: KVCacheBlock, blocks: Sequence[KVCacheBlock], after: KVCacheBlock) -> None:
        """Link `blocks`, in order, between the adjacent nodes `prev` and `after`."""
        self.num_free_blocks += len(blocks)
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev

    @staticmethod
    def _check_insertable(blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """`blocks` as a list (iterables are accepted), after checking that none is queued (a queued block has a back
        link) and none repeats (blocks hash by identity). Raises DoubleFreeError."""
        blocks = list(blocks)
        for block in blocks:
            if block.prev_free_block is not None:
                raise DoubleFreeError(f"block {block.block_id} is already in the free queue")
        if len(set(blocks)) != len(blocks):
            raise DoubleFreeError("a block is listed twice")
        return blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail (O(n), the fresh run made first; for tests)."""
        self.spill(self.num_fresh)
        return list(self.made_blocks())

    def made_blocks(self) -> Iterable[KVCacheBlock]:
        """The queued blocks that exist, head to tail (the fresh run, not made yet, skipped);
        changes nothing. For invariant checks."""
        block = self._head.next_free_block
        while block is not self._tail and block is not None:
            if block is not self._fresh:
                yield block
            block = block.next_free_block

    def check_invariants(self) -> None:
        """Assert the links are consistent both ways and the count matches (the fresh run's
        marker counts for its blocks)."""
        seen = 0
        assert self.head is self._head and self.tail is self._tail, "sentinels rebound"
        prev = self._head
        block = self._head.next_free_block
        marked = False
        while block is not self._tail:
            assert block is not None, "broken forward link"
            assert block.prev_free_block is prev, f"broken back link at block {block.block_id}"
            if block is self._fresh:
                assert not marked and self.num_fresh > 0, "fresh-run marker linked twice or without a run"
                marked = True
                seen += self.num_fresh
            else:
                assert block.block_id >= 0, "sentinel inside the queue"
                seen += 1
            prev, block = block, block.next_free_block
        assert marked == (self.num_fresh > 0), "fresh run without its marker"
        assert self._tail.prev_free_block is prev, "tail back link"
        assert seen == self.num_free_blocks, f"count {self.num_free_blocks} != linked {seen}"
