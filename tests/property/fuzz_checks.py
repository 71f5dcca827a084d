"""Checks the stateful fuzzer runs after every rule, written against the shadow model.

Every assertion message starts with an upper-case tag (LEAK, BOUND, SHADOW TABLE, REF, QUEUE,
MAP, PUBLISH, EVICTION ORDER, STATE ORACLE, ...) so that the teeth tests can tell which
property caught a planted bug.
"""

from __future__ import annotations

import math
from collections import Counter

from mambakv import KVCacheCoordinator, MambaManager
from mambakv.core.arena import PAGES, SLOT
from mambakv.core.arena_pool import ArenaPool
from tests.property.fuzz_model import Device, FuzzConfig, ShadowReq, cdiv, expected_hit_length


def held_ids(reqs: dict[str, ShadowReq], cfg: FuzzConfig | None = None, pool_index: int = 0) -> Counter:
    """Non-null block id -> number of shadow tables holding it (with `cfg`: only the tables of
    the groups that take blocks from ``coord.pools[pool_index]``)."""
    count: Counter = Counter()
    for sr in reqs.values():
        if sr.running:
            for g, table in enumerate(sr.tables):
                if cfg is None or cfg.pool_index(g) == pool_index:
                    count.update(b for b in table if b)
    return count


def withdrawn(pool, block_id: int) -> bool:
    """The arena holds the block (its superblock is lent to the other pool, or to none)."""
    return isinstance(pool, ArenaPool) and not pool.lent[block_id // pool.per_superblock]


def in_use(pool) -> int:
    """Blocks some table holds (withdrawn ones excluded)."""
    return pool.num_blocks - 1 - pool.get_num_free_blocks() - pool.num_reserved_blocks


def live_requests(coord: KVCacheCoordinator) -> dict:
    """The coordinator's live requests, as public snapshots (request id -> RequestView)."""
    return {rid: coord.describe(rid) for rid in coord.request_ids}


def _pool_snapshot(pool) -> tuple:
    blocks = tuple((b.ref_cnt, b.block_hash, b.cache_group_id) for b in pool.blocks)
    queue = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    cmap = tuple(sorted(
        (gid, h, tuple(sorted(e)) if isinstance(e, dict) else (e.block_id,))
        for gid, m in pool.cached_block_hash_to_block.items() for h, e in m.items()))
    return blocks, queue, cmap, pool.get_num_free_blocks()


def _arena_snapshot(coord: KVCacheCoordinator) -> tuple:
    """The decoupled layout's superblocks: kinds, conversions, bytes, per-pool stamps, lent
    flags, all-free superblocks in walk order (empty when unified)."""
    a = coord.arena
    if a is None:
        return ()
    pools = tuple((tuple(p.freed_at), tuple(p.lent), tuple(p.find_free_superblocks(len(p.lent))),
                   p.num_reserved_blocks, p.clock.now) for p in (a.pages, a.slots))
    return tuple(a.kind), a.num_conversions, a.num_free_superblocks, a.bytes, pools


def snapshot(coord: KVCacheCoordinator) -> tuple:
    """Everything an allocate may touch: blocks, queue order, map and free count of every pool,
    per-request bookkeeping of every manager, pending plans, the coordinator's request map, the
    arena's superblocks (decoupled)."""
    pools = [_pool_snapshot(p) for p in coord.pools]
    blocks, queue, cmap, free = (tuple(x[i] for x in pools) for i in range(4))
    mgrs = []
    for m in coord.managers:
        reqs = {rid: m.describe(rid) for rid in m.req_to_blocks}
        plans = m.pending_plan() if isinstance(m, MambaManager) else ()
        mgrs.append((reqs, plans))
    live = tuple(sorted((rid, r.num_scheduled) for rid, r in live_requests(coord).items()))
    return blocks, queue, cmap, mgrs, live, free, _arena_snapshot(coord)


def check_unchanged(before: tuple, coord: KVCacheCoordinator, what: str) -> None:
    after = snapshot(coord)
    names = ("blocks", "free queue", "prefix map", "manager bookkeeping", "coordinator requests", "free count",
             "arena")
    for name, b, a in zip(names, before, after):
        assert b == a, f"UNCHANGED: {what} changed the {name}"


def check_eviction_order(coord: KVCacheCoordinator) -> None:
    """The free queue is ``[unhashed ...][hashed ...]``: freed unhashed blocks go to the head,
    hashed ones to the tail, a free block that loses its hash moves to the head; so a cached
    block is never evicted while an unhashed free block exists (DESIGN.md 3). Every pool."""
    for pool in coord.pools:
        seen_hashed = None
        for b in pool.free_block_queue.get_all_free_blocks():
            if b.block_hash is not None:
                seen_hashed = seen_hashed or b
            else:
                assert seen_hashed is None, (f"EVICTION ORDER: unhashed free block {b.block_id} queued behind "
                                             f"cached block {seen_hashed.block_id}")


def check_pool(coord: KVCacheCoordinator, cfg: FuzzConfig, reqs: dict[str, ShadowReq], published: dict) -> None:
    """Every pool: conservation, ref counts, queue membership, null block, prefix-cache map,
    publications (`published` is keyed by ``(pool index, block id)``); decoupled, the
    superblock of every block in a table is lent to that block's pool (so no live page and
    live slot share bytes)."""
    for pi, pool in enumerate(coord.pools):
        for key in [key for key, (_, h, _) in published.items() if key[0] == pi and pool.blocks[key[1]].block_hash != h]:
            del published[key]  # evicted, reset or reused since
        _check_one_pool(pool, pi, held_ids(reqs, cfg, pi), {bid: v for (p, bid), v in published.items() if p == pi})
    arena = coord.arena
    if arena is not None:
        for pi, want in ((0, PAGES), (1, SLOT)):
            per = coord.pools[pi].per_superblock
            for bid in held_ids(reqs, cfg, pi):
                assert arena.kind[bid // per] == want, (
                    f"OVERLAP: block {bid} of pool {pi} in a table, its superblock is {arena.kind[bid // per]}")


def _check_one_pool(pool, pi: int, holders: Counter, published: dict) -> None:
    n = pool.num_blocks
    null = pool.blocks[0]
    assert null.is_null and null.block_hash is None, "NULL: null block hashed"
    assert null.ref_cnt == 0, f"NULL: null block counted (ref {null.ref_cnt})"
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert len(queue) == len(set(queue)) == pool.get_num_free_blocks(), "QUEUE: duplicate or miscounted"
    assert 0 not in queue, "NULL: null block queued"
    assert pool.get_num_free_blocks() + len(holders) + pool.num_reserved_blocks == n - 1, (
        f"LEAK: pool {pi}: {pool.get_num_free_blocks()} free + {len(holders)} held + "
        f"{pool.num_reserved_blocks} withdrawn != {n - 1}")
    free = set(queue)
    for b in pool.blocks[1:]:
        out = withdrawn(pool, b.block_id)
        assert not (out and holders.get(b.block_id)), f"OVERLAP: pool {pi} block {b.block_id} withdrawn but in a table"
        assert b.ref_cnt == holders.get(b.block_id, 0) + out, (
            f"REF: block {b.block_id} ref {b.ref_cnt}, held by {holders.get(b.block_id, 0)} tables")
        assert (b.block_id in free) == (b.ref_cnt == 0), f"QUEUE: block {b.block_id} ref {b.ref_cnt} vs queue"
    mapped = []
    for gid, m in pool.cached_block_hash_to_block.items():
        for h, entry in m.items():
            group = list(entry.values()) if isinstance(entry, dict) else [entry]
            assert group, f"MAP: empty entry in group {gid}"
            for b in group:
                assert not b.is_null, "MAP: null block in the map"
                assert b.block_hash == h and b.cache_group_id == gid, f"MAP: block {b.block_id} under a foreign hash"
                mapped.append(b.block_id)
    hashed = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert sorted(mapped) == sorted(hashed), f"MAP: hashed {sorted(hashed)} vs mapped {sorted(mapped)}"
    for bid in hashed:  # (entries evicted, reset or reused since are dropped by check_pool)
        b = pool.blocks[bid]
        assert bid in published and published[bid][:2] == (b.cache_group_id, b.block_hash), (
            f"PUBLISH: block {bid} hashed outside an allowed publication point")


def check_requests(coord: KVCacheCoordinator, cfg: FuzzConfig, reqs: dict[str, ShadowReq]) -> None:
    """Per request: leak and bound first (they name the failure), then the exact shadow table,
    then the Mamba bookkeeping (watermark, scratch blocks, running slot)."""
    running = {rid for rid, sr in reqs.items() if sr.running}
    held_ids = set(live_requests(coord))
    assert held_ids == running, f"BOOKKEEPING: coordinator holds {held_ids} vs {running}"
    for rid, sr in reqs.items():
        lib = coord.get_block_ids(rid)
        if not sr.running:
            assert not any(lib), f"BOOKKEEPING: {rid} not admitted but holds {lib}"
            assert all(m.describe(rid) is None for m in coord.managers), f"BOOKKEEPING: {rid} kept by a manager"
            continue
        lag = max(0, sr.steps_in_flight() - 1)
        for g, kind in enumerate(cfg.kinds):
            table = lib[g]
            below = sr.retired.get(g, 0)
            assert not any(table[:below]), f"LEAK: {rid} group {g} keeps {table} below slot {below}"
            if kind == "mamba":
                held = sum(1 for b in table if b)
                assert held <= 2 + cfg.nspec + lag, (
                    f"BOUND: {rid} group {g} holds {held} > 2 + {cfg.nspec} + {lag} state blocks: {table}")
            assert table == sr.tables[g], f"SHADOW TABLE: {rid} group {g} library {table} vs model {sr.tables[g]}"
    pool = coord.state_block_pool
    for g in cfg.mamba_gids:
        m = coord.managers[g]
        assert isinstance(m, MambaManager)
        for rid in m.req_to_blocks:
            st = m.describe(rid)
            sr = reqs[rid]
            wm = st.retired_below
            assert wm >= sr.watermark.get(g, 0), f"WATERMARK: {rid} group {g} went down to {wm}"
            sr.watermark[g] = wm
            assert not any(st.block_ids[:wm]), f"WATERMARK: {rid} group {g} real block below {wm}"
            assert st.running_slot == sr.running_slot.get(g, -1), (
                f"SHADOW TABLE: {rid} group {g} running slot {st.running_slot} vs {sr.running_slot.get(g)}")
            for b in (pool.blocks[i] for i in st.block_ids[st.running_slot + 1:]):
                assert b.ref_cnt == 1 and b.block_hash is None, f"SCRATCH: {rid} group {g} block {b.block_id}"
    if not running:
        assert not any(in_use(p) for p in coord.pools), "LEAK: no request left, not every block free"


def hit_still_valid(cfg: FuzzConfig, pools, published: dict, tokens: list[int], hit, n: int) -> bool:
    """Every real block of the hit still carries the hash it was published with, for exactly
    this request's prefix up to the block's end (recorded independently of the hash code).
    `pools`: ``coord.pools``; `published` keyed by ``(pool index, block id)``."""
    for g, blocks in enumerate(hit.blocks if n else ()):
        pi = cfg.pool_index(g)
        for i, b in enumerate(blocks):
            if b.is_null:
                continue
            end = (i + 1) * cfg.block_sizes[g]
            if published.get((pi, b.block_id)) != (g, pools[pi].blocks[b.block_id].block_hash, tuple(tokens[:end])):
                return False
    return True


def check_hit(cfg: FuzzConfig, pools, published: dict, device: Device, tokens: list[int], hit, n: int) -> None:
    """A get_computed_blocks answer: aligned, capped at ``num_tokens - 1``, as long as the brute
    force over the publication record says, the right shape per group, blocks holding this
    prefix, and (where states are exact) Mamba hits pointing at the state of this prefix."""
    align = math.lcm(*cfg.block_sizes)
    assert 0 <= n <= len(tokens) - 1 and n % align == 0, f"HIT: length {n} of {len(tokens)} tokens"
    live = {(g, p) for (pi, bid), (g, h, p) in published.items() if pools[pi].blocks[bid].block_hash == h}
    want = expected_hit_length(cfg, lambda g, i: (g, tuple(tokens[:(i + 1) * cfg.block_sizes[g]])) in live,
                               len(tokens))
    assert n == want, f"HIT: length {n}, brute force says {want}"
    for g, (kind, bs, w) in enumerate(zip(cfg.kinds, cfg.block_sizes, cfg.windows)):
        blocks = hit.blocks[g] if n else []
        assert len(blocks) == n // bs, f"HIT: group {g} has {len(blocks)} blocks for {n} tokens"
        real_from = {"full": 0, "swa": max(0, n // bs - cdiv(w - 1, bs)), "mamba": n // bs - 1}[kind]
        for j, b in enumerate(blocks):
            assert b.is_null == (j < real_from), f"HIT: group {g} slot {j} null={b.is_null}"
    assert hit_still_valid(cfg, pools, published, tokens, hit, n), "HIT: a hit block does not hold this prefix"
    if n and cfg.mamba_gids:  # the fixed point: a state at n comes with attention pages covering [0, n)
        for g, (kind, bs) in enumerate(zip(cfg.kinds, cfg.block_sizes)):
            if kind == "full":
                blocks = hit.blocks[g]
                assert len(blocks) * bs >= n and all(
                    not b.is_null and pools[0].blocks[b.block_id].block_hash is not None for b in blocks), (
                    f"STATE WITHOUT PAGES: a state at {n} with group {g}'s pages {[b.block_id for b in blocks]}")
    if cfg.content_checked and n:
        for g in cfg.mamba_gids:
            tag = device.tag(g, hit.blocks[g][-1].block_id)
            assert tag == (tuple(tokens[:n]), n), f"STATE ORACLE: hit at {n} points at a state {tag[1:]}"
