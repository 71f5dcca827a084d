"""The fuzzer's engine: drives a KVCacheCoordinator like an inference engine and checks it.

``FuzzEngine`` holds the coordinator of one drawn config, the shadow requests, the simulated
device and the record of publications, and offers the engine's actions (each checks what it
can on the spot): ``add_request``, ``lookup`` (get_computed_blocks), ``admit`` (first
allocate, with the hit), ``abort`` (between lookup and allocate), ``schedule`` (a prefill
chunk, or a decode step with drafts), ``execute`` (one device step: copy / zero plans, forwards,
``accept_drafts``, output tokens), ``settle`` (retire to an older step's processed count: the
async lag), ``finish`` / ``preempt`` (free), ``reset_prefix_cache``, ``evict`` and ``drain``.
``check()`` runs every invariant of fuzz_checks plus the library's own. The hypothesis state
machine (fuzz_machine.py) only picks actions and their arguments.

Timeline of one request step (``max_lag`` executed steps may stay unretired, 0 = sync)::

    schedule -> allocate ........ execute -> plans, forward, accept_drafts ..... settle -> retire
               (tables, publish      (Device tags; output tokens appended)        (publish Mamba
                attention blocks)                                                  states, retire)
"""

from __future__ import annotations

import math
from collections import Counter

from mambakv import Request, StaleCacheHitError
from tests.property.fuzz_checks import (
    check_eviction_order,
    check_hit,
    check_pool,
    check_requests,
    check_unchanged,
    hit_still_valid,
    in_use,
    live_requests,
    snapshot,
)
from tests.property.fuzz_model import (
    ALPHABET,
    EMPTY,
    GARBAGE,
    MAX_MODEL_LEN,
    REQUEST_IDS,
    Device,
    FuzzConfig,
    ShadowReq,
    Step,
    cdiv,
    expected_mamba_table,
)

#: what the fuzzer exercised (examples, rules, steps, hits, failures...), for the report
STATS: Counter = Counter()

#: retention hints the fuzzer's requests carry (a ttl of 45 s expires under the clock it drives)
RETAIN_HINTS = (None, "low", "normal", "high", 45.0)


class FuzzEngine:
    def __init__(self, cfg: FuzzConfig) -> None:
        self.cfg = cfg
        self.coord = cfg.build()
        self.clock = 0.0
        self._unit_seen = (0, 0, 0)
        self.device = Device(cfg.mamba_gids)
        self.align = math.lcm(*cfg.block_sizes)
        self.reqs: dict[str, ShadowReq] = {}
        self.batch: list[str] = []  # requests scheduled for the next execute, in order
        #: (pool index in coord.pools, block id) -> (group, hash, token prefix)
        self.published: dict[tuple[int, int], tuple] = {}
        self.pools = self.coord.pools  # (block_pool,) unified; (pages, slots) decoupled
        self._conversions = 0
        self.history: list[tuple[int, ...]] = list(cfg.bases)  # token sequences prompts are cut from
        self.starved = False  # the last allocate failed: the engine would preempt
        STATS["examples"] += 1

    # ------------------------------------------------------------------ helpers
    def pick(self, i: int, pred) -> ShadowReq:
        cands = [sr for rid, sr in sorted(self.reqs.items()) if pred(sr)]
        return cands[i % len(cands)]

    def any(self, pred) -> bool:
        return any(pred(sr) for sr in self.reqs.values())

    def _refs(self, pool) -> list[int]:
        return [b.ref_cnt for b in pool.blocks]

    def _hashes(self) -> list[list]:
        """Per pool, per block: (hash, group)."""
        return [[(b.block_hash, b.cache_group_id) for b in pool.blocks] for pool in self.pools]

    def _new_hashes(self, hashes_before: list[list]):
        """The blocks (any pool) whose (hash, group) changed to a hash since `hashes_before`."""
        for pool, before in zip(self.pools, hashes_before):
            for b in pool.blocks:
                if b.block_hash is not None and (b.block_hash, b.cache_group_id) != before[b.block_id]:
                    yield b

    def _prefix(self, sr: ShadowReq, end: int) -> tuple[int, ...]:
        return tuple(sr.tokens[:end])

    def _publish(self, bid: int, gid: int, prefix: tuple) -> None:
        pi = self.cfg.pool_index(gid)
        self.published[(pi, bid)] = (gid, self.pools[pi].blocks[bid].block_hash, prefix)

    def can_schedule(self, sr: ShadowReq) -> bool:
        return (sr.running and sr.scheduled is None and len(sr.unsettled) <= self.cfg.max_lag
                and not self.done(sr))

    @staticmethod
    def done(sr: ShadowReq) -> bool:
        req = sr.request
        return req.num_output_tokens >= req.max_tokens or req.num_tokens >= MAX_MODEL_LEN - 2

    def pressure(self) -> bool:
        """Fewer free blocks than a new request needs, plus 2: when an engine preempts."""
        need = sum(1 + self.cfg.nspec if k == "mamba" else 1 for k in self.cfg.kinds)
        return self.starved or sum(p.get_num_free_blocks() for p in self.pools) < need + 2

    def _chunk(self, computed: int, num_tokens: int, how: int, frac: int) -> int:
        """Prefill chunk: everything, up to the last LCM-aligned end, or any length."""
        remaining = num_tokens - computed
        if how % 3 == 0:
            return remaining
        if how % 3 == 1:
            end = num_tokens // self.align * self.align
            return end - computed if end > computed else remaining
        return frac % remaining + 1

    def _hit_ok(self, sr: ShadowReq, hit, n: int) -> bool:
        return hit_still_valid(self.cfg, self.pools, self.published, sr.tokens, hit, n)

    # ------------------------------------------------------------------ admission
    def add_request(self, src: int, cut: int, tail: list[int], max_tokens: int) -> None:
        """A prompt cut from a base sequence or an earlier request's tokens, plus a short tail."""
        rid = next(r for r in REQUEST_IDS if r not in self.reqs)
        source = self.history[src % len(self.history)]
        tokens = (list(source[: cut]) + tail)[: MAX_MODEL_LEN - 4] or [ALPHABET[0]]
        retain = RETAIN_HINTS[(cut + max_tokens + len(tail)) % len(RETAIN_HINTS)]
        self.reqs[rid] = ShadowReq(rid, Request(rid, tokens, max_tokens=max_tokens, retain=retain), len(self.cfg.kinds))

    def now(self) -> float:
        """The engine clock passed as ``now``: it moves 0-39 s per call (unit ages, ttl hints)."""
        self.clock += (len(self.reqs) * 7 + int(self.clock)) % 40
        return self.clock

    def lookup(self, sr: ShadowReq) -> None:
        """get_computed_blocks: brute-force length, shape, prefixes and states of the hit."""
        before = snapshot(self.coord)
        hit, n = self.coord.get_computed_blocks(sr.request)
        check_unchanged(before, self.coord, "get_computed_blocks")
        check_hit(self.cfg, self.pools, self.published, self.device, sr.tokens, hit, n)
        sr.pending_hit = (hit, n)
        STATS["hits"] += n > 0
        STATS["mamba hits"] += n > 0 and bool(self.cfg.mamba_gids)

    def admit(self, sr: ShadowReq, how: int, frac: int) -> bool:
        """First allocate of a waiting request, with its looked-up hit if any."""
        hit, n = sr.pending_hit or (None, 0)
        chunk = self._chunk(n, sr.request.num_tokens, how, frac)
        before, hashes = snapshot(self.coord), self._hashes()
        try:
            new = self.coord.allocate(sr.request, chunk, num_new_computed_tokens=n, new_computed_blocks=hit,
                                      now=self.now())
        except StaleCacheHitError:
            check_unchanged(before, self.coord, "a refused stale hit")
            assert not self._hit_ok(sr, hit, n), "STALE: allocate refused a hit that is still valid"
            sr.pending_hit = None
            STATS["stale hits refused"] += 1
            return False
        if new is None:
            STATS["failed allocates"] += 1
            self.starved = True
            check_unchanged(before, self.coord, "a failed allocate")
            return False
        assert self._hit_ok(sr, hit, n), "STALE: allocate accepted a hit block that was reused"
        sr.running, sr.pending_hit = True, None
        STATS["admitted"] += 1
        for g in range(len(self.cfg.kinds)):
            hit_ids = [b.block_id for b in hit.blocks[g]] if n else []
            self._grow(sr, g, hit_ids, -1, n + chunk, 0, [b.block_id for b in new.blocks[g]])
        sr.request.num_computed_tokens = n + chunk
        sr.scheduled = Step(n, chunk)
        self.batch.append(sr.rid)
        self._record_attention(sr, hashes, n + chunk)
        return True

    def _grow(self, sr: ShadowReq, g: int, table: list[int], old_running: int, num_tokens: int,
              lookahead: int, new_ids: list[int]) -> None:
        """Apply one allocation to the shadow table of group g (DESIGN.md 5 / 5.1)."""
        bs = self.cfg.block_sizes[g]
        if self.cfg.kinds[g] == "mamba":
            want_new = (1 + self.cfg.nspec) if old_running < 0 else None
            table, running, grew = expected_mamba_table(table, old_running, num_tokens, bs, self.cfg.nspec, new_ids)
            expect = want_new if want_new is not None else (1 if grew else 0)
            assert len(new_ids) == expect, f"SHADOW TABLE: group {g} got {len(new_ids)} new blocks, expected {expect}"
            sr.running_slot[g] = running
        else:
            need = max(0, cdiv(num_tokens + lookahead, bs) - len(table))
            assert len(new_ids) == need, f"SHADOW TABLE: group {g} got {len(new_ids)} new blocks, expected {need}"
            table = table + new_ids
        sr.tables[g] = table

    def _record_attention(self, sr: ShadowReq, hashes_before: list, num_tokens: int) -> None:
        """Attention blocks are published at allocation, only when full of real tokens."""
        real = min(num_tokens, sr.request.num_tokens)
        for b in self._new_hashes(hashes_before):
            g = b.cache_group_id
            assert self.cfg.kinds[g] != "mamba", f"PUBLISH: Mamba block {b.block_id} published at allocate"
            slot = sr.tables[g].index(b.block_id)
            end = (slot + 1) * self.cfg.block_sizes[g]
            assert end <= real, f"PUBLISH: attention block at slot {slot} published with {real} real tokens"
            self._publish(b.block_id, g, self._prefix(sr, end))

    def abort(self, sr: ShadowReq) -> None:
        """Abort between lookup and allocate: free / retire of a request holding nothing are no-ops."""
        before = snapshot(self.coord)
        self.coord.retire(sr.rid, 1)
        self.coord.free(sr.rid, now=self.now())
        check_unchanged(before, self.coord, "free of a request holding no blocks")
        del self.reqs[sr.rid]

    # ------------------------------------------------------------------ steps
    def schedule(self, sr: ShadowReq, how: int, frac: int, k: int, a: int, drafts: tuple, bonus: int,
                 lookahead: int) -> bool:
        """A prefill chunk, or a decode step with up to k drafts of which a are accepted."""
        c, num_tokens = sr.request.num_computed_tokens, sr.request.num_tokens
        if num_tokens - c > 1:
            step = Step(c, self._chunk(c, num_tokens, how, frac), bonus=bonus)
            lookahead = 0
        else:  # decode: the last token plus k drafts, of which a will be accepted
            k = min(k, self.cfg.max_drafts, MAX_MODEL_LEN - num_tokens - 2)
            step = Step(c, 1, tuple(drafts)[:k], a % (k + 1), bonus)
            lookahead = min(lookahead, k)
        new_tokens = step.real + len(step.drafts)
        before, hashes = snapshot(self.coord), self._hashes()
        new = self.coord.allocate(sr.request, new_tokens, num_lookahead_tokens=lookahead, now=self.now())
        if new is None:
            STATS["failed allocates"] += 1
            self.starved = True
            check_unchanged(before, self.coord, "a failed allocate")
            return False
        for g in range(len(self.cfg.kinds)):
            self._grow(sr, g, sr.tables[g], sr.running_slot.get(g, -1), c + new_tokens, lookahead,
                       [b.block_id for b in new.blocks[g]])
        sr.request.num_computed_tokens = c + new_tokens  # optimistic, fixed after the verify
        sr.scheduled = step
        self.batch.append(sr.rid)
        self._record_attention(sr, hashes, c + new_tokens)
        return True

    def execute(self) -> None:
        """One engine step on the device: batched copies, zeros, forwards, verifies."""
        self.coord.new_step()
        copies, zeros = self.coord.take_copy_plan(), self.coord.take_zero_plan()
        batch = [self.reqs[rid] for rid in self.batch]
        for g in self.cfg.mamba_gids:
            running = {sr.tables[g][sr.running_slot[g]] for sr in batch}
            pairs, zs = copies.get(g, []), zeros.get(g, [])
            assert all(d in running for _, d in pairs) and set(zs) <= running, (
                f"STALE PLAN: group {g} copies {pairs} / zeros {zs} outside the batch's running blocks {running}")
            assert not {d for _, d in pairs} & set(zs), f"COPY PLAN: group {g} copies into a zeroed block"
            self.device.copy(g, pairs)
            for z in zs:
                self.device.tags[g][z] = EMPTY
        for sr in batch:
            self._forward(sr, sr.scheduled)
        self.batch = []

    def _forward(self, sr: ShadowReq, step: Step) -> None:
        tokens, check = sr.tokens, self.cfg.content_checked
        pos = step.computed + step.real
        for g in self.cfg.mamba_gids:
            tags, table, rs = self.device.tags[g], sr.tables[g], sr.running_slot[g]
            start = self.device.tag(g, table[rs])
            ok = start == (tuple(tokens[: step.computed]), step.computed)
            assert ok or not check, f"STATE ORACLE: {sr.rid} group {g} step from {step.computed} starts at {start[1:]}"
            prefix = tuple(tokens[:pos])
            tags[table[rs]] = (prefix, pos) if ok else GARBAGE
            for j in range(len(step.drafts)):
                tags[table[rs + 1 + j]] = (prefix + step.drafts[: j + 1], pos + j + 1) if ok else GARBAGE
        if step.drafts:
            for g, pairs in self.coord.accept_drafts(sr.rid, step.accepted).items():
                self.device.copy(g, pairs)
            if check:
                want = (tuple(tokens[:pos]) + step.drafts[: step.accepted], pos + step.accepted)
                for g in self.cfg.mamba_gids:
                    got = self.device.tag(g, sr.tables[g][sr.running_slot[g]])
                    assert got == want, f"STATE ORACLE: {sr.rid} group {g} after verify holds {got[1:]} not {want[1:]}"
        if pos == sr.request.num_tokens:
            sr.request.append_output_token_ids(list(step.drafts[: step.accepted]) + [step.bonus])
        sr.request.num_computed_tokens = step.settle_point
        sr.unsettled.append(step.settle_point)
        for g in self.cfg.mamba_gids:
            sr.verified.setdefault(g, []).append((step.settle_point, sr.running_slot[g]))
        sr.scheduled = None
        STATS["request steps"] += 1
        STATS["draft steps"] += bool(step.drafts)

    def settle(self, sr: ShadowReq, keep: int, again: bool) -> None:
        """Outputs came back: retire to the processed count of an older step (async lag)."""
        keep = min(keep, len(sr.unsettled) - 1)
        while len(sr.unsettled) > keep:
            p = sr.unsettled.popleft()
        old_tables = [list(t) for t in sr.tables]
        positions = {g: dict(self.coord.managers[g].describe(sr.rid).positions) for g in self.cfg.mamba_gids}
        hashes = self._hashes()
        self.coord.retire(sr.rid, p)
        if again:
            self.coord.retire(sr.rid, p)  # idempotent
        sr.processed = p
        for g, (kind, bs, w) in enumerate(zip(self.cfg.kinds, self.cfg.block_sizes, self.cfg.windows)):
            skipped = {"full": 0, "swa": max(0, p - w + 1), "mamba": max(0, p - 1)}[kind]
            slots = skipped // bs
            states = sr.verified.get(g, [])
            while states and states[0][0] <= p:  # the state at p lives in that step's running slot
                slots = max(slots, states.pop(0)[1])
            slots = sr.retired[g] = max(slots, sr.retired.get(g, 0))
            for s in range(min(slots, len(sr.tables[g]))):
                sr.tables[g][s] = 0
        for b in self._new_hashes(hashes):
            g = b.cache_group_id
            slot = old_tables[g].index(b.block_id)
            end = (slot + 1) * self.cfg.block_sizes[g]
            if g not in positions:  # attention: a block full within the processed real tokens
                real = min(p, sr.request.num_tokens)
                assert end <= real, f"PUBLISH: attention block at slot {slot} published at retire with {real} real"
                self._publish(b.block_id, g, self._prefix(sr, end))
                continue
            assert positions[g].get(slot) == end <= p, (
                f"PUBLISH: state at slot {slot} tagged {positions[g].get(slot)} published with {p} processed")
            if self.cfg.content_checked:
                tag = self.device.tag(g, b.block_id)
                assert tag == (self._prefix(sr, end), end), f"STATE ORACLE: published slot {slot} holds {tag[1:]}"
            self._publish(b.block_id, g, self._prefix(sr, end))
            STATS["mamba publications"] += 1

    # ------------------------------------------------------------------ endings
    def _free(self, sr: ShadowReq) -> None:
        old = [set(t) - {0} for t in sr.tables]
        self.coord.free(sr.rid, now=self.now())
        assert all(m.describe(sr.rid) is None and sr.rid not in m.req_to_blocks for m in self.coord.managers), (
            f"BOOKKEEPING: {sr.rid} kept by a manager after free")
        assert sr.rid not in live_requests(self.coord), f"BOOKKEEPING: {sr.rid} kept by the coordinator after free"
        for g in self.cfg.mamba_gids:
            m = self.coord.managers[g]
            copies, zeros = m.pending_plan()
            pending = [d for _, d in copies] + list(zeros)
            assert not set(pending) & old[g], f"STALE PLAN: {sr.rid} freed with copies/zeros {pending} pending"
        if sr.rid in self.batch:
            self.batch.remove(sr.rid)  # preempted before its step ran
        if any(in_use(p) for p in self.pools):
            before = snapshot(self.coord)
            assert not self.coord.reset_prefix_cache(), "RESET: succeeded while blocks are in use"
            check_unchanged(before, self.coord, "a refused reset_prefix_cache")
        self.history.append(tuple(sr.tokens))
        del self.history[2:-8]
        sr.running, sr.scheduled = False, None  # this object is dead; a re-queue makes a new one

    def finish(self, sr: ShadowReq) -> None:
        self._free(sr)
        del self.reqs[sr.rid]

    def preempt(self, sr: ShadowReq) -> None:
        """Under block pressure: free, then re-queue from scratch as a fresh Request with the
        same id and tokens (its step in flight, if any, is dropped)."""
        self._free(sr)
        self.starved = False
        STATS["preemptions"] += 1
        if self.done(sr):  # nothing left to generate (and no room to): it ends here
            del self.reqs[sr.rid]
            return
        left = max(1, sr.request.max_tokens - sr.request.num_output_tokens)
        self.reqs[sr.rid] = ShadowReq(sr.rid, Request(sr.rid, sr.tokens, max_tokens=left), len(self.cfg.kinds))

    # ------------------------------------------------------------------ cache maintenance
    def hashed(self) -> bool:
        return any(b.block_hash is not None for p in self.pools for b in p.blocks)

    def reset_prefix_cache(self) -> None:
        """With nothing running it must succeed (the refusal is checked after every free)."""
        assert self.coord.reset_prefix_cache(), "RESET: refused with no block in use"
        for p in self.pools:
            assert all(b.block_hash is None for b in p.blocks), "RESET: a hash survived"
            assert not p.cached_block_hash_to_block or not any(
                p.cached_block_hash_to_block.values()), "RESET: the map survived"

    def evict(self, ids: list[int]) -> None:
        """``evict_blocks`` of a few block ids, held, free or null: hashes go, held blocks stay in
        their tables, free ones move to the queue head (reused before cached blocks). Decoupled:
        in the pool the first id picks (its parity), withdrawn ids included (nothing happens)."""
        pool = self.pools[ids[0] % len(self.pools)]
        ids = [i % pool.num_blocks for i in ids]
        refs, queue = self._refs(pool), [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        for i in dict.fromkeys(ids):  # a free block that loses its hash moves to the head
            if pool.blocks[i].block_hash is not None and refs[i] == 0:
                queue.remove(i)
                queue.insert(0, i)
        pool.evict_blocks(ids)
        assert all(pool.blocks[i].block_hash is None for i in ids), "EVICT: a hash survived"
        assert self._refs(pool) == refs, "EVICT: ref counts changed"
        if self.coord.units is None:
            assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == queue, "EVICT: queue order"
        else:  # the unit index followed up: what the loss made unreachable moved to the head too
            free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
            assert sorted(free) == sorted(queue), "EVICT: the free set changed"  # order: check_invariants

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Every check of fuzz_checks plus the library's own, after every rule."""
        STATS["rules"] += 1
        check_requests(self.coord, self.cfg, self.reqs)  # first: its LEAK / BOUND name the request
        check_pool(self.coord, self.cfg, self.reqs, self.published)
        check_eviction_order(self.coord)
        self.coord.check_invariants()
        if self.coord.arena is not None:
            n = self.coord.arena.num_conversions
            STATS["arena conversions"] += n - self._conversions
            self._conversions = n
        units = self.coord.units
        if units is not None:
            st = units.stats
            seen = st.evictions, st.cascades, st.reuses + st.ghost_hits
            STATS["unit evictions"] += seen[0] - self._unit_seen[0]
            STATS["unit cascades"] += seen[1] - self._unit_seen[1]
            STATS["unit reuses"] += seen[2] - self._unit_seen[2]
            self._unit_seen = seen

    def drain(self) -> None:
        """Every request ends: then every block is free (checked by check_requests too)."""
        for sr in list(self.reqs.values()):
            if sr.running:
                self._free(sr)
            del self.reqs[sr.rid]
        assert not any(in_use(p) for p in self.pools), "LEAK: blocks held after every request ended"
