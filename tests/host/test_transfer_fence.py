"""The load/store fence (mambakv/core/transfers.py, "The fence") against a modelled asynchronous
copy engine, through the public API only.

The device model (:class:`AsyncDevice`) runs each transfer plan's copies `lag` engine steps
after the plan was taken: the engine's ``step()`` first lands the plans that are due (their loads
are completed with ``complete_load``, then ``transfers_done(fence)`` of the newest one), then takes
the step's plan. Meanwhile requests are freed, loads aborted and other requests allocate. After
every call the checker (:meth:`AsyncDevice.check`) asserts, for every plan in flight:

* a write-through store's GPU source has ref_cnt >= 1 (not in the free queue, so no new table
  can take it) and is in another request's table only as a cached block (a prefix hit reads it,
  nothing writes it);
* a load's GPU destination has ref_cnt >= 1 and is in no request's table at all (its own
  request's hold is not a table: it allocates only after ``complete_load``);
* with write 'evict' a store's source is not checked: the contract is that such stores run
  before the evicting step writes GPU memory, and the fence holds nothing for them.

Once every fence landed and every request ended, the GPU holds nothing and
``reset_prefix_cache()`` succeeds.

Geometries: the decoupled harness (tests/host/harness.py: 12 superblocks of k = 2 pages of
128 B or one 176 B state slot) and the unified layout of tests/host/test_host_layouts.py (16
blocks, 15 usable, a page or a state each, 4-token pages). In the unified layout a request of
``t`` tokens allocated in one call takes ``ceil(t / 4)`` pages and 1 state block (align mode,
no speculative blocks); the harness's 13-token prefill (chunks 0..12, 12..13) takes 4 pages and
2 states and leaves, freed, 3 cached pages and its checkpoint state at page 2.
"""

from __future__ import annotations

import random

import pytest

from mambakv import InvalidFenceError, KVCacheCoordinator, Request
from mambakv.core.host_tier import HostTierSpec
from mambakv.core.transfers import EMPTY_TRANSFER_PLAN, BlockKind, Tier, TransferPlan
from tests.host.harness import B2, A, HostHarness, full_snapshot
from tests.host.test_host_layouts import UB, unified_config
from tests.property.fuzz_checks import in_use

PAGE, STATE = BlockKind.PAGE, BlockKind.STATE


def unified(num_blocks: int = 16, host_blocks: int = 8) -> KVCacheCoordinator:
    return KVCacheCoordinator(unified_config(num_blocks), max_model_len=256,
                              host_tier=HostTierSpec(host_blocks * UB, block_bytes=UB))


def build(layout: str) -> KVCacheCoordinator:
    """'decoupled' / 'evict': the decoupled harness (write-through / write-on-evict), 20 host
    superblocks; 'unified': 16 GPU blocks, a host of 12 blocks."""
    if layout == "unified":
        return unified(16, 12)
    return HostHarness(write="through" if layout == "decoupled" else "evict").coord


class AsyncDevice:
    """The engine's side stream: plans run `lag` steps after they were taken."""

    def __init__(self, coord: KVCacheCoordinator, lag: int) -> None:
        self.coord, self.lag = coord, lag
        self.evict = coord.host is not None and coord.host.write.value == "evict"
        self.t = self.last_fence = 0
        self.inflight: list[tuple[int, TransferPlan]] = []  # (step it lands at, plan)
        self.load_fence: dict[str, int] = {}  # request id -> fence of its drained, pending load
        self.check()

    # ------------------------------------------------------------------ calls, each checked
    def call(self, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        self.check()
        return out

    def step(self) -> TransferPlan:
        """One engine step: the plans due land (their loads completed, then ``transfers_done``
        of the newest), then the step's plan is taken and its copies start."""
        self.t += 1
        due = [p for t, p in self.inflight if t <= self.t]
        if due:
            for plan in due:
                for load in plan.loads:
                    if self.load_fence.get(load.request_id) == plan.fence:
                        del self.load_fence[load.request_id]
                        self.call(self.coord.complete_load, load.request_id)
            self.inflight = [(t, p) for t, p in self.inflight if t > self.t]
            self.call(self.coord.transfers_done, due[-1].fence)
        plan = self.call(self.coord.take_transfer_plan)
        if plan:
            assert plan.fence > self.last_fence, "fences count up"
            self.last_fence = plan.fence
            self.inflight.append((self.t + self.lag, plan))
            for load in plan.loads:
                self.load_fence[load.request_id] = plan.fence
        else:
            assert plan is EMPTY_TRANSFER_PLAN and plan.fence == 0
        return plan

    def abort(self, rid: str) -> None:
        self.load_fence.pop(rid, None)
        self.call(self.coord.abort_load, rid)

    def free(self, rid: str, now: float) -> None:
        self.load_fence.pop(rid, None)
        self.call(self.coord.free, rid, now=now)

    def settle(self) -> None:
        """Run steps until no plan is in flight (the last step's plan may be empty)."""
        for _ in range(self.lag + 3):
            self.step()
            if not self.inflight:
                return
        raise AssertionError("plans stayed in flight")

    # ------------------------------------------------------------------ the fence property
    def in_flight_blocks(self) -> tuple[set[tuple[BlockKind, int]], set[tuple[BlockKind, int]]]:
        """(store sources the fence must hold, load destinations) of the plans in flight."""
        sources = {(t.kind, t.src_block) for _, p in self.inflight for t in p.stores
                   if t.src_tier is Tier.GPU and not self.evict}
        dsts = {(t.kind, t.dst_block) for _, p in self.inflight for load in p.loads for t in load.transfers}
        return sources, dsts

    def check(self) -> None:
        coord = self.coord
        coord.check_invariants()
        pool = {PAGE: coord.block_pool, STATE: coord.state_block_pool}
        tables: dict[tuple[int, int], str] = {}
        for rid in coord.request_ids:
            for g, ids in enumerate(coord.get_block_ids(rid)):
                p = coord.pool_of(coord.kv_cache_config.kv_cache_groups[g].kv_cache_spec)
                tables.update(((id(p), b), rid) for b in ids if b)
        sources, dsts = self.in_flight_blocks()
        for kind, bid in sources:
            b = pool[kind].blocks[bid]
            assert b.ref_cnt >= 1, f"{kind.value} {bid}: free while a store in flight reads it"
            owner = tables.get((id(pool[kind]), bid))
            assert owner is None or b.block_hash is not None, (
                f"{kind.value} {bid}: in {owner}'s table, unhashed, while a store in flight reads it")
        for kind, bid in dsts:
            assert pool[kind].blocks[bid].ref_cnt >= 1, f"{kind.value} {bid}: free while a load in flight writes it"
            owner = tables.get((id(pool[kind]), bid))
            assert owner is None, f"{kind.value} {bid}: in {owner}'s table while a load in flight writes it"

    def gpu_free(self) -> tuple[int, ...]:
        return tuple(p.get_num_free_blocks() for p in self.coord.pools)


# ---------------------------------------------------------------------------- a workload
class Workload:
    """Requests over a few shared prefixes, admitted through tiered lookups, prefilled in chunks,
    decoded, finished, freed while loading, aborted after their plan was drained; one engine
    step per round (seeded: the same run every time)."""

    def __init__(self, layout: str, lag: int, seed: int) -> None:
        self.coord = build(layout)
        self.dev = AsyncDevice(self.coord, lag)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.n = 0
        self.status: dict[str, str] = {}  # rid -> waiting / loading / running
        self.reqs: dict[str, Request] = {}
        self.bases = [list(range(1000 * k, 1000 * k + 40)) for k in range(1, 4)]
        self.stats = {"loads": 0, "aborted in flight": 0, "freed in flight": 0, "steps with stores in flight": 0,
                      "failed allocates": 0, "admitted after load": 0}

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def add(self) -> None:
        rng = self.rng
        base = rng.choice(self.bases)
        toks = base[:rng.choice((8, 12, 13, 20, 23, 28))] + [rng.randrange(5000, 6000) for _ in range(rng.randrange(0, 4))]
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, toks, max_tokens=rng.randrange(1, 4))
        self.reqs[rid], self.status[rid] = req, "waiting"
        hit = self.dev.call(self.coord.get_computed_blocks_tiered, req, now=self.tick())
        if hit.load is not None:
            self.status[rid] = "loading"
            self.stats["loads"] += 1

    def admit(self, rid: str) -> None:
        coord, req = self.coord, self.reqs[rid]
        if coord.load_pending(rid):
            return
        blocks, n = self.dev.call(coord.get_computed_blocks, req)
        end = coord.next_chunk_end(req, self.rng.choice((8, 16, 64)), num_computed_tokens=n)
        got = self.dev.call(coord.allocate, req, end - n, num_new_computed_tokens=n, new_computed_blocks=blocks,
                            num_draft_tokens=0, now=self.tick())
        if got is None:
            self.stats["failed allocates"] += 1
            return
        self.stats["admitted after load"] += self.status[rid] == "loading"
        self.status[rid] = "running"
        self.advance(req, end)

    def advance(self, req: Request, end: int) -> None:
        req.num_computed_tokens = end
        self.dev.call(self.coord.retire, req.request_id, end)
        self.coord.take_step_plan()

    def run_one(self, rid: str) -> None:
        coord, req = self.coord, self.reqs[rid]
        if req.num_computed_tokens < req.num_tokens:  # prefill's next chunk
            end = coord.next_chunk_end(req, 16)
            if self.dev.call(coord.allocate, req, end - req.num_computed_tokens, num_draft_tokens=0,
                             now=self.tick()) is None:
                self.stats["failed allocates"] += 1
                return self.end(rid)  # preempted: freed, as the engine would
            return self.advance(req, end)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= 60:
            return self.end(rid)
        req.append_output_token_ids(self.rng.randrange(5000, 6000))
        if self.dev.call(coord.allocate, req, 1, num_draft_tokens=0, now=self.tick()) is None:
            self.stats["failed allocates"] += 1
            return self.end(rid)
        self.advance(req, req.num_tokens)

    def end(self, rid: str) -> None:
        status = self.status.pop(rid)
        if status == "loading" and rid in self.dev.load_fence:
            self.stats["freed in flight"] += 1
        self.dev.free(rid, now=self.tick())
        del self.reqs[rid]

    def round(self) -> None:
        rng = self.rng
        if len(self.status) < 4 and rng.random() < 0.6:
            self.add()
        for rid in sorted(self.status):
            st = self.status[rid]
            r = rng.random()
            if st == "loading" and r < 0.25:
                if rid in self.dev.load_fence:
                    self.stats["aborted in flight"] += 1
                self.dev.abort(rid)
                self.status[rid] = "waiting"
            elif st == "loading" and r < 0.4:
                self.end(rid)
            elif st in ("waiting", "loading"):
                self.admit(rid)
            elif st == "running":
                self.run_one(rid)
        self.dev.step()
        self.stats["steps with stores in flight"] += bool(self.dev.in_flight_blocks()[0])

    def finish(self) -> None:
        for rid in sorted(self.status):
            self.end(rid)
        self.dev.settle()
        assert not any(in_use(p) for p in self.coord.pools), "a GPU block is held after every fence landed"
        assert self.dev.call(self.coord.reset_prefix_cache) is True


@pytest.mark.parametrize("lag", [1, 2])
@pytest.mark.parametrize("layout", ["decoupled", "evict", "unified"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_copies_in_flight_never_touch_reused_blocks(layout, lag, seed):
    w = Workload(layout, lag, seed)
    for _ in range(120):
        w.round()
    w.finish()
    s = w.stats
    assert s["loads"] > 0 and s["failed allocates"] > 0, s  # the host tier and a full pool were exercised


def test_the_workload_reaches_the_fenced_paths():
    """Over the seeds of the test above: loads aborted and freed after their plan was drained,
    requests admitted after their load, frees that left blocks held."""
    total = {k: 0 for k in Workload("decoupled", 1, 0).stats}
    for layout in ("decoupled", "unified"):
        for lag in (1, 2):
            for seed in (0, 1, 2):
                w = Workload(layout, lag, seed)
                for _ in range(120):
                    w.round()
                w.finish()
                for k, v in w.stats.items():
                    total[k] += v
    assert all(total.values()), total


# ---------------------------------------------------------------------------- (a) an aborted load
@pytest.mark.parametrize("lag", [1, 2])
def test_abort_after_drain_keeps_the_destinations_until_transfers_done(lag):
    """Unified, 15 usable blocks; the free queue hands out its head first (unhashed blocks are
    freed to the head, cached ones to the tail).

    * ``a`` (13 tokens) runs and is freed: write-through stores its 3 pages and its checkpoint
      state (4 blocks, ids 1..4: the first 4 of the initial queue). One step later the plan
      lands (the device runs the stores; for lag 2 after two steps). Then the GPU loses every
      cached block (``evict_blocks``): the host alone has ``a``'s chain.
    * ``x``: 20 tokens in one allocate, kept running: 5 pages + 1 state = 6 blocks, exactly the
      6 blocks ``a`` used (1..6: freed or dropped to the head). 15 - 6 = 9 free: 7..15, in
      order.
    * ``a2`` (``a`` + 3 tokens, 16 tokens: cap 3 pages) loads ``a``'s 12 tokens from the host:
      3 pages + 1 state into blocks 7, 8, 9 (pages) and 10 (state). 9 - 4 = 5 free (11..15).
    * The step drains the load's plan (fence 2); then ``abort_load``: the copies may still
      write 7..10, so they stay held: 5 free, not 9.
    * ``y`` (20 tokens: 6 blocks) cannot allocate: 5 < 6 (None, nothing changed). ``z`` (4
      tokens: 1 page + 1 state) takes 11 and 12: 3 free.
    * The plan lands (``transfers_done``): 7..10 go back unhashed to the head: 3 + 4 = 7 free.
      Now ``y`` allocates its 6 blocks, the 4 former destinations first.
    """
    coord = unified()
    dev = AsyncDevice(coord, lag)
    h = HostHarness.over(coord)
    h.run("a", A, 0.0)
    dev.check()
    assert dev.gpu_free() == (15 - 4,)
    plan = dev.step()
    assert plan.fence == 1 and sorted((t.kind.value, t.src_block) for t in plan.stores) == [
        ("page", 1), ("page", 2), ("page", 3), ("state", 4)]
    assert dev.gpu_free() == (11,)  # drained, not landed: still held
    while dev.inflight:
        dev.step()
    assert dev.gpu_free() == (15,)
    dev.call(coord.block_pool.evict_blocks, list(range(1, 16)))

    x = Request("x", list(range(100, 120)), max_tokens=1)
    assert dev.call(coord.allocate, x, 20, num_draft_tokens=0, now=1.0) is not None
    assert sorted(coord.get_block_ids("x")[0] + coord.get_block_ids("x")[1]) == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert dev.gpu_free() == (9,)

    a2 = Request("a2", A + [7, 7, 7], max_tokens=1)
    hit = dev.call(coord.get_computed_blocks_tiered, a2, now=2.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (0, 12)
    assert [(t.kind, t.dst_block) for t in hit.load.transfers] == [(PAGE, 7), (PAGE, 8), (PAGE, 9), (STATE, 10)]
    assert dev.gpu_free() == (5,)
    plan = dev.step()
    assert plan.fence == 2 and plan.loads == (hit.load,)
    dev.abort("a2")
    assert not coord.load_pending("a2")
    assert dev.gpu_free() == (5,)  # the destinations stay held by fence 2
    assert coord.reset_prefix_cache() is False  # (x runs too, but the fence alone would refuse it)

    y = Request("y", list(range(200, 220)), max_tokens=1)
    before = full_snapshot(coord)
    assert dev.call(coord.allocate, y, 20, num_draft_tokens=0, now=3.0) is None
    assert full_snapshot(coord) == before
    z = Request("z", list(range(300, 304)), max_tokens=1)
    assert dev.call(coord.allocate, z, 4, num_draft_tokens=0, now=3.0) is not None
    assert coord.get_block_ids("z") == ([11], [12])
    assert dev.gpu_free() == (3,)

    while dev.inflight:
        dev.step()
    assert dev.gpu_free() == (7,)
    assert dev.call(coord.allocate, y, 20, num_draft_tokens=0, now=4.0) is not None
    got = set(coord.get_block_ids("y")[0] + coord.get_block_ids("y")[1]) - {0}
    assert len(got) == 6 and {7, 8, 9, 10} <= got
    assert dev.gpu_free() == (1,)
    for rid in ("x", "y", "z"):
        dev.free(rid, now=5.0)
    dev.settle()
    h.nothing_held()
    assert coord.reset_prefix_cache() is True


def test_abort_before_drain_releases_at_once():
    """The same start as above, but ``a2``'s load is aborted before any plan carried it: no copy
    can be running, so its 4 destinations are free at once (5 + 4 = 9) and no plan hands the
    load out."""
    coord = unified()
    dev = AsyncDevice(coord, 1)
    HostHarness.over(coord).run("a", A, 0.0)
    dev.settle()
    dev.call(coord.block_pool.evict_blocks, list(range(1, 16)))
    x = Request("x", list(range(100, 120)), max_tokens=1)
    assert dev.call(coord.allocate, x, 20, num_draft_tokens=0, now=1.0) is not None
    hit = dev.call(coord.get_computed_blocks_tiered, Request("a2", A + [7, 7, 7], max_tokens=1), now=2.0)
    assert hit.num_host_tokens == 12 and dev.gpu_free() == (5,)
    dev.abort("a2")
    assert dev.gpu_free() == (9,)
    assert not dev.step()  # nothing to run
    dev.free("x", now=3.0)
    dev.settle()
    assert coord.reset_prefix_cache() is True


def test_free_and_preempt_all_of_a_drained_load_hold_its_destinations():
    """``free`` and ``preempt_all`` abort a load like ``abort_load``: after its plan was drained
    the destinations stay held (and ``reset_prefix_cache`` refuses) until the fence lands.
    Decoupled harness: after A..E (B's unit evicted from the GPU, every plan landed) B2 loads
    pages 3, 4 and the state at page 4 (2 pages + 1 slot) and holds A's 3 cached pages."""
    for end in ("free", "preempt_all"):
        h = HostHarness()
        c = h.coord
        h.evict_b()
        dev = AsyncDevice(c, 1)
        hit = dev.call(c.get_computed_blocks_tiered, Request("B2", B2, max_tokens=1), now=50.0)
        assert hit.num_host_tokens == 8
        dsts = {(t.kind, t.dst_block) for t in hit.load.transfers}
        assert len(dsts) == 3
        plan = dev.step()
        assert plan.loads == (hit.load,)
        if end == "free":
            dev.free("B2", now=51.0)
        else:
            assert dev.call(c.preempt_all) == ["B2"]
            dev.load_fence.pop("B2")
        assert not c.load_pending("B2")
        # A's 3 pages (the hit the load touched) are back; the 2 destination pages and the slot not
        assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (2, 1)
        assert c.reset_prefix_cache() is False
        dev.settle()
        h.nothing_held()
        assert c.reset_prefix_cache() is True


# ---------------------------------------------------------------------------- (b) a pending store
@pytest.mark.parametrize("lag", [1, 2])
def test_freed_request_pages_wait_for_their_store(lag):
    """Unified, 15 usable blocks, the free queue 1..15 in order.

    * ``x`` (20 tokens in one allocate, kept running): pages 1..5, state 6. 9 free: 7..15.
    * ``a`` (13 tokens, the harness's chunks 0..12, 12..13): pages 7, 8, 9 and state 10, then
      page 11 and state 12 (the running state grows to slot 3). Retired past 12 tokens, ``a``
      lets go of its checkpoint state 10 (published: a free cached block, the queue's tail): its
      table is pages 7, 8, 9, 11 and state 12; 4 free: 13, 14, 15, 10.
    * ``a`` is freed: write-through plans the stores of pages 7, 8, 9 and state 10 (its chain up
      to the checkpoint at page 2), which hold them (10 leaves the free queue); 11 and 12
      (unhashed) go free: 5 free (11..15). Without the fence all 9 would be free.
    * ``y`` (20 tokens: 6 blocks) waits: None, nothing changed; it still waits once the step
      drained the plan (fence 1) and before it landed. ``z`` (4 tokens: 2 blocks) takes two of
      11..15, none of ``a``'s: 3 free.
    * The plan lands: ``a``'s 4 blocks go back as cached blocks (the tail): 7 free. ``y`` takes
      its 6: the 3 unhashed blocks left, then 3 of ``a``'s (evicting their hashes).
    """
    coord = unified()
    dev = AsyncDevice(coord, lag)
    h = HostHarness.over(coord)
    x = Request("x", list(range(100, 120)), max_tokens=1)
    assert dev.call(coord.allocate, x, 20, num_draft_tokens=0, now=0.0) is not None
    assert coord.get_block_ids("x") == ([1, 2, 3, 4, 5], [0, 0, 0, 0, 6])
    a, _ = h.prefill("a", A, 1.0)
    assert coord.get_block_ids("a") == ([7, 8, 9, 11], [0, 0, 0, 12])
    assert dev.gpu_free() == (4,)
    dev.free("a", now=2.0)
    assert dev.gpu_free() == (5,)
    sources = {7, 8, 9, 10}

    y = Request("y", list(range(200, 220)), max_tokens=1)
    before = full_snapshot(coord)
    assert dev.call(coord.allocate, y, 20, num_draft_tokens=0, now=3.0) is None
    assert full_snapshot(coord) == before
    plan = dev.step()
    assert plan.fence == 1 and {t.src_block for t in plan.stores} == sources
    assert dev.call(coord.allocate, y, 20, num_draft_tokens=0, now=4.0) is None
    z = Request("z", list(range(300, 304)), max_tokens=1)
    assert dev.call(coord.allocate, z, 4, num_draft_tokens=0, now=4.0) is not None
    z_blocks = set(coord.get_block_ids("z")[0] + coord.get_block_ids("z")[1]) - {0}
    assert len(z_blocks) == 2 and z_blocks <= {11, 12, 13, 14, 15}
    assert dev.gpu_free() == (3,)

    while dev.inflight:
        dev.step()
    assert dev.gpu_free() == (7,)
    assert dev.call(coord.allocate, y, 20, num_draft_tokens=0, now=5.0) is not None
    y_blocks = set(coord.get_block_ids("y")[0] + coord.get_block_ids("y")[1]) - {0}
    assert len(y_blocks) == 6 and len(y_blocks & sources) == 3
    assert dev.gpu_free() == (1,)
    for rid in ("x", "y", "z"):
        dev.free(rid, now=6.0)
    dev.settle()
    h.nothing_held()
    assert coord.reset_prefix_cache() is True


def test_decoupled_freed_pages_wait_for_their_store():
    """Decoupled harness (12 superblocks; superblock 0: the null page + 1 page; the others 2
    pages or 1 slot each).

    * ``x`` (32 tokens in one allocate, kept running): 8 pages (superblock 0's + 4 superblocks,
      one page spare) and 1 slot (1 superblock): 6 superblocks. 6 left.
    * ``a`` (13 tokens, chunks 0..12, 12..13): 4 pages (the spare + 2 superblocks, one spare)
      and 2 slots (2 superblocks): 10 superblocks in use, 2 free + 1 spare page.
    * ``a`` is freed: its 3 cached pages and its checkpoint slot (which left its table when it
      retired past 12 tokens) are held for their stores; its 4th page and its running slot go
      free (that slot's superblock is free again).
    * ``y`` (40 tokens in one allocate: 10 pages, 1 slot). Page room, counted in page positions:
      every superblock that is not a slot holds 2 pages, superblock 0 one. With ``y``'s slot,
      ``x``'s and ``a``'s held one, 12 - 3 = 9 superblocks hold pages: 2 * 8 + 1 = 17 positions
      (superblock 0 among the 9), ``x``'s 8 and ``a``'s 3 held pages taken: 6 < 10, so ``y``
      waits (None, nothing changed), also once the plan is drained and not landed.
    * The plan lands: ``a``'s 3 pages are free cached blocks (evictable) and its slot's
      superblock is free: 12 - 2 = 10 superblocks for pages, 2 * 9 + 1 = 19 positions, 19 - 8
      = 11 >= 10: ``y`` allocates.
    """
    h = HostHarness()
    c = h.coord
    dev = AsyncDevice(c, 1)
    x = Request("x", list(range(400, 432)), max_tokens=1)
    assert dev.call(c.allocate, x, 32, num_draft_tokens=0, now=0.0) is not None
    h.prefill("a", A, 1.0)
    a_blocks = c.get_block_ids("a")
    dev.free("a", now=2.0)
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (8 + 3, 1 + 1)
    y = Request("y", list(range(500, 540)), max_tokens=1)
    before = full_snapshot(c)
    assert dev.call(c.allocate, y, 40, num_draft_tokens=0, now=3.0) is None
    assert full_snapshot(c) == before
    plan = dev.step()
    assert sorted(t.src_block for t in plan.stores if t.kind is PAGE) == sorted(a_blocks[0][:3])
    states = [t.src_block for t in plan.stores if t.kind is STATE]  # the checkpoint, not a's running slot
    assert len(states) == 1 and states[0] not in a_blocks[1]
    assert dev.call(c.allocate, y, 40, num_draft_tokens=0, now=3.0) is None  # drained, not landed
    dev.step()  # lands
    assert not dev.inflight and (in_use(c.block_pool), in_use(c.state_block_pool)) == (8, 1)
    assert dev.call(c.allocate, y, 40, num_draft_tokens=0, now=4.0) is not None
    for rid in ("x", "y"):
        dev.free(rid, now=5.0)
    dev.settle()
    h.nothing_held()
    assert c.reset_prefix_cache() is True


# ---------------------------------------------------------------------------- (c) refusals
def test_transfers_done_refusals():
    """A fence never issued (above the last plan's), a negative one, a str / float / bool / None:
    InvalidFenceError and nothing changed. A fence already passed (0, or one that landed) is a
    no-op. Landing fence 1 of two in flight releases fence 1's holds only."""
    h = HostHarness()
    c = h.coord
    with pytest.raises(InvalidFenceError):
        c.transfers_done(1)  # nothing issued yet
    c.transfers_done(0)  # the empty plan's fence: a no-op
    h.run("A", A, 0.0)
    p1 = c.take_transfer_plan()
    h.run("C", list(range(100, 113)), 1.0)
    p2 = c.take_transfer_plan()
    assert (p1.fence, p2.fence) == (1, 2)
    # each holds its request's 3 pages and checkpoint slot
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (6, 2)
    before = full_snapshot(c)
    for bad in (3, 100, -1, "1", 1.0, True, None):
        with pytest.raises(InvalidFenceError):
            c.transfers_done(bad)  # type: ignore[arg-type]
        assert full_snapshot(c) == before, bad
        c.check_invariants()
    c.transfers_done(0)
    assert full_snapshot(c) == before
    c.transfers_done(1)  # A's store ran: its blocks go back; C's stay held by fence 2
    c.check_invariants()
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (3, 1)
    after1 = full_snapshot(c)
    c.transfers_done(1)  # passed: a no-op
    c.transfers_done(0)
    assert full_snapshot(c) == after1
    assert c.reset_prefix_cache() is False  # fence 2 still holds C's blocks
    c.transfers_done(2)
    c.check_invariants()
    h.nothing_held()
    with pytest.raises(InvalidFenceError):
        c.transfers_done(3)
    assert c.reset_prefix_cache() is True


def test_transfers_done_without_a_host_tier():
    """No host tier: no plan carries a fence; transfers_done(0) is a no-op, any other refused."""
    from tests.eviction.test_units import config

    c = KVCacheCoordinator(config(12), max_model_len=256)
    assert c.take_transfer_plan() is EMPTY_TRANSFER_PLAN
    c.transfers_done(0)
    for bad in (1, -1, "0"):
        with pytest.raises(InvalidFenceError):
            c.transfers_done(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- (d) write-on-evict
def test_write_evict_stores_hold_nothing():
    """write 'evict' (decoupled only). The contract (mambakv/core/transfers.py): a store planned
    at a GPU eviction reads blocks that the evicting step hands to another request at once, so
    the engine must run it before that step writes GPU memory (first on the step's stream, or
    wait for it); the fence holds nothing for it.

    A..D run (nothing stored at free with write 'evict'), then E: its allocation evicts B's unit
    (pages 3, 4 and the state at page 4), stored with B's whole chain: pages 0..4 + the state,
    5 * 128 + 176 = 816 B. E's table holds some of those very sources; E freed, the GPU holds
    nothing although the plan is drained and not landed, and the prefix cache can be reset. A
    load aborted after its plan was drained is still fenced, in this mode too."""
    h = HostHarness(write="evict")
    c = h.coord
    dev = AsyncDevice(c, 2)
    h.abcd()
    dev.check()
    e, _ = h.prefill("E", list(range(300, 313)), 40.0)
    assert c.units.stats.evictions == 1
    plan = dev.step()
    assert plan.bytes_d2h == 816 and plan.fence == 1
    e_pages = set(c.get_block_ids("E")[0]) - {0}
    e_slots = set(c.get_block_ids("E")[1]) - {0}
    sources = {(t.kind, t.src_block) for t in plan.stores}
    # E took blocks B's unit had (the stores read them: they must have run before E's forward)
    assert sources & ({(PAGE, b) for b in e_pages} | {(STATE, b) for b in e_slots})
    dev.free("E", now=41.0)
    h.nothing_held()  # fence 1 is in flight, and holds nothing
    assert c.reset_prefix_cache() is True
    dev.settle()
    h.nothing_held()


def test_write_evict_aborted_load_is_fenced():
    """write 'evict': after A..E, B2's load (2 pages + 1 slot) is drained, then aborted: the
    destinations stay held until the plan lands, as with write-through."""
    h = HostHarness(write="evict")
    c = h.coord
    h.evict_b()
    dev = AsyncDevice(c, 1)
    hit = dev.call(c.get_computed_blocks_tiered, Request("B2", B2, max_tokens=1), now=50.0)
    assert hit.num_host_tokens == 8
    plan = dev.step()
    assert plan.loads == (hit.load,)
    dev.abort("B2")
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (2, 1)
    dev.settle()
    h.nothing_held()
    assert c.reset_prefix_cache() is True


# ---------------------------------------------------------------------------- library defects found
def test_store_sources_cut_off_from_their_chain_while_fenced():
    """Decoupled harness. Found by the workload above (decoupled, seed 0, lag 1).

    * A (13 tokens) runs, is freed, its stores land: the GPU and the host hold A's unit (pages
      0..2, the state at page 2).
    * B = A + 10 (23 tokens) hits A's 12 tokens and is freed: write-through stores only what the
      host lacks, pages 3, 4 and the state at page 4; the fence holds those 3 blocks. A's pages
      and state are free cached blocks.
    * X (52 tokens in one allocate: 13 pages + 1 slot) needs more than the 7 free superblocks
      (A's and B's chain keep 5), and no unit is evictable (A's has B's below it, B's state is
      held): the arena takes a free cached page of A's chain, which cuts the chain below it
      (a cascade, no unit eviction): B's nodes and unit leave the tree, but the held pages 3, 4
      and the state keep their hashes (only free copies are dropped).
    * The plan lands: ``transfers_done`` must leave the GPU units consistent (drop what the
      tree lost, as a request's ``free`` and ``HostTier.unpin`` do). It returns B's blocks as
      free cached blocks outside the tree: ``check_invariants`` fails ("a free cached page
      outside the tree").
    """
    h = HostHarness()
    c = h.coord
    h.run("A", A, 0.0)
    h.drain()
    h.run("B", list(A) + list(range(50, 60)), 1.0)
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (2, 1)
    x = Request("X", list(range(500, 552)), max_tokens=1)
    ev, cas = c.units.stats.evictions, c.units.stats.cascades
    assert c.allocate(x, 52, num_draft_tokens=0, now=2.0) is not None
    assert (c.units.stats.evictions - ev, c.units.stats.cascades - cas) == (0, 1)
    c.check_invariants()
    plan = c.take_transfer_plan()
    assert plan.bytes_d2h == 2 * 128 + 176
    c.check_invariants()
    c.transfers_done(plan.fence)
    c.check_invariants()  # fails: the fence released B's pages outside the tree
    c.free("X", now=3.0)
    h.drain()
    h.nothing_held()


@pytest.mark.parametrize("page", [0, 1, 2])
def test_store_source_lost_while_fenced(page):
    """Decoupled harness: A is freed, its stores (pages 0..2, the state at 2) are drained, not
    landed; the GPU loses one of those pages (``evict_blocks``: its data is gone; a held block
    only loses its hash). The unit index drops A's unit and the pages below, but the held copies
    of the others keep their hashes; ``transfers_done`` then returns them as free cached blocks
    outside the tree (or past the chain's deepest checkpoint): ``check_invariants`` fails. The
    same loss with A's blocks in a table (a running request) is cleaned up at its ``free``."""
    h = HostHarness()
    c = h.coord
    h.run("A", A, 0.0)
    plan = c.take_transfer_plan()
    sources = [t.src_block for t in plan.stores if t.kind is PAGE]
    assert len(sources) == 3
    c.block_pool.evict_blocks([sources[page]])
    c.check_invariants()
    c.transfers_done(plan.fence)
    c.check_invariants()  # fails
    h.nothing_held()


def test_a_block_two_pending_stores_read_is_released_once_per_hold():
    """Decoupled harness, 4 host superblocks (as tests/host/test_host_tier.py::
    test_host_evicts_units_to_make_room).

    * A is freed: its stores (3 pages + the state at page 2, the host's superblock 0 page + 1
      page superblock + 1 slot superblock: 3 of 4) hold A's 3 GPU pages and its state.
    * C is freed: its store makes the host evict A's unit (its stores are dropped as stale,
      their GPU sources stay held until the plan lands).
    * A2 (A's tokens) hits A's 12 tokens on the GPU and is freed: the host lacks A's chain
      again, so A2's store (which makes the host evict C's unit: C's stores are dropped too)
      reads the same 3 GPU pages and state, which are now held twice (ref counts 2): in use,
      A's 3 pages and C's 3, A's state and C's.
    * The plan (A2's stores only) lands: each hold must be released once. ``transfers_done``
      passes the held list, duplicates included, to one ``free_blocks`` call, which refuses it
      (DoubleFreeError), after the fence's entry was popped: the blocks leak.
    """
    h = HostHarness(host_superblocks=4)
    c = h.coord
    h.run("A", A, 0.0)
    h.run("C", list(range(100, 113)), 1.0)
    assert c.host.units.stats.evictions == 1
    assert h.run("A2", A, 2.0) == 12
    assert c.host.units.stats.evictions == 2
    assert (in_use(c.block_pool), in_use(c.state_block_pool)) == (6, 2)
    plan = c.take_transfer_plan()
    assert sorted((t.kind.value, t.num_bytes) for t in plan.stores) == [("page", 128)] * 3 + [("state", 176)]
    pool = {PAGE: c.block_pool, STATE: c.state_block_pool}
    assert {pool[t.kind].blocks[t.src_block].ref_cnt for t in plan.stores} == {2}
    c.transfers_done(plan.fence)  # fails: DoubleFreeError
    c.check_invariants()
    h.nothing_held()
