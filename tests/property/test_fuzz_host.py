"""Stateful fuzzing of the host tier (mambakv.core.host_tier through the coordinator).

A smaller engine than fuzz_engine.FuzzEngine (whose shadow tables and publication record do not
model loads): requests with shared prefixes (cut from a few base sequences and from earlier
requests) are looked up with ``get_computed_blocks_tiered`` (which may start a load), their
loads completed or aborted at random later rules, freed while a load is in flight or held,
admitted (refused while their load is in flight), prefilled in chunks, decoded, preempted and
finished; the transfer plans are drained and checked; ``reset_prefix_cache`` and pool
``evict_blocks`` run at random. Configs: the decoupled layout (write ``through`` and ``evict``)
and the unified one (``through``), full attention + align-mode Mamba groups of one block size, a
GPU pool where one request always fits, and a host budget of a few superblocks (host stores are
skipped and host units evicted all the time).

The device is asynchronous (mambakv/core/transfers.py, "The fence"): a drained plan joins a
list of plans in flight, and a later rule lands the oldest one (or all) with
``transfers_done(fence)``; meanwhile requests are freed, loads aborted and blocks allocated.

After every rule: the library's ``check_invariants()`` and this file's own checks (a failed or
refused call changed nothing; no host block pinned without a load in flight; every GPU block a
copy in flight reads or writes is held (FENCE): the sources of write-through stores, the
destinations of loads not completed; no GPU block held without a request, a load or a fence in
flight (LEAK, checked when no fence is in flight and no store is pending). At the end of every
example everything is freed, every fence landed, and both tiers must be empty of holders.
``MAMBAKV_FUZZ=deep`` selects the long profile.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mambakv import FullAttentionSpec, KVCacheConfig, KVCacheCoordinator, KVCacheGroupSpec, MambaSpec, Request
from mambakv.core.arena import SuperblockGeometry
from mambakv.core.errors import InvalidFenceError, LoadPendingError
from mambakv.core.host_tier import HostTierSpec
from mambakv.core.transfers import BlockKind, Tier, TransferPlan
from tests.property.fuzz_checks import in_use, snapshot
from tests.property.fuzz_machine import active_settings
from tests.property.fuzz_model import ALPHABET, cdiv

MAX_LEN = 32
IDS = tuple(f"h{i}" for i in range(5))
STATS: Counter = Counter()

tokens = st.lists(st.sampled_from(ALPHABET), max_size=6)
idx = st.integers(0, 7)


@dataclass
class HostFuzzConfig:
    block_size: int
    kinds: tuple[str, ...]  # "full" / "mamba" per group
    superblocks: tuple[int, int] | None  # decoupled: (n, k); None: unified
    num_blocks: int  # unified
    host_superblocks: int
    write: str
    eviction: str
    host_eviction: str
    bases: tuple[tuple[int, ...], ...]

    def build(self) -> KVCacheCoordinator:
        bs = self.block_size
        groups = [KVCacheGroupSpec([f"l{g}"], FullAttentionSpec(bs, 1, 1, "float16") if kind == "full"
                                   else MambaSpec(bs, ((2, 2),), ("float32",), mode="align"))
                  for g, kind in enumerate(self.kinds)]
        if self.superblocks is not None:
            n, k = self.superblocks
            geo = SuperblockGeometry(n, k, 4, 4 * k - (k > 1))
            cfg = KVCacheConfig(geo.num_pages, groups, geo)
            spec = HostTierSpec(self.host_superblocks * k * 4, write=self.write, eviction=self.host_eviction)
            return KVCacheCoordinator(cfg, max_model_len=MAX_LEN, eviction=self.eviction, host_tier=spec)
        spec = HostTierSpec(self.host_superblocks * 16, block_bytes=16, eviction=self.host_eviction)
        return KVCacheCoordinator(KVCacheConfig(self.num_blocks, groups), max_model_len=MAX_LEN, host_tier=spec)


@st.composite
def host_configs(draw) -> HostFuzzConfig:
    bs = draw(st.sampled_from([2, 4]))
    kinds = ("full", "mamba") + tuple(draw(st.lists(st.sampled_from(["full", "mamba"]), max_size=1)))
    decoupled = draw(st.integers(0, 3)) > 0
    pages = sum(cdiv(MAX_LEN, bs) for kd in kinds if kd == "full")
    slots = 2 * sum(kd == "mamba" for kd in kinds)
    superblocks, num_blocks = None, 0
    if decoupled:
        k = draw(st.integers(1, 3))
        one = cdiv(max(0, pages - (k - 1)), k) + slots  # one request of MAX_LEN tokens fits
        superblocks = (1 + one + draw(st.integers(0, one)), k)
        write = draw(st.sampled_from(["through", "evict"]))
    else:
        one = pages + slots
        num_blocks = 1 + one + draw(st.integers(0, one))
        write = "through"
    host = draw(st.integers(2, 3 * one))
    bases = tuple(tuple(draw(st.lists(st.sampled_from(ALPHABET), min_size=24, max_size=24))) for _ in range(2))
    return HostFuzzConfig(bs, kinds, superblocks, num_blocks, host, write, draw(st.sampled_from(["lru", "reuse"])),
                          draw(st.sampled_from(["lru", "reuse"])), bases)


@dataclass
class HReq:
    request: Request
    status: str = "waiting"  # waiting / loading (in flight) / loaded (complete, held) / running
    hit: tuple[int, int] = (0, 0)  # (gpu, host) tokens of its tiered lookup
    lossy: bool = False  # evict_blocks ran while its load was held (its hit may have lost pages)
    looked: bool = False  # had a tiered lookup (an engine with a host tier looks up first)
    load_fence: int = 0  # the fence of the plan that handed out its current load (0: not drained)


def full_snapshot(coord: KVCacheCoordinator) -> tuple:
    host = coord.host
    assert host is not None
    return (snapshot(coord), in_use(host.arena.pages), in_use(host.arena.slots), repr(host.stats),
            sorted(host.units.where), repr(coord.prefix_cache_stats))


class HostFuzzMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.coord: KVCacheCoordinator | None = None
        self.reqs: dict[str, HReq] = {}
        self.clock = 0.0
        #: drained plans whose copies the device has not finished (oldest first)
        self.inflight: list[TransferPlan] = []
        self.last_fence = self.done_fence = 0
        #: (fence, request id) of the in-flight loads the engine completed (their copies ran)
        self.completed: set[tuple[int, str]] = set()
        #: (fence, request id) of the in-flight loads aborted after their plan was drained
        self.aborted: set[tuple[int, str]] = set()
        #: a free since the last drain may have planned write-through stores (held until landed)
        self.maybe_pending = False

    def _on(self) -> bool:
        return self.coord is not None

    def now(self) -> float:
        self.clock += 1.0 + len(self.reqs) * 3 % 17
        return self.clock

    def pick(self, i: int, *statuses: str) -> HReq:
        cands = [r for _, r in sorted(self.reqs.items()) if r.status in statuses]
        return cands[i % len(cands)]

    def has(self, *statuses: str) -> bool:
        return any(r.status in statuses for r in self.reqs.values())

    @initialize(cfg=host_configs())
    def setup(self, cfg: HostFuzzConfig) -> None:
        self.cfg = cfg
        self.coord = cfg.build()
        self.history: list[tuple[int, ...]] = list(cfg.bases)
        STATS["examples"] += 1
        STATS[f"write {cfg.write}"] += 1

    # ------------------------------------------------------------------ requests
    @precondition(lambda self: self._on() and len(self.reqs) < len(IDS))
    @rule(src=st.integers(0, 30), cut=st.integers(0, 28), tail=tokens, max_tokens=st.integers(1, 6))
    def add(self, src: int, cut: int, tail: list[int], max_tokens: int) -> None:
        rid = next(r for r in IDS if r not in self.reqs)
        source = self.history[src % len(self.history)]
        toks = (list(source[:cut]) + tail)[:MAX_LEN - 8] or [ALPHABET[0]]
        self.reqs[rid] = HReq(Request(rid, toks, max_tokens=max_tokens))

    @precondition(lambda self: self._on() and self.has("waiting", "loading", "loaded"))
    @rule(i=idx)
    def tiered(self, i: int) -> None:
        coord, r = self.coord, self.pick(i, "waiting", "loading", "loaded")
        req = r.request
        before = full_snapshot(coord)
        if r.status == "loading":
            with pytest.raises(LoadPendingError):
                coord.get_computed_blocks_tiered(req, now=self.now())
            assert full_snapshot(coord) == before, "UNCHANGED: a refused tiered lookup"
            STATS["tiered refused"] += 1
            return
        gpu = coord.get_computed_blocks(req)[1]
        hit = coord.get_computed_blocks_tiered(req, now=self.now())
        r.looked = True
        bs = self.cfg.block_size
        assert hit.num_gpu_tokens == gpu, "HIT: the tiered call's GPU part differs from get_computed_blocks"
        total = hit.num_gpu_tokens + hit.num_host_tokens
        assert total % bs == 0 and total <= req.num_tokens - 1, f"HIT: {total} of {req.num_tokens} tokens"
        if hit.load is None:
            assert hit.num_host_tokens == 0
            assert full_snapshot(coord) == before, "UNCHANGED: a tiered lookup without a load"
            return
        assert r.status == "waiting", "LOAD: a second load started for a request whose load is held"
        load = hit.load
        assert load.request_id == req.request_id and load.num_tokens == hit.num_host_tokens > 0
        assert load.num_bytes == sum(t.num_bytes for t in load.transfers) > 0
        g = self.coord.host.geometry
        states = [t for t in load.transfers if t.kind is BlockKind.STATE]
        for t in load.transfers:
            assert t.src_tier is Tier.HOST and t.dst_tier is Tier.GPU
            assert t.num_bytes == (g.page_bytes if t.kind is BlockKind.PAGE else g.state_bytes)
        assert len(states) in (0, self.cfg.kinds.count("mamba"))
        assert coord.load_pending(req.request_id)
        # (the load's room may evict the GPU part's own state, never publish the host part)
        assert coord.get_computed_blocks(req)[1] <= gpu, "HIT: a tier-unaware lookup sees a load in flight"
        r.status, r.hit, r.lossy, r.load_fence = "loading", (hit.num_gpu_tokens, hit.num_host_tokens), False, 0
        STATS["loads started"] += 1

    @precondition(lambda self: self._on() and self.has("loading"))
    @rule(i=idx)
    def complete(self, i: int) -> None:
        r = self.pick(i, "loading")
        self.coord.complete_load(r.request.request_id)
        if r.load_fence:
            self.completed.add((r.load_fence, r.request.request_id))
        assert not self.coord.load_pending(r.request.request_id)
        if not r.lossy:
            assert self.coord.get_computed_blocks(r.request)[1] >= sum(r.hit), "HIT: a completed load is not a GPU hit"
        r.status = "loaded"
        STATS["loads completed"] += 1

    @precondition(lambda self: self._on() and self.has("loading", "loaded"))
    @rule(i=idx)
    def abort(self, i: int) -> None:
        r = self.pick(i, "loading", "loaded")
        self._aborting(r)
        self.coord.abort_load(r.request.request_id)
        with pytest.raises(LoadPendingError):
            self.coord.abort_load(r.request.request_id)
        STATS["loads aborted" if r.status == "loading" else "holds released"] += 1
        r.status = "waiting"

    @precondition(lambda self: self._on() and self.has("waiting", "loading", "loaded"))
    @rule(i=idx)
    def drop(self, i: int) -> None:
        """The request goes away before its admission: free() aborts its load / ends its hold."""
        r = self.pick(i, "waiting", "loading", "loaded")
        STATS[f"freed while {r.status}"] += 1
        self._aborting(r)
        self.coord.free(r.request.request_id, now=self.now())
        self.maybe_pending = True
        assert not self.coord.load_pending(r.request.request_id)
        del self.reqs[r.request.request_id]

    def _aborting(self, r: HReq) -> None:
        """`r`'s load ends without complete_load: drained and in flight, its destinations
        stay held by the fence."""
        if r.status == "loading" and r.load_fence > self.done_fence:
            self.aborted.add((r.load_fence, r.request.request_id))
            STATS["loads aborted in flight"] += 1

    def admissible(self) -> list[HReq]:
        return [r for _, r in sorted(self.reqs.items()) if r.status in ("loading", "loaded")
                or r.status == "waiting" and r.looked]

    @precondition(lambda self: self._on() and self.admissible())
    @rule(i=idx, chunk=st.integers(4, 32))
    def admit(self, i: int, chunk: int) -> None:
        """First allocate with the (tier-unaware) hit, then the prefill's remaining chunks."""
        cands = self.admissible()
        coord, r = self.coord, cands[i % len(cands)]
        req = r.request
        blocks, n = coord.get_computed_blocks(req)
        before = full_snapshot(coord)
        end = coord.next_chunk_end(req, chunk, num_computed_tokens=n)
        if r.status == "loading":
            with pytest.raises(LoadPendingError):
                coord.allocate(req, end - n, num_new_computed_tokens=n, new_computed_blocks=blocks, now=self.now())
            assert full_snapshot(coord) == before, "UNCHANGED: allocate refused during a load"
            STATS["allocates refused during a load"] += 1
            return
        host_hits = coord.prefix_cache_stats.host_hits
        got = coord.allocate(req, end - n, num_new_computed_tokens=n, new_computed_blocks=blocks, now=self.now())
        if got is None:
            assert full_snapshot(coord) == before, "UNCHANGED: a failed allocate"
            STATS["failed allocates"] += 1
            return
        added = coord.prefix_cache_stats.host_hits - host_hits
        if r.status == "loaded":
            assert 0 <= added <= r.hit[1], f"HOST HITS: {added} counted for a {r.hit[1]}-token load"
            STATS["host hit tokens"] += added
            STATS["loaded requests admitted"] += 1
        else:
            assert added == 0
        r.status = "running"
        self._advance(r, end)
        while req.num_computed_tokens < req.num_tokens and r.status == "running":
            end = coord.next_chunk_end(req, chunk, num_computed_tokens=req.num_computed_tokens)
            if coord.allocate(req, end - req.num_computed_tokens, num_draft_tokens=0, now=self.now()) is None:
                self._preempt(r)
                return
            self._advance(r, end)
            coord.check_invariants()

    def _advance(self, r: HReq, end: int) -> None:
        r.request.num_computed_tokens = end
        self.coord.retire(r.request.request_id, end)
        self.coord.take_step_plan()

    def _preempt(self, r: HReq) -> None:
        rid = r.request.request_id
        self.coord.free(rid, now=self.now())
        self.maybe_pending = True
        self.history.append(tuple(r.request.all_token_ids.tolist()))
        del self.history[2:-6]
        left = max(1, r.request.max_tokens - r.request.num_output_tokens)
        self.reqs[rid] = HReq(Request(rid, r.request.all_token_ids.tolist(), max_tokens=left))
        STATS["preemptions"] += 1

    @precondition(lambda self: self._on() and self.has("running"))
    @rule(i=idx, tok=st.sampled_from(ALPHABET))
    def decode(self, i: int, tok: int) -> None:
        r = self.pick(i, "running")
        req = r.request
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= MAX_LEN - 1:
            self.finish_one(r)
            return
        req.append_output_token_ids(tok)
        if self.coord.allocate(req, 1, num_draft_tokens=0, now=self.now()) is None:
            self._preempt(r)
            return
        self._advance(r, req.num_tokens)
        STATS["decode steps"] += 1

    def finish_one(self, r: HReq) -> None:
        self.coord.free(r.request.request_id, now=self.now())
        self.maybe_pending = True
        self.history.append(tuple(r.request.all_token_ids.tolist()))
        del self.history[2:-6]
        del self.reqs[r.request.request_id]
        STATS["finished"] += 1

    @precondition(lambda self: self._on() and self.has("running"))
    @rule(i=idx, preempt=st.booleans())
    def finish(self, i: int, preempt: bool) -> None:
        r = self.pick(i, "running")
        if preempt:
            self._preempt(r)
        else:
            self.finish_one(r)

    # ------------------------------------------------------------------ plans and maintenance
    @precondition(lambda self: self._on())
    @rule()
    def drain_plan(self) -> None:
        plan = self.coord.take_transfer_plan()
        g = self.coord.host.geometry
        for t in plan.stores:
            assert t.src_tier is Tier.GPU and t.dst_tier is Tier.HOST
            assert t.num_bytes == (g.page_bytes if t.kind is BlockKind.PAGE else g.state_bytes)
        dsts = [(t.kind, t.dst_block) for t in plan.stores]
        assert len(set(dsts)) == len(dsts), "STORES: a host block written twice in one plan"
        for p in plan.loads:
            assert self.reqs.get(p.request_id) is not None and self.reqs[p.request_id].status == "loading", (
                f"LOADS: the plan hands out {p.request_id}'s load, which is not in flight")
            self.reqs[p.request_id].load_fence = plan.fence
        self.maybe_pending = False
        if not plan:
            assert plan.fence == 0, "FENCE: the empty plan carries a fence"
            return
        assert plan.fence == self.last_fence + 1, f"FENCE: plan fence {plan.fence} after {self.last_fence}"
        self.last_fence = plan.fence
        self.inflight.append(plan)
        STATS["plans"] += 1
        STATS["max fences in flight"] = max(STATS["max fences in flight"], len(self.inflight))

    @precondition(lambda self: self._on() and self.inflight)
    @rule(every=st.booleans(), probe=st.integers(0, 5))
    def land(self, every: bool, probe: int) -> None:
        """The device finished the oldest plan in flight (or all of them): ``transfers_done``.
        With `probe` 0, first the refusals: a fence never issued, negative or not an int (raises),
        a passed one (a no-op): nothing changed."""
        if not probe:
            self._refusals()
        self._land(self.inflight[-1 if every else 0].fence)

    def _refusals(self) -> None:
        coord = self.coord
        before = full_snapshot(coord)
        for bad in (self.last_fence + 1, self.last_fence + 7, -1, str(self.done_fence), float(self.done_fence), None):
            with pytest.raises(InvalidFenceError):
                coord.transfers_done(bad)  # type: ignore[arg-type]
            assert full_snapshot(coord) == before, f"UNCHANGED: a refused transfers_done({bad!r})"
        for passed in {0, self.done_fence // 2, self.done_fence}:
            coord.transfers_done(passed)
            assert full_snapshot(coord) == before, f"UNCHANGED: transfers_done({passed}), a passed fence"
        STATS["fence refusals"] += 1

    def _land(self, fence: int) -> None:
        coord = self.coord
        free_before = [p.get_num_free_blocks() for p in coord.pools]
        coord.transfers_done(fence)
        assert all(p.get_num_free_blocks() >= n for p, n in zip(coord.pools, free_before)), (
            "FENCE: transfers_done took free blocks")
        self.done_fence = fence
        self.inflight = [p for p in self.inflight if p.fence > fence]
        self.completed = {k for k in self.completed if k[0] > fence}
        self.aborted = {k for k in self.aborted if k[0] > fence}
        STATS["fences landed"] += 1

    def _land_all(self) -> None:
        """An engine that waits for its side stream: drain the last plan, land everything."""
        self.drain_plan()
        if self.inflight:
            self._land(self.inflight[-1].fence)
        assert not self.inflight

    def _fence_holds(self) -> bool:
        """A plan in flight is known to hold GPU blocks (write-through store sources, an
        aborted load's destinations); it may hold others (the sources of stores it dropped)."""
        through = self.cfg.write == "through"
        return bool(self.aborted) or (through and any(p.stores for p in self.inflight))

    @precondition(lambda self: self._on() and not self.has("running"))
    @rule(go=st.integers(0, 9), wait=st.booleans())
    def reset(self, go: int, wait: bool) -> None:
        coord = self.coord
        held = self.has("loading", "loaded")
        # A reset that empties both tiers is rare (go == 0); one a fence must refuse changes
        # nothing, so it is tried whenever the model knows a fence holds blocks (reached by
        # construction, not by the seed's luck).
        probe = bool(go) and not held and self._fence_holds()
        if go and not probe:
            return
        if wait and not held and not probe:  # the engine lets its copies finish first
            self._land_all()
        fenced = self._fence_holds()
        before = full_snapshot(coord)
        ok = coord.reset_prefix_cache()
        if held or fenced:
            assert not ok and full_snapshot(coord) == before, (
                "RESET: succeeded (or changed) with a load held or a fence holding blocks")
            STATS["resets refused for a fence"] += not held
        elif not ok:  # what a fence in flight or a pending store holds is not known to the model
            assert full_snapshot(coord) == before, "RESET: refused and changed something"
            assert self.inflight or self.maybe_pending, "RESET: refused with nothing held and nothing in flight"
            STATS["resets refused for a fence"] += 1
        else:
            assert not coord.take_transfer_plan(), "RESET: transfers survived"
            self.maybe_pending = False
            assert coord.host.units.num_pages == 0 and not any(
                b.block_hash is not None for p in (coord.host.arena.pages, coord.host.arena.slots) for b in p.blocks)
            STATS["resets"] += 1

    @precondition(lambda self: self._on())
    @rule(pool=st.integers(0, 1), ids=st.lists(st.integers(0, 60), min_size=1, max_size=3), go=st.integers(0, 4))
    def evict(self, pool: int, ids: list[int], go: int) -> None:
        if go:  # rarer than the engine's own calls
            return
        p = self.coord.pools[pool % len(self.coord.pools)]
        p.evict_blocks([i % p.num_blocks for i in ids])
        for r in self.reqs.values():
            r.lossy = True
        STATS["evict_blocks"] += 1

    # ------------------------------------------------------------------ checks
    @invariant()
    def consistent(self) -> None:
        coord = self.coord
        if coord is None:
            return
        coord.check_invariants()
        host = coord.host
        loads = {rid for rid, r in self.reqs.items() if r.status == "loading"}
        for rid, r in self.reqs.items():
            assert coord.load_pending(rid) == (r.status == "loading"), f"LOAD: {rid} {r.status}"
        assert set(coord.request_ids) == {rid for rid, r in self.reqs.items() if r.status == "running"}
        if not loads:
            assert not in_use(host.arena.pages) and not in_use(host.arena.slots), "PIN: host blocks pinned, no load"
        if not self.inflight and not self.maybe_pending and not any(
                r.status in ("running", "loading", "loaded") for r in self.reqs.values()):
            assert not any(in_use(p) for p in coord.pools), "LEAK: GPU blocks held with nothing holding them"
        self.fenced_blocks_held()
        s, u = host.stats, host.units.stats
        self._seen = getattr(self, "_seen", (0, 0, 0, 0))
        seen = (s.stores, u.evictions, s.skipped_stores, s.aborted_loads)
        for name, a, b in zip(("host stores", "host evictions", "skipped stores", "aborted (library count)"),
                              seen, self._seen):
            STATS[name] += a - b
        self._seen = seen

    def fenced_blocks_held(self) -> None:
        """FENCE: every GPU block a copy in flight reads or writes has ref_cnt >= 1 (no free
        queue, no new table can take it): the GPU sources of its stores (except write 'evict',
        whose stores run before the evicting step writes: the fence holds nothing for them),
        the destinations of its loads not completed, which no live table holds either."""
        coord = self.coord
        pool = {BlockKind.PAGE: coord.block_pool, BlockKind.STATE: coord.state_block_pool}
        tables: dict[tuple[int, int], str] = {}
        for rid in coord.request_ids:
            for g, ids in enumerate(coord.get_block_ids(rid)):
                spec = coord.kv_cache_config.kv_cache_groups[g].kv_cache_spec
                for b in ids:
                    if b:
                        tables[(id(coord.pool_of(spec)), b)] = rid
        for plan in self.inflight:
            if self.cfg.write != "evict":
                for t in plan.stores:
                    if t.src_tier is Tier.GPU:
                        b = pool[t.kind].blocks[t.src_block]
                        assert b.ref_cnt >= 1, (
                            f"FENCE: GPU {t.kind.value} {t.src_block} free while fence {plan.fence}'s store reads it")
            for p in plan.loads:
                if (plan.fence, p.request_id) in self.completed:
                    continue
                for t in p.transfers:
                    b = pool[t.kind].blocks[t.dst_block]
                    assert b.ref_cnt >= 1, (
                        f"FENCE: GPU {t.kind.value} {t.dst_block} free while fence {plan.fence}'s load writes it")
                    owner = tables.get((id(pool[t.kind]), t.dst_block))
                    assert owner is None, (f"FENCE: GPU {t.kind.value} {t.dst_block} in {owner}'s table while fence "
                                           f"{plan.fence}'s load for {p.request_id} writes it")

    def teardown(self) -> None:
        coord = self.coord
        if coord is None:
            return
        for rid, r in sorted(self.reqs.items()):
            self._aborting(r)
            coord.free(rid, now=self.now())
            coord.check_invariants()
            self.fenced_blocks_held()
        self.reqs.clear()
        self._land_all()  # the frees' stores, then every fence in flight
        coord.check_invariants()
        self._refusals()
        assert not any(in_use(p) for p in coord.pools), "LEAK: GPU blocks held after everything ended"
        host = coord.host
        assert not in_use(host.arena.pages) and not in_use(host.arena.slots), "LEAK: host blocks pinned at the end"
        assert coord.reset_prefix_cache()
        assert not coord.take_transfer_plan().loads


#: must be reached (the counts of the rarer paths, holds released and frees of a completed load,
#: are printed with the rest)
REACHED = ("host stores", "host evictions", "skipped stores", "loads started", "loads completed", "loads aborted",
           "freed while loading", "loaded requests admitted", "host hit tokens", "allocates refused during a load",
           "tiered refused", "write evict", "write through", "preemptions", "resets", "fences landed",
           "fence refusals", "loads aborted in flight", "resets refused for a fence")


def test_host_tier_state_machine() -> None:
    STATS.clear()
    deep = os.environ.get("MAMBAKV_FUZZ") == "deep"
    run_state_machine_as_test(HostFuzzMachine, settings=active_settings() if deep else active_settings(max_examples=600))
    print(f"\nhost fuzzer exercised: {dict(STATS)}")
    for what in REACHED:
        assert STATS[what] > 0, f"the host fuzzer never exercised {what}: {dict(STATS)}"
