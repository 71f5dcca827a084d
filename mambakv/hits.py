"""Prefix hits across KV-cache groups (DESIGN.md section 6): the fixed point, the EAGLE
back-off and the attention/Mamba junction (the stale-hit check at allocation is the
coordinator's: it checks its own input).

In a hybrid model a hit must hold in every group. Each group can only shorten a candidate
length, so groups are asked in turn until none shortens it::

    full attention (block 4):  b0 b1 b2 b3 b4      -> 20 tokens
    sliding window 8:          .  .  .  b3 b4      -> 20 tokens (covers the window)
    Mamba align (block 4):     state at 16 only    -> 16 tokens
    re-ask full attention at 16: b0..b3            -> 16: every group agrees, hit = 16
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import BlockPool
from mambakv.core.engine_request import EngineRequest
from mambakv.groups import SingleTypeKVCacheManager, group_block_hashes
from mambakv.groups.kinds import GroupKind


@dataclass
class PrefixCacheStats:
    """Prefix-cache use, counted once per admission (a successful ``allocate`` of a request
    that held no blocks; a lookup whose allocate fails, or is retried, counts nothing):
    requests admitted, their tokens (queries) and their hit tokens. A Request admitted again
    after ``free`` is a resumed preemption: it is counted in the ``preempted_*`` fields
    instead, so a request recomputing its own blocks is not counted as reuse (vLLM keeps the
    same split)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    #: of ``hits``: tokens the host tier supplied (loaded by ``get_computed_blocks_tiered``)
    host_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def hit_rate_gpu(self) -> float:
        """Hits found on the GPU over queries."""
        return (self.hits - self.host_hits) / self.queries if self.queries else 0.0

    @property
    def hit_rate_host(self) -> float:
        """Hits loaded from the host tier over queries."""
        return self.host_hits / self.queries if self.queries else 0.0


@dataclass
class _LookupGroup:
    """Groups that share one spec: one hit lookup serves all of them."""

    manager_class: type[SingleTypeKVCacheManager]
    group_ids: list[int]
    spec: object = field(repr=False)
    pool: BlockPool = field(repr=False)


class PrefixHitFinder:
    """Finds the hits of a request in every group (each in its manager's pool: one shared pool
    in the unified layout; pages and state slots in the decoupled one).

    Args:
        managers: one manager per group, config order.
        alignment_tokens: hits end on a multiple of this (the LCM of the block sizes).
    """

    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], alignment_tokens: int) -> None:
        self.managers = tuple(managers)
        self.alignment_tokens = alignment_tokens
        self._lookup_groups = self._make_lookup_groups()

    def _make_lookup_groups(self) -> list[_LookupGroup]:
        # Full attention first: its hit is a prefix, cheap, and usually the shortest.
        out: list[_LookupGroup] = []
        for gid, m in enumerate(self.managers):
            for lg in out:
                if lg.manager_class is type(m) and lg.spec == m.kv_cache_spec and lg.pool is m.block_pool:
                    lg.group_ids.append(gid)
                    break
            else:
                out.append(_LookupGroup(type(m), [gid], m.kv_cache_spec, m.block_pool))
        out.sort(key=lambda lg: lg.manager_class.kind is not GroupKind.FULL_ATTENTION)
        return out

    def find(self, request: EngineRequest, *, use_eagle: bool = False,
             max_length: int | None = None) -> tuple[list[list[KVCacheBlock]], int]:
        """Hit blocks per group and the hit length in tokens, capped at ``num_tokens - 1`` (and
        at `max_length`): the fixed point; with `use_eagle` (the drafter recomputes the last hit
        position), the fixed point again from one aligned length below it (exactly once)."""
        align = self.alignment_tokens
        top = request.num_tokens - 1 if max_length is None else min(request.num_tokens - 1, max_length)
        length = top // align * align
        hits, length = self._fixed_point(request, length)
        if use_eagle and length > 0:
            hits, length = self._fixed_point(request, length - align)
        return hits, length

    def _fixed_point(self, request: EngineRequest, length: int) -> tuple[list[list[KVCacheBlock]], int]:
        """Query lookup groups round-robin until every one agrees on `length`."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        groups = self._lookup_groups
        n = len(groups)
        agreed, i = 0, 0
        while agreed < n and length > 0:
            lg = groups[i % n]
            bs = lg.spec.block_size  # type: ignore[attr-defined]
            found = lg.manager_class.find_longest_cache_hit(
                group_block_hashes(request, bs), length, lg.group_ids, lg.pool, lg.spec,  # type: ignore[arg-type]
                self.alignment_tokens)
            for gid, blocks in zip(lg.group_ids, found):
                hits[gid] = blocks
            found_len = len(found[0]) * bs
            agreed = 1 if found_len < length else agreed + 1
            length = min(length, found_len)
            i += 1
        if length == 0:
            return [[] for _ in self.managers], 0
        return hits, length

    def shared_prefix_length(self, request: EngineRequest) -> int:
        """The longest aligned prefix (at most ``num_tokens - 1``) that the attention-type
        groups cache, Mamba groups ignored; 0 without attention groups. Read-only."""
        attention = [lg for lg in self._lookup_groups if lg.manager_class.kind.is_attention]
        align = self.alignment_tokens
        length = (request.num_tokens - 1) // align * align
        if not attention or length <= 0:
            return 0
        for lg in attention:
            bs = lg.spec.block_size  # type: ignore[attr-defined]
            found = lg.manager_class.find_longest_cache_hit(
                group_block_hashes(request, bs), length, lg.group_ids, lg.pool, lg.spec,  # type: ignore[arg-type]
                align)
            length = min(length, len(found[0]) * bs // align * align)
            if length == 0:
                break
        return length
