"""SingleTypeKVCacheManager: the block tables of one KV-cache group.

One manager per group; all managers share one BlockPool. A manager keeps, per request, one
small slotted :class:`RequestBlocks` object (table, cached-block cursor, retirement
watermark); ``free`` drops that object, so no per-request bookkeeping can be forgotten.

Call order for one request (the coordinator drives it)::

    get_num_blocks_to_allocate -> add_computed_blocks (new request only, touches hits)
        -> allocate_new_blocks -> cache_blocks -> ... remove_skipped_blocks ... -> free
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.errors import HashBlockSizeMismatchError, InvalidTokenCountError
from mambakv.core.events import stored_event_fields
from mambakv.core.request import Request
from mambakv.core.spec import KVCacheSpec


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(a // -b)


class BlockHashView(Sequence):
    """Keys of a group's blocks from a request's finer hash blocks, without copying.

    ``view[i]`` is the fine digest that ends block i (see hashing.coarse_block_hashes)."""

    __slots__ = ("_fine", "_ratio")

    def __init__(self, fine: Sequence[bytes], ratio: int) -> None:
        self._fine = fine
        self._ratio = ratio

    def __len__(self) -> int:
        return len(self._fine) // self._ratio

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self._fine[(i + 1) * self._ratio - 1]


def group_block_hashes(request: Request, block_size: int) -> Sequence[bytes]:
    """The request's block keys at `block_size` granularity. A request without a hash block
    size adopts `block_size`.

    Raises:
        HashBlockSizeMismatchError: `block_size` is not a multiple of the request's hash block size.
    """
    hbs = request.hash_block_size
    if hbs is None:
        request.set_hash_block_size(block_size)
        hbs = block_size
    if block_size % hbs:
        raise HashBlockSizeMismatchError(
            f"block size {block_size} is not a multiple of request {request.request_id!r}'s "
            f"hash block size {hbs}"
        )
    fine = request.block_hashes
    return fine if hbs == block_size else BlockHashView(fine, block_size // hbs)


class RequestBlocks:
    """Per-request bookkeeping of one manager.

    Attributes:
        blocks: the block table; entry i covers tokens ``[i*bs, (i+1)*bs)``.
        num_cached_blocks: entries below this were published (or are hits/nulls).
        retired_below: the retirement watermark: every entry below it is the null block and
            is never scanned again.
    """

    __slots__ = ("blocks", "num_cached_blocks", "retired_below")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached_blocks = 0
        self.retired_below = 0


class _TableView(Mapping):
    """``req_to_blocks``: a read-only mapping request id -> block table, over the per-request
    objects (no second dict to keep in sync)."""

    __slots__ = ("_reqs",)

    def __init__(self, reqs: dict[str, RequestBlocks]) -> None:
        self._reqs = reqs

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        return self._reqs[request_id].blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)


class SingleTypeKVCacheManager(ABC):
    """Block tables of one KV-cache group.

    Args:
        kv_cache_spec: the group's spec (its ``block_size`` is the table granularity).
        block_pool: the pool shared by every group.
        enable_caching: publish full blocks to, and look hits up in, the prefix cache.
        kv_cache_group_id: the group's index (keys of the pool's prefix-cache map).
    """

    #: True when full blocks are published at allocation (attention: KV is written before it
    #: is read). Mamba states are published by ``cache_blocks`` with *processed* tokens.
    publishes_at_allocation = True
    #: False when nothing is ever retired (full attention): the coordinator skips the call.
    retires = True
    state_class: type[RequestBlocks] = RequestBlocks

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *, enable_caching: bool = True,
                 kv_cache_group_id: int = 0) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching and block_pool.enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.null_block = block_pool.null_block
        self._reqs: dict[str, RequestBlocks] = {}
        self.req_to_blocks: Mapping[str, list[KVCacheBlock]] = _TableView(self._reqs)

    def _state(self, request_id: str) -> RequestBlocks:
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = self.state_class()
        return st

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    # ------------------------------------------------------------------ allocation
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock] = (),
                                   num_computed_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """Upper bound of the free blocks that ``add_computed_blocks(new_computed_blocks)`` +
        ``allocate_new_blocks(num_tokens, num_lookahead_tokens)`` will consume: new blocks plus
        hit blocks still in the free queue (touching one takes it out)."""
        st = self._reqs.get(request_id)
        held = len(st.blocks) if st is not None else 0
        missing = -((num_tokens + num_lookahead_tokens) // -self.block_size) - held
        if new_computed_blocks:
            return max(0, missing - len(new_computed_blocks)) + _num_evictable(new_computed_blocks)
        return missing if missing > 0 else 0

    def num_covered_tokens(self, request_id: str) -> int:
        """Tokens (lookahead included) the request's table covers without a new block:
        ``get_num_blocks_to_allocate`` is 0 for any running step up to this many."""
        st = self._reqs.get(request_id)
        return 0 if st is None else len(st.blocks) * self.block_size

    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """A new request's prefix hit: touch the hit blocks and start its table with them."""
        if not new_computed_blocks:
            return
        st = self._state(request_id)
        assert not st.blocks, f"hits added to running request {request_id!r}"
        self.block_pool.touch(new_computed_blocks)
        st.blocks.extend(new_computed_blocks)
        st.num_cached_blocks = len(st.blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_lookahead_tokens: int = 0, *,
                            num_draft_tokens: int = 0) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens + num_lookahead_tokens`` tokens; return the new
        blocks (empty if it already does). Raises OutOfBlocksError (nothing changed) if the
        pool is short; the coordinator counts first so that never happens.
        `num_draft_tokens` (unverified drafts among the tokens) matters to Mamba groups only."""
        st = self._reqs.get(request_id) or self._state(request_id)
        n = -((num_tokens + num_lookahead_tokens) // -self.block_size) - len(st.blocks)
        if n <= 0:
            return []
        new = self.block_pool.get_new_blocks(n)
        st.blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first `num_tokens` tokens
        (which must be real tokens, never unverified drafts). Nulls are skipped."""
        st = self._reqs.get(request.request_id)
        if st is None or not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        start = st.num_cached_blocks
        if num_full <= start:
            return  # the common decode step: no block became full
        num_full = min(num_full, len(st.blocks))
        keys = group_block_hashes(request, self.block_size)
        num_full = min(num_full, len(keys))
        if num_full <= start:
            return
        pool = self.block_pool
        fields = (stored_event_fields(request, keys, start, num_full, self.block_size)
                  if pool.enable_kv_cache_events else {})
        pool.cache_full_blocks(st.blocks[start:num_full], keys[start:num_full], self.kv_cache_group_id, **fields)
        st.num_cached_blocks = num_full

    # ------------------------------------------------------------------ retirement
    #: Trailing processed tokens a request still needs (the rest are skipped): the window
    #: minus one for sliding window, 1 for a Mamba state, all of them for full attention.
    num_kept_tokens: int = 1 << 62

    def get_num_skipped_tokens(self, num_processed_tokens: int) -> int:
        """Leading tokens whose blocks are no longer needed once `num_processed_tokens`
        tokens are processed: ``max(0, n - num_kept_tokens)``."""
        return max(0, num_processed_tokens - self.num_kept_tokens)

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Retire: replace blocks ``[0, skipped // block_size)`` with the null block and free
        them (deepest first). Idempotent; a request holding no blocks is a no-op.

        Raises:
            InvalidTokenCountError: `num_processed_tokens` is negative (nothing changed).
        """
        if num_processed_tokens < 0:
            raise InvalidTokenCountError(f"num_processed_tokens must be >= 0, got {num_processed_tokens}")
        st = self._reqs.get(request_id)
        if st is None:
            return
        num_slots = self._num_dead_slots(st, num_processed_tokens)
        if num_slots <= st.retired_below:
            return  # the common decode step: nothing new to retire
        freed = self._retire_below(st, num_slots)
        if freed:
            self.block_pool.free_blocks(freed)

    def _num_dead_slots(self, st: RequestBlocks, num_processed_tokens: int) -> int:
        """Leading table slots no longer needed once `num_processed_tokens` are processed:
        ``get_num_skipped_tokens(n) // block_size`` (inlined: a negative result retires
        nothing)."""
        return (num_processed_tokens - self.num_kept_tokens) // self.block_size

    def _retire_below(self, st: RequestBlocks, num_slots: int) -> list[KVCacheBlock]:
        """Null out table entries ``[watermark, num_slots)``, skipping null gaps, and move the
        watermark up. Returns the removed blocks, deepest first. Amortised O(new blocks):
        no slot is scanned twice::

            before  [old, null, committed, in_flight]   watermark 0, num_slots 3
            after   [null, null, null,     in_flight]   watermark 3, returns [committed, old]
        """
        blocks = st.blocks
        stop = min(num_slots, len(blocks))
        low = st.retired_below
        if stop <= low:
            return []
        null = self.null_block
        freed = []
        for i in range(stop - 1, low - 1, -1):
            block = blocks[i]
            if block is not null:
                freed.append(block)
                blocks[i] = null
        st.retired_below = stop
        return freed

    def free(self, request_id: str) -> None:
        """Drop the request: free its table tail-first (deepest blocks reach the eviction end
        of the LRU first) and every piece of its bookkeeping. Unknown ids are a no-op."""
        st = self._reqs.pop(request_id, None)
        if st is not None:
            self.block_pool.free_blocks(reversed(st.blocks))

    # ------------------------------------------------------------------ prefix hits
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int,
                               use_eagle: bool = False) -> tuple[list[KVCacheBlock], ...]:
        """The longest prefix hit of at most `max_length` tokens whose length is a multiple of
        `alignment_tokens`, valid in every group of `kv_cache_group_ids`.

        `block_hashes` are keys at this spec's block size. Returns one list per group; the hit
        length is ``len(list) * block_size``; leading entries may be the null block. With
        `use_eagle`, the hit is recomputed once at the next aligned length below it (the last
        hit position must be recomputed for the drafter).
        """
        hit = cls._find_hit(block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, alignment_tokens)
        if use_eagle and hit[0]:
            length = len(hit[0]) * kv_cache_spec.block_size
            back = (length - 1) // alignment_tokens * alignment_tokens
            hit = cls._find_hit(block_hashes, back, kv_cache_group_ids, block_pool, kv_cache_spec, alignment_tokens)
        return hit

    @classmethod
    @abstractmethod
    def _find_hit(cls, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int],
                  block_pool: BlockPool, kv_cache_spec: KVCacheSpec,
                  alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The hit without EAGLE back-off (see find_longest_cache_hit)."""

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Assert per-request bookkeeping: entries below the watermark are null, held blocks
        have ref count >= 1, the cached cursor is within the table."""
        null = self.null_block
        for rid, st in self._reqs.items():
            blocks = st.blocks
            assert 0 <= st.retired_below <= max(len(blocks), st.retired_below)
            for i in range(min(st.retired_below, len(blocks))):
                assert blocks[i] is null, f"{rid}: slot {i} below watermark is not null"
            for b in blocks:
                assert b is null or b.ref_cnt >= 1, f"{rid}: held block {b.block_id} at ref 0"
            assert 0 <= st.num_cached_blocks <= len(blocks) or not blocks


def _num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
    """Hit blocks that sit in the free queue (ref count 0): touching them uses free capacity."""
    return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)
