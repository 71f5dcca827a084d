"""Adversarial lockstep tests of the two ways an engine retires a step: ``allocate(...,
num_processed_tokens=n)`` (side 0, one call) against ``retire(request_id, n)`` then ``allocate``
(side 1), plus hand-counted prefill-chunk cases.

Two coordinators are built from the same config. One random engine drives both *in
lockstep*: every call is made on both, and its result (or the error it raised), the pool /
queue / prefix map / tables snapshot, every ``describe()``, the prefix-cache stats, the
eviction count and (with events) the KV events must be equal after each call. Unlike
tests/test_prefill_chunks.py the engine also preempts and re-admits requests (hits on their own
prefix, the same hashes published twice), calls ``evict_blocks`` / ``reset_prefix_cache`` /
``preempt_all``, runs the pool dry, caps lookahead at ``max_model_len``, and retires with
invalid counts through ``retire`` and ``allocate(num_processed_tokens=)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mambakv import KVCacheCoordinator, MambaKVError, Request
from tests.coord_helpers import coordinator, fa_spec, snapshot, sw_spec
from tests.helpers import mamba_spec

BASES = [list(range(1000 + 131 * k, 1000 + 131 * k + 700)) for k in range(3)]


def _configs() -> dict[str, tuple[int, tuple, dict]]:
    """name -> (num_blocks, specs, coordinator kwargs)."""
    m = mamba_spec
    return {
        # hash blocks smaller than every block size: the BlockHashView key path
        "hbs8-hybrid": (110, (fa_spec(16), m(16, 2), m(16, 2)), {"hash_block_size": 8}),
        "hbs4-sliding": (160, (fa_spec(16), sw_spec(16, 20), m(16, 1)), {"hash_block_size": 4}),
        # two Mamba policies with different specs (nspec 2 and 0), plus attention
        "two-mamba-specs": (120, (fa_spec(16), m(16, 2), m(16, 0), m(16, 2)), {}),
        # Mamba block 32, attention 16: alignment 32, the attention table grows twice as fast
        "mamba32-fa16": (120, (fa_spec(16), m(32, 1), m(32, 1)), {}),
        # identical Mamba groups not adjacent: the policy's columns are out of group order
        "interleaved": (120, (m(16, 1), fa_spec(16), m(16, 1), sw_spec(16, 40)), {}),
        "nspec0": (70, (fa_spec(8), m(8, 0), m(8, 0)), {}),
        "sliding-only": (60, (sw_spec(8, 12), sw_spec(8, 30)), {}),
        "attention-only": (70, (fa_spec(8), fa_spec(8)), {}),
        "attention-hbs4": (70, (fa_spec(16),), {"hash_block_size": 4}),
        "mamba-only-two": (40, (m(8, 3), m(8, 1)), {}),
        "mamba-only": (30, (m(8, 2),), {}),
        "no-caching": (110, (fa_spec(16), m(16, 2), sw_spec(16, 24)), {"enable_caching": False}),
        "events": (110, (fa_spec(16), sw_spec(16, 24), m(16, 2), m(16, 2)), {"enable_kv_cache_events": True}),
        "events-hbs8": (110, (fa_spec(16), m(16, 1)), {"enable_kv_cache_events": True, "hash_block_size": 8}),
        "eagle": (110, (fa_spec(16), m(16, 2)), {"use_eagle": True}),
        "latest": (110, (fa_spec(16), m(16, 2, decode_checkpoints="latest"), m(16, 1, decode_checkpoints="latest")),
                   {}),
        "none-checkpoints": (110, (fa_spec(16), m(16, 2, decode_checkpoints="none")), {}),
        "mode-none": (80, (fa_spec(16), m(16, 2, mode="none"), m(16, 1)), {}),
        "mamba16-mamba32": (130, (fa_spec(16), m(16, 1), m(32, 2)), {"hash_block_size": 8}),
        "mamba8-fa16": (120, (fa_spec(16), m(8, 2), sw_spec(16, 9)), {"hash_block_size": 4}),
        "fa8-fa16": (120, (fa_spec(8), fa_spec(16), m(16, 1)), {}),
        "window1-nspec5": (140, (sw_spec(8, 1), fa_spec(8), m(8, 5)), {}),
        "events-no-caching": (110, (fa_spec(16), m(16, 2)), {"enable_kv_cache_events": True, "enable_caching": False}),
        "eagle-hbs8-events": (110, (fa_spec(16), sw_spec(16, 33), m(16, 1)),
                              {"use_eagle": True, "hash_block_size": 8, "enable_kv_cache_events": True}),
        # a tiny pool: allocations come back None and popped blocks carry hashes (evictions)
        "pressure": (34, (fa_spec(8), m(8, 1)), {}),
        "pressure-sliding": (30, (fa_spec(8), sw_spec(8, 10), m(8, 0)), {}),
        "pressure-events": (34, (fa_spec(8), m(8, 1), m(8, 1)), {"enable_kv_cache_events": True}),
    }


CONFIGS = _configs()


def build(name: str, *, max_model_len: int = 2048) -> KVCacheCoordinator:
    num_blocks, specs, kw = CONFIGS[name]
    return coordinator(num_blocks, *specs, max_model_len=max_model_len, **kw)


def _ids(res) -> object:
    return None if res is None else res.get_block_ids()


def ordered_map(coord: KVCacheCoordinator) -> dict:
    """The prefix-cache map with each multi-copy entry in its own order (a hit takes the
    first copy; tests.coord_helpers.snapshot sorts them)."""
    return {gid: {h: (e.block_id if not isinstance(e, dict) else tuple(e)) for h, e in m.items()}
            for gid, m in coord.block_pool.cached_block_hash_to_block.items()}


def probes(coord: KVCacheCoordinator) -> list:
    """What a new request on each base prompt would hit now (read-only lookups)."""
    out = []
    for k, base in enumerate(BASES):
        blocks, n = coord.get_computed_blocks(Request(f"probe{k}", base))
        out.append((n, blocks.get_block_ids()))
    return out


def full_state(coord: KVCacheCoordinator) -> tuple:
    rids = sorted(coord.request_ids)
    pool = coord.block_pool
    st = coord.prefix_cache_stats
    stats = (st.requests, st.queries, st.hits, st.preempted_requests, st.preempted_queries, st.preempted_hits)
    return (snapshot(coord, rids), [coord.describe(r) for r in rids], stats, pool.num_evictions,
            [coord.get_state_slot_ids(r) for r in rids], [coord.get_state_plan(r) for r in rids], coord.now,
            ordered_map(coord), probes(coord))


class Lockstep:
    """Two coordinators driven by the same calls; every result and the state after every call
    compared. Requests exist twice (one object per coordinator): ``reqs[rid] = (a, b)``."""

    def __init__(self, make: Callable[[], KVCacheCoordinator], *, events: bool = False) -> None:
        self.a, self.b = make(), make()
        self.events = events
        self.calls = 0
        #: side 1 retires ``num_processed_tokens`` by ``retire`` before ``allocate`` instead
        self.split = True

    def call(self, what: str, fn: Callable[[KVCacheCoordinator, int], object]) -> object:
        """``fn(coord, side)`` on both; returns the (equal) result; errors as ('error', name)."""
        out = []
        for side, c in enumerate((self.a, self.b)):
            try:
                r = fn(c, side)
            except MambaKVError as e:
                r = ("error", type(e).__name__)
            out.append(r)
        self.calls += 1
        assert out[0] == out[1], f"call {self.calls} {what}: result {out[0]!r} != {out[1]!r}"
        sa, sb = full_state(self.a), full_state(self.b)
        if sa != sb:
            for k, (x, y) in enumerate(zip(sa, sb)):
                assert x == y, f"call {self.calls} {what}: state part {k} differs:\n{x!r}\n!=\n{y!r}"
        if self.events:
            ea, eb = self.a.take_events(), self.b.take_events()
            assert ea == eb, f"call {self.calls} {what}: events {ea!r} != {eb!r}"
        self.a.check_invariants()
        self.b.check_invariants()
        return out[0]


def engine(ls: Lockstep, seed: int, steps: int = 150, *, retire_in_allocate: float = 0.3,
           lookahead: tuple[int, ...] = (0, 0, 0, 2, 5, 40), long_jump: bool = True,
           admin: bool = True, rewind: bool = False) -> None:
    """A random engine over `ls`: admissions with hits, re-admissions of preempted requests,
    prefill chunks (block multiples, odd sizes, to the prompt's end, far jumps), decode with
    drafts and verifies, lagged retires (separate or inside allocate), frees, preempt_all,
    evict_blocks, reset_prefix_cache, misuse; with `rewind`, computed counts set back (async
    rejection) to a count at or above the oldest unretired one."""
    rng = random.Random(seed)
    a = ls.a
    bs = a.alignment_tokens
    nspec = min((m.num_speculative_blocks for m in a.mamba_managers), default=3)
    reqs: dict[str, tuple[Request, Request]] = {}
    parked: dict[str, tuple[Request, Request]] = {}  # freed (preempted): may come back
    done: dict[str, list[int]] = {}
    drafted: dict[str, int] = {}
    serial = 0

    def admit(pair: tuple[Request, Request]) -> None:
        ra = pair[0]
        rid = ra.request_id
        left_hint = rng.choice([bs, 2 * bs, 3 * bs, 5 * bs, rng.randrange(1, 4 * bs), 10_000])
        la = rng.choice(lookahead)
        kw_extra = {"num_processed_tokens": 0} if rng.random() < 0.2 else {}

        def go(c: KVCacheCoordinator, side: int):
            req = pair[side]
            blocks, hit = c.get_computed_blocks(req)
            n = min(req.num_tokens - hit, left_hint)
            res = c.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks, num_draft_tokens=0,
                             num_lookahead_tokens=la, **kw_extra)
            if res is not None:
                req.num_computed_tokens = hit + n
            return hit, n, _ids(res)

        r = ls.call(f"admit {rid}", go)
        if isinstance(r, tuple) and r[0] != "error" and r[2] is not None:
            reqs[rid] = pair
            parked.pop(rid, None)
            done[rid] = [pair[0].num_computed_tokens]

    for i in range(steps):
        ls.call("new_step", lambda c, s: c.new_step())
        act = rng.random()
        if act < 0.12 and len(reqs) < 4:
            if parked and rng.random() < 0.5:  # a preempted request comes back (its own prefix hits)
                rid = rng.choice(sorted(parked))
                pair = parked[rid]
            else:
                serial += 1
                base = rng.choice(BASES)
                cut = rng.choice([rng.randrange(1, len(base)), rng.randrange(1, 8) * bs, rng.randrange(1, 8) * bs + 1])
                prompt = base[: min(cut, len(base))] + [rng.randrange(5000, 6000) for _ in range(rng.randrange(3))]
                rid = f"r{serial}"
                pair = (Request(rid, prompt), Request(rid, prompt))
            admit(pair)
        elif act < 0.62 and reqs:
            rid = rng.choice(sorted(reqs))
            pair = reqs[rid]
            ra = pair[0]
            if rid in drafted:
                d = drafted.pop(rid)
                acc = rng.randrange(d + 1)
                toks = [rng.randrange(7000, 8000) for _ in range(acc + 1)]

                def verify(c: KVCacheCoordinator, side: int, rid=rid, d=d, acc=acc, toks=toks, pair=pair):
                    out = c.accept_drafts(rid, acc)
                    req = pair[side]
                    req.num_computed_tokens -= d - acc
                    req.append_output_token_ids(toks)
                    return out

                ls.call(f"accept {rid}", verify)
                done[rid].append(ra.num_computed_tokens)
                continue
            computed = ra.num_computed_tokens
            left = ra.num_prompt_tokens - computed
            la = rng.choice(lookahead)
            kw: dict = {}
            retire_first = None
            if rng.random() < 0.5 and done[rid]:
                counts = done[rid]
                k = rng.randrange(len(counts))
                if rng.random() < retire_in_allocate:
                    kw["num_processed_tokens"] = counts[k]
                else:
                    retire_first = counts[k]
                del counts[:k]
            if retire_first is not None:
                ls.call(f"retire {rid} {retire_first}", lambda c, s, rid=rid, n=retire_first: c.retire(rid, n))
            if left > 0:
                choices = [bs, 2 * bs, 3 * bs, 7 * bs, rng.randrange(1, 3 * bs), left, left - 1 if left > 1 else 1]
                if long_jump:
                    choices.append(rng.randrange(10 * bs, 20 * bs))
                n = max(1, min(left, rng.choice(choices)))
                drafts, tok = 0, None
            else:
                tok = rng.randrange(7000, 8000) if computed >= ra.num_tokens else None
                drafts = rng.randrange(nspec + 1) if rng.random() < 0.5 else 0
                n = 1 + drafts

            def step(c: KVCacheCoordinator, side: int, n=n, drafts=drafts, la=la, kw=kw, tok=tok, pair=pair):
                req = pair[side]
                if tok is not None and req.num_computed_tokens >= req.num_tokens:
                    req.append_output_token_ids([tok])
                if side == 1 and ls.split and "num_processed_tokens" in kw:
                    # allocate's own checks (max_model_len, scratch blocks for the drafts) come
                    # before its retire: a step they refuse retires nothing
                    most = min((m.num_speculative_blocks for m in c.mamba_managers), default=drafts)
                    if req.num_computed_tokens + n <= c.max_model_len and drafts <= most:
                        c.retire(req.request_id, kw["num_processed_tokens"])
                    res = c.allocate(req, n, num_draft_tokens=drafts, num_lookahead_tokens=la)
                else:
                    res = c.allocate(req, n, num_draft_tokens=drafts, num_lookahead_tokens=la, **kw)
                if res is not None:
                    req.num_computed_tokens += n
                return _ids(res)

            r = ls.call(f"step {rid} +{n} d{drafts} la{la} {kw}", step)
            if r is not None and not (isinstance(r, tuple) and r and r[0] == "error"):
                if drafts:
                    drafted[rid] = drafts
                else:
                    done[rid].append(ra.num_computed_tokens)
        elif act < 0.65 and reqs and rewind:  # async rewind: the engine lowers the computed count
            rid = rng.choice(sorted(reqs))
            if rid not in drafted and done[rid]:
                back = rng.choice(done[rid] + [pair_count - rng.randrange(1, 9) for pair_count in done[rid][-1:]])
                back = max(done[rid][0], min(back, reqs[rid][0].num_computed_tokens))
                for req in reqs[rid]:
                    req.num_computed_tokens = back
                done[rid] = [k for k in done[rid] if k <= back] or [back]
        elif act < 0.68 and reqs:  # misuse: both paths refuse it the same way, changing nothing
            rid = rng.choice(sorted(reqs))
            pair = reqs[rid]
            ra = pair[0]
            bad = rng.choice([ra.num_computed_tokens + rng.randrange(1, 40), -1, "3", 2.5, None, 10**9])
            if rng.random() < 0.5:
                ls.call(f"bad retire {rid} {bad!r}", lambda c, s, rid=rid, bad=bad: c.retire(rid, bad))
            elif rid not in drafted:
                left = ra.num_prompt_tokens - ra.num_computed_tokens
                n = max(1, min(left, bs)) if left > 0 else 1

                def bad_alloc(c: KVCacheCoordinator, side: int, n=n, bad=bad, pair=pair, now=float(i)):
                    req = pair[side]
                    res = c.allocate(req, n, num_draft_tokens=0, num_processed_tokens=bad, now=now)
                    if res is not None:  # never reached for a bad count
                        req.num_computed_tokens += n
                    return _ids(res)

                ls.call(f"bad allocate {rid} {bad!r}", bad_alloc)
            else:
                ls.call("too many drafts", lambda c, s, pair=pair: _ids(
                    c.allocate(pair[s], nspec + 3, num_draft_tokens=nspec + 2)))
        elif act < 0.86 and reqs:
            rid = rng.choice(sorted(reqs))
            counts = done[rid]
            if counts:
                k = rng.randrange(len(counts))
                ls.call(f"retire {rid} {counts[k]}", lambda c, s, rid=rid, n=counts[k]: c.retire(rid, n))
                del counts[:k]
        elif act < 0.94 and reqs:
            rid = rng.choice(sorted(reqs))
            pair = reqs.pop(rid)
            drafted.pop(rid, None)
            done.pop(rid, None)

            def free(c: KVCacheCoordinator, side: int, rid=rid, pair=pair):
                c.free(rid)
                pair[side].num_computed_tokens = 0

            ls.call(f"free {rid}", free)
            parked[rid] = pair
        elif admin:
            x = rng.random()
            if x < 0.4:
                ids = [rng.randrange(a.block_pool.num_blocks) for _ in range(rng.randrange(1, 6))]
                ls.call(f"evict {ids}", lambda c, s, ids=ids: c.block_pool.evict_blocks(ids))
            elif x < 0.6:
                ls.call("reset", lambda c, s: c.reset_prefix_cache())
            elif x < 0.75:
                def pre(c: KVCacheCoordinator, side: int):
                    return c.preempt_all()

                got = ls.call("preempt_all", pre)
                for rid in got:  # type: ignore[union-attr]
                    parked[rid] = reqs.pop(rid)
                    drafted.pop(rid, None)
                    done.pop(rid, None)
                ls.call("reset after preempt", lambda c, s: c.reset_prefix_cache())
            else:
                ls.call("take_copy/zero", lambda c, s: (c.take_copy_plan(), c.take_zero_plan()))
        if rng.random() < 0.8:
            ls.call("take_step_plan", lambda c, s: c.take_step_plan())


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_lockstep_engine(name: str) -> None:
    """The full random engine, per config: results, errors and state equal after each call."""
    events = CONFIGS[name][2].get("enable_kv_cache_events", False)
    for seed in range(4):
        ls = Lockstep(lambda: build(name), events=events)
        engine(ls, seed, steps=120, rewind=seed % 2 == 1)


def test_max_model_len_variant_engine() -> None:
    """The engine with a small max_model_len: lookahead capped at the cap, steps refused past it."""
    for name in ("hbs8-hybrid", "interleaved", "pressure", "latest"):
        for seed in range(4):
            ls = Lockstep(lambda name=name: build(name, max_model_len=333))
            engine(ls, seed, steps=120, lookahead=(0, 7, 60, 400))


@pytest.mark.parametrize("name", ["hbs8-hybrid", "two-mamba-specs", "interleaved", "latest", "sliding-only",
                                  "mamba-only-two", "pressure", "events"])
def test_retire_in_allocate_equals_retire_then_allocate(name: str) -> None:
    """Every step retires: side 0 by ``allocate(..., num_processed_tokens=n)``, side 1 by
    ``retire(rid, n)`` then ``allocate``."""
    events = CONFIGS[name][2].get("enable_kv_cache_events", False)
    for seed in range(6):
        ls = Lockstep(lambda: build(name), events=events)
        engine(ls, seed, steps=120, retire_in_allocate=1.0)


# ------------------------------------------------------------------ deterministic cases
def _pair(make: Callable[[], KVCacheCoordinator], **kw) -> Lockstep:
    return Lockstep(make, **kw)


def _step(ls: Lockstep, pair: tuple[Request, Request], n: int, **kw) -> object:
    def go(c: KVCacheCoordinator, side: int):
        req = pair[side]
        res = c.allocate(req, n, num_draft_tokens=0, **kw)
        if res is not None:
            req.num_computed_tokens += n
        return _ids(res)
    return ls.call(f"step +{n} {kw}", go)


def test_chunk_jumps_past_the_scratch_blocks_by_hand() -> None:
    """Block 16, nspec 2. Admission to 32: FA [1 2], Mamba [0 R=3 S=4 S=5]. Chunk to 48
    (running 1 -> 2, no scratch block below it): FA pops 6 first, Mamba 7: [0 3 4 5 7], copy
    3 -> 4. Chunk to 320 (running 19, both scratch blocks below it): FA pops 8..24, Mamba
    25; the gap goes in before the scratch blocks: [0 3 4 0*16 5 7 25], copy 4 -> 5."""
    ls = _pair(lambda: coordinator(60, fa_spec(16), mamba_spec(16, 2), max_model_len=2048))
    pair = (Request("a", list(range(400))), Request("a", list(range(400))))
    assert _step(ls, pair, 32) == ([1, 2], [3, 4, 5])
    ls.call("plan", lambda c, s: c.take_step_plan())
    assert _step(ls, pair, 16) == ([6], [7])
    plan = ls.call("plan", lambda c, s: c.take_step_plan())
    assert plan.groups[1].copies == ((3, 4),)  # type: ignore[union-attr]
    assert _step(ls, pair, 320 - 48) == (list(range(8, 25)), [25])
    plan = ls.call("plan", lambda c, s: c.take_step_plan())
    assert plan.groups[1].copies == ((4, 5),) and plan.groups[1].checkpoint_writes == (("a", 5, 320),)  # type: ignore[union-attr]
    view = ls.a.describe("a")
    assert view is not None
    assert view.tables[1].block_ids == (0, 3, 4, *([0] * 16), 5, 7, 25)
    assert view.tables[1].positions == ((1, 32), (2, 48), (19, 320))
    # one retire settles three tags
    ls.call("retire 320", lambda c, s: c.retire("a", 320))
    view = ls.a.describe("a")
    assert view is not None and view.tables[1].retired_below == 19 and view.tables[1].positions == ()
    h = pair[0].block_hashes
    assert ls.a.block_pool.get_cached_block(h[19], [1])[0].block_id == 5  # type: ignore[index]
    assert ls.a.block_pool.get_cached_block(h[1], [1])[0].block_id == 3  # type: ignore[index]
    assert ls.a.block_pool.get_cached_block(h[2], [1])[0].block_id == 4  # type: ignore[index]


def _make(num_blocks: int, *specs, max_model_len: int = 2048, **kw) -> Callable[[], KVCacheCoordinator]:
    def make() -> KVCacheCoordinator:
        return coordinator(num_blocks, *specs, max_model_len=max_model_len, **kw)
    return make


@pytest.mark.parametrize("events", [False, True])
def test_same_hash_published_twice_then_evicted_by_the_mamba_pop(events: bool) -> None:
    """FA 16 + Mamba 16 (nspec 0), 8 blocks. A prefills 64 tokens (FA 1..4 publish H0..H3,
    Mamba 5) and is freed unretired (no Mamba state published): queue 5 6 7 8 | 4 3 2 1.
    B, same prompt, gets no hit (no Mamba state): its admission to 32 takes FA 5 6 (H0, H1:
    two copies each), Mamba 7. Its chunk to 64 takes FA 8 4 (4 still holds H3: evicted, then
    H2 -> 8, H3 -> 4) and Mamba 3, which still holds H2 (every group pops before attention
    publishes: 3 is evicted first). The map: H0 {1, 5}, H1 {2, 6}, H2 8, H3 4; two evictions."""
    ls = _pair(_make(9, fa_spec(16), mamba_spec(16, 0), enable_kv_cache_events=events), events=events)
    prompt = list(range(100))
    a = (Request("a", prompt), Request("a", prompt))
    assert _step(ls, a, 64) == ([1, 2, 3, 4], [5])
    ls.call("free a", lambda c, s: c.free("a"))
    b = (Request("b", prompt), Request("b", prompt))
    assert ls.call("hit b", lambda c, s: c.get_computed_blocks(b[s])[1]) == 0
    assert _step(ls, b, 32) == ([5, 6], [7])
    assert _step(ls, b, 32) == ([8, 4], [3])
    h = b[0].block_hashes
    cache = ls.a.block_pool.cached_block_hash_to_block[0]
    got = {k: (v.block_id if not isinstance(v, dict) else tuple(sorted(v))) for k, v in cache.items()}
    assert got == {h[0]: (1, 5), h[1]: (2, 6), h[2]: 8, h[3]: 4}
    assert ls.a.block_pool.num_evictions == 2  # 4 (H3) and 3 (H2); 5..8 held no hash
    ls.call("retire b", lambda c, s: c.retire("b", 64))
    ls.call("evict", lambda c, s: c.block_pool.evict_blocks([1, 8, 5]))
    c2 = (Request("c", prompt), Request("c", prompt))
    ls.call("hit c", lambda c, s: (lambda bl: (bl[0].get_block_ids(), bl[1]))(c.get_computed_blocks(c2[s])))
    ls.call("free b", lambda c, s: c.free("b"))
    ls.call("reset", lambda c, s: c.reset_prefix_cache())


@pytest.mark.parametrize("name", ["hbs8-hybrid", "interleaved", "mode-none", "sliding-only", "events"])
def test_invalid_counts_raise_the_same_and_change_nothing(name: str) -> None:
    """Too large (past the scheduled tokens, past the request's tokens), negative, str,
    float, bool: ``retire`` and ``allocate(num_processed_tokens=)`` raise the same error type
    on both paths, and nothing changes (the clock included); numpy ints and 0 are accepted."""
    import numpy as np

    events = CONFIGS[name][2].get("enable_kv_cache_events", False)
    ls = Lockstep(lambda: build(name), events=events)
    pair = (Request("q", list(range(300))), Request("q", list(range(300))))
    _step(ls, pair, 48)
    _step(ls, pair, 40)  # a chunk: 88 scheduled
    ls.call("retire 48", lambda c, s: c.retire("q", 48))
    for bad in (89, 301, 10**12, -1, "3", 2.5, True, False, np.int64(-3)):
        before = full_state(ls.a)
        r = ls.call(f"retire {bad!r}", lambda c, s, bad=bad: c.retire("q", bad))
        if bad is not False:
            assert isinstance(r, tuple) and r[0] == "error", (bad, r)
        assert full_state(ls.a) == before

        def alloc(c: KVCacheCoordinator, side: int, bad=bad):
            res = c.allocate(pair[side], 16, num_draft_tokens=0, num_processed_tokens=bad, now=9.0)
            if res is not None:
                pair[side].num_computed_tokens += 16
            return _ids(res)

        if bad is False:
            continue
        r = ls.call(f"allocate retire {bad!r}", alloc)
        assert isinstance(r, tuple) and r[0] == "error", (bad, r)
        assert full_state(ls.a) == before and ls.a.now == 0.0
    # accepted: a numpy int and 0 (no retire)
    ls.call("allocate np", lambda c, s: _ids(c.allocate(pair[s], 8, num_draft_tokens=0,
                                                       num_processed_tokens=np.int64(88))))
    ls.call("allocate 0", lambda c, s: _ids(c.allocate(pair[s], 8, num_draft_tokens=0, num_processed_tokens=0)))


def test_hash_block_size_view_keys_by_hand() -> None:
    """hash_block_size 8 under block-16 groups: the attention chunk publishes block i under
    the request's fine hash 2i + 1 and the Mamba retire publishes slot s under 2s + 1."""
    ls = Lockstep(_make(80, fa_spec(16), mamba_spec(16, 1), mamba_spec(16, 1), hash_block_size=8))
    prompt = list(range(2000, 2200))
    pair = (Request("v", prompt), Request("v", prompt))
    _step(ls, pair, 32)
    for n in (32, 16, 40, 24):  # chunks 64, 80, 120 (off a boundary), 144
        ls.call("retire", lambda c, s: c.retire("v", pair[s].num_computed_tokens))
        _step(ls, pair, n)
    ls.call("retire", lambda c, s: c.retire("v", 144))
    fine = pair[0].block_hashes
    assert len(fine) == 200 // 8
    view = ls.a.describe("v")
    assert view is not None
    fa, m1, m2 = view.tables
    pool = ls.a.block_pool
    for i in range(144 // 16):
        got = pool.get_cached_block(fine[2 * i + 1], [0])
        assert got is not None and got[0].block_id == fa.block_ids[i]
        assert pool.get_cached_block(fine[2 * i], [0]) is None  # the odd fine hashes only
    # Mamba states settled at 32, 64, 80, 144 (120 is off its boundary): slots 1, 3, 4, 8
    for slot in (1, 3, 4, 8):
        assert pool.get_cached_block(fine[2 * slot + 1], [1, 2]) is not None, slot
    assert pool.get_cached_block(fine[2 * 7 + 1], [1, 2]) is None
    assert m1.running_slot == m2.running_slot == 8


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["hbs8-hybrid", "two-mamba-specs", "latest", "none-checkpoints", "events"])
def test_in_flight_lag(name: str, lag: int) -> None:
    """Async scheduling: before each chunk the engine retires to ``computed - lag * chunk``
    (alternately by ``retire`` and inside ``allocate``), chunk sizes of several shapes, then
    decode with drafts and verifies; both paths equal throughout."""
    events = CONFIGS[name][2].get("enable_kv_cache_events", False)
    rng = random.Random(lag * 101 + len(name))
    for chunk in (16, 32, 48, 80, 23):
        ls = Lockstep(lambda: build(name), events=events)
        prompt = BASES[0][: 300 + lag]
        pair = (Request("L", prompt), Request("L", prompt))
        ends: list[int] = []
        while pair[0].num_computed_tokens < len(prompt):
            computed = pair[0].num_computed_tokens
            n = min(chunk, len(prompt) - computed)
            kw = {}
            settled = ends[-1 - lag] if len(ends) > lag else 0
            if settled and len(ends) % 2:
                kw["num_processed_tokens"] = settled
            elif settled:
                ls.call(f"retire {settled}", lambda c, s, k=settled: c.retire("L", k))
            la = rng.choice([0, 0, 3, 17])
            _step(ls, pair, n, num_lookahead_tokens=la, **kw)
            ends.append(pair[0].num_computed_tokens)
            ls.call("plan", lambda c, s: c.take_step_plan())
        for k in range(12):  # decode: drafts, verify, lagged retires
            ls.call("retire", lambda c, s, pair=pair: c.retire("L", pair[s].num_computed_tokens))
            d = k % 3

            def dec(c: KVCacheCoordinator, side: int, d=d, pair=pair, k=k):
                req = pair[side]
                if req.num_computed_tokens >= req.num_tokens:
                    req.append_output_token_ids([9000 + k])
                res = c.allocate(req, 1 + d, num_draft_tokens=d)
                req.num_computed_tokens += 1 + d
                return _ids(res)

            ls.call("decode", dec)
            if d:
                acc = k % (d + 1)

                def ver(c: KVCacheCoordinator, side: int, d=d, acc=acc, pair=pair):
                    out = c.accept_drafts("L", acc)
                    pair[side].num_computed_tokens -= d - acc
                    pair[side].append_output_token_ids([9100 + j for j in range(acc + 1)])
                    return out

                ls.call("verify", ver)
            ls.call("plan", lambda c, s: c.take_step_plan())


def test_mamba_quiet_while_attention_grows() -> None:
    """Mamba block 32, attention 16: a chunk from 33 to 48 stays in Mamba's running slot 1
    (the Mamba policy is quiet: it is skipped) while attention publishes a block and grows for
    lookahead; then a chunk from 48 to 96 grows both."""
    ls = Lockstep(_make(60, fa_spec(16), mamba_spec(32, 1)))
    pair = (Request("m", list(range(500))), Request("m", list(range(500))))
    _step(ls, pair, 33)
    # admission: FA 1 2 3 (33 tokens), Mamba [0 R=4 S=5]; 48 + 20 lookahead: FA 5 blocks
    assert _step(ls, pair, 15, num_lookahead_tokens=20) == ([6, 7], [])
    view = ls.a.describe("m")
    assert view is not None and view.tables[0].num_cached_blocks == 3 and view.tables[1].running_slot == 1
    ls.call("retire", lambda c, s: c.retire("m", 48))
    assert _step(ls, pair, 48) == ([8], [9])
    view = ls.a.describe("m")
    assert view is not None and view.tables[1].running_slot == 2 and view.tables[1].positions == ((2, 96),)


# ------------------------------------------------------------------ regressions (found by this file, fixed)
def test_map_key_order_when_a_later_policy_evicts_a_just_published_hash() -> None:
    """Two FA groups (block 16), 9 blocks. A (60-token prompt) takes g0 1 2 (H0 H1), g1 3 4;
    Q takes g0 5 (Z), g1 6; A is freed: queue 7 8 9 | 2 1 4 3. B (A's prompt, no hit used)
    takes g0 7, g1 8 (H0: two copies each), then its chunk to 32: g0 pops 9 and g1 pops 2,
    which still holds H1 in group 0. Every group pops before any publishes: 2 is evicted
    (group 0's H1 key deleted), then 9 is published (H1 re-inserted after Z): keys H0, Z, H1,
    map {H0: (1, 7), H1: 9, Z: 5} in group 0."""
    c = _make(10, fa_spec(16), fa_spec(16))()
    prompt = list(range(100, 160))
    a, q, b = Request("a", prompt), Request("q", list(range(500, 520))), Request("b", prompt)
    assert _ids(c.allocate(a, 32, num_draft_tokens=0)) == ([1, 2], [3, 4])
    assert _ids(c.allocate(q, 16, num_draft_tokens=0)) == ([5], [6])
    c.free("a")
    assert _ids(c.allocate(b, 16, num_draft_tokens=0)) == ([7], [8])
    b.num_computed_tokens = 16
    assert _ids(c.allocate(b, 16, num_draft_tokens=0)) == ([9], [2])
    h, z = b.block_hashes, q.block_hashes[0]
    name = {h[0]: "H0", h[1]: "H1", z: "Z"}
    m0 = c.block_pool.cached_block_hash_to_block[0]
    assert [name[k] for k in m0] == ["H0", "Z", "H1"]
    assert ordered_map(c)[0] == {h[0]: (1, 7), z: 5, h[1]: 9}


def test_a_refused_rewrite_of_a_published_state_changes_nothing() -> None:
    """FA 16 + Mamba 16 (nspec 2): 32 tokens, retired (the state at 32 in slot 1 published).
    The engine sets the computed count back to 20 (below the retired count: a misuse, but
    one ``check_computed`` lets through) and schedules 12 tokens with 40 lookahead: Mamba
    raises InvalidTokenCountError (slot 1 is published). FA used to grow from [1 2] to
    [1 2 6 7 8] first and keep the blocks; now every Mamba policy is asked
    (``check_writable_step``) before any group commits: nothing changes."""
    c = _make(60, fa_spec(16), mamba_spec(16, 2))()
    req = Request("a", list(range(100)))
    c.allocate(req, 32, num_draft_tokens=0)
    req.num_computed_tokens = 32
    c.retire("a", 32)
    req.num_computed_tokens = 20
    before = full_state(c)
    with pytest.raises(MambaKVError):
        c.allocate(req, 12, num_draft_tokens=0, num_lookahead_tokens=40)
    assert full_state(c) == before, c.get_block_ids("a")


def test_too_many_drafts_leaves_the_clock() -> None:
    """5 drafts against 2 speculative blocks: InvalidDraftCountError, and the clock stays at 0.0
    (it used to move to 5.0 first: the draft check ran after ``now`` was set)."""
    c = _make(60, fa_spec(16), mamba_spec(16, 2))()
    req = Request("a", list(range(40)))
    c.allocate(req, 40, num_draft_tokens=0)
    req.num_computed_tokens = 40
    req.append_output_token_ids([1])
    before = full_state(c)
    with pytest.raises(MambaKVError):
        c.allocate(req, 6, num_draft_tokens=5, now=5.0)
    assert full_state(c) == before and c.now == 0.0
