"""Prefill chunks and the one-call retire: ``allocate(..., num_processed_tokens=n)`` must come
to exactly what ``retire(request_id, n)`` then ``allocate`` does (results, plans, free-queue
order, every block's ref count and hash, the prefix-cache map, every live table, errors raised),
and a long chunked prefill ends in the hand-counted table."""

from __future__ import annotations

import random

import pytest

from mambakv import InvalidDraftCountError, KVCacheCoordinator, MambaKVError, Request
from tests.coord_helpers import coordinator, fa_spec, snapshot, sw_spec
from tests.helpers import mamba_spec

BASES = [list(range(1000 + 97 * k, 1000 + 97 * k + 600)) for k in range(3)]


def configs() -> dict[str, tuple]:
    return {
        "hybrid": (100, fa_spec(16), mamba_spec(16, 2), mamba_spec(16, 2), mamba_spec(16, 2)),
        "hybrid-nspec0": (70, fa_spec(16), mamba_spec(16, 0), mamba_spec(16, 0)),
        "sliding+mamba": (150, fa_spec(8), sw_spec(8, 20), mamba_spec(16, 1)),
        "mamba-only": (24, mamba_spec(8, 3)),
        "attention-only": (90, fa_spec(8)),
        "mamba-none": (80, fa_spec(16), mamba_spec(16, 2, mode="none")),
        "latest": (100, fa_spec(16), mamba_spec(16, 2, decode_checkpoints="latest")),
    }


def build(name: str, **kw) -> KVCacheCoordinator:
    num_blocks, *specs = configs()[name]
    return coordinator(num_blocks, *specs, max_model_len=2048, **kw)


def state(coord: KVCacheCoordinator) -> tuple:
    rids = sorted(coord.request_ids)
    return snapshot(coord, rids), [coord.describe(r) for r in rids], coord.prefix_cache_stats.hits


def drive(coord: KVCacheCoordinator, seed: int, steps: int = 120, *, retire_in_allocate: bool = False) -> list:
    """A random engine: admissions with hits, prefill chunks (aligned or not, lookahead),
    decode steps with drafts and their verify, lagged retires, frees. Returns every result.
    Some steps retire first: by ``retire`` then ``allocate``, or with `retire_in_allocate` by
    ``allocate(..., num_processed_tokens=)``, which must come to the same."""
    rng = random.Random(seed)
    out: list = []
    reqs: dict[str, Request] = {}
    done: dict[str, list[int]] = {}  # computed counts of steps not retired yet
    nspec = min((m.num_speculative_blocks for m in coord.mamba_managers), default=3)
    drafted: dict[str, int] = {}
    bs = coord.alignment_tokens
    for i in range(steps):
        coord.new_step()
        action = rng.random()
        try:
            if action < 0.15 and len(reqs) < 4:
                base = rng.choice(BASES)
                prompt = base[: rng.randrange(1, len(base))] + [rng.randrange(5000, 6000) for _ in range(rng.randrange(3))]
                req = Request(f"r{i}", prompt)
                blocks, hit = coord.get_computed_blocks(req)
                n = min(len(prompt) - hit, rng.choice([bs, 2 * bs, 5 * bs, rng.randrange(1, 200)]))
                res = coord.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks, num_draft_tokens=0)
                out.append(("admit", hit, None if res is None else res.get_block_ids()))
                if res is not None:
                    reqs[req.request_id] = req
                    req.num_computed_tokens = hit + n
                    done[req.request_id] = [req.num_computed_tokens]
            elif action < 0.65 and reqs:
                req = reqs[rng.choice(sorted(reqs))]
                rid = req.request_id
                if rid in drafted:  # verify the pending drafts first
                    d = drafted.pop(rid)
                    acc = rng.randrange(d + 1)
                    out.append(("accept", coord.accept_drafts(rid, acc)))
                    req.num_computed_tokens -= d - acc
                    req.append_output_token_ids([rng.randrange(7000, 8000) for _ in range(acc + 1)])
                    done[rid].append(req.num_computed_tokens)
                    continue
                computed = req.num_computed_tokens
                left = req.num_prompt_tokens - computed
                la = rng.choice([0, 0, 0, 2, 5])
                kw: dict = {}
                if rng.random() < 0.4:  # retire an older step's count with this step
                    counts = done[rid]
                    k = rng.randrange(len(counts))
                    if retire_in_allocate:
                        kw["num_processed_tokens"] = counts[k]
                    else:
                        coord.retire(rid, counts[k])
                    del counts[:k]
                if left > 0:
                    n = min(left, rng.choice([bs, 2 * bs, 3 * bs, 7 * bs, rng.randrange(1, 3 * bs)]))
                    res = coord.allocate(req, n, num_draft_tokens=0, num_lookahead_tokens=la, **kw)
                    drafts = 0
                else:
                    if computed >= req.num_tokens:
                        req.append_output_token_ids([rng.randrange(7000, 8000)])
                    drafts = rng.randrange(nspec + 1) if rng.random() < 0.5 else 0
                    res = coord.allocate(req, 1 + drafts, num_draft_tokens=drafts, num_lookahead_tokens=la, **kw)
                    n = 1 + drafts
                out.append(("step", n, drafts, None if res is None else res.get_block_ids()))
                if res is not None:
                    req.num_computed_tokens += n
                    if drafts:
                        drafted[rid] = drafts
                    else:
                        done[rid].append(req.num_computed_tokens)
            elif action < 0.7 and reqs:  # misuse: too many drafts, or retiring what was never scheduled
                req = reqs[rng.choice(sorted(reqs))]
                if rng.random() < 0.5:
                    res = coord.allocate(req, nspec + 3, num_draft_tokens=nspec + 2)
                    out.append(("bad", None if res is None else res.get_block_ids()))
                else:
                    coord.retire(req.request_id, req.num_computed_tokens + rng.randrange(1, 40))
            elif action < 0.9 and reqs:
                rid = rng.choice(sorted(reqs))
                counts = done[rid]
                k = rng.randrange(len(counts))
                coord.retire(rid, counts[k])
                del counts[:k]
                out.append(("retire", rid))
            elif reqs:
                rid = rng.choice(sorted(reqs))
                coord.free(rid)
                del reqs[rid]
                drafted.pop(rid, None)
                out.append(("free", rid))
        except MambaKVError as e:  # both routes must refuse the same calls, changing nothing
            out.append(("error", type(e).__name__))
        out.append(coord.take_step_plan())
        out.append(state(coord))
        coord.check_invariants()
    return out


@pytest.mark.parametrize("name", sorted(configs()))
def test_retire_in_allocate_matches_retire_then_allocate(name: str) -> None:
    for seed in range(12):
        assert drive(build(name), seed, retire_in_allocate=True) == drive(build(name), seed)


def test_retire_in_allocate_checks() -> None:
    """``allocate(..., num_processed_tokens=n)`` refuses what ``retire`` refuses (nothing
    changed, the clock included), and is a no-op retire for 0 and for a new request."""
    coord = build("hybrid")
    req = Request("k", list(range(64)))
    assert coord.allocate(req, 32, num_draft_tokens=0, num_processed_tokens=0) is not None  # new: no retire
    req.num_computed_tokens = 32
    before = state(coord)
    for bad in (33, -1, "3"):  # 33 > the 32 scheduled tokens
        with pytest.raises(MambaKVError):
            coord.allocate(req, 16, num_draft_tokens=0, num_processed_tokens=bad, now=5.0)
        assert state(coord) == before and coord.now == 0.0
    assert coord.allocate(req, 16, num_draft_tokens=0, num_processed_tokens=32) is not None
    # Block 16: the first chunk (32 tokens) kept its state in slot 1 (slot 0 null). Retiring 32
    # publishes it and moves the watermark to 1; the chunk to 48 tags its running slot 2.
    view = coord.describe("k")
    assert view is not None
    assert view.tables[1].retired_below == 1 and view.tables[1].positions == ((2, 48),)
    assert coord.block_pool.get_cached_block(req.block_hashes[1], [1, 2, 3]) is not None


def test_retire_in_allocate_with_events_and_eagle() -> None:
    for seed in range(8):
        for kw in ({"enable_kv_cache_events": True}, {"use_eagle": True}):
            one, two = build("hybrid", **kw), build("hybrid", **kw)
            assert drive(one, seed, retire_in_allocate=True) == drive(two, seed)
            if kw.get("enable_kv_cache_events"):
                assert one.take_events() == two.take_events()


def test_the_retire_in_allocate_comparison_has_teeth() -> None:
    """A retire inside allocate that forgets to publish (so a settled state is never cached)
    must make the comparison fail."""
    def planted(coord: KVCacheCoordinator) -> KVCacheCoordinator:
        for m in coord.mamba_managers:
            m.cache_blocks = lambda request, num_tokens: None  # type: ignore[method-assign]
        return coord

    assert any(drive(planted(build("hybrid")), seed, retire_in_allocate=True) != drive(build("hybrid"), seed)
               for seed in range(6))


def test_long_prefill_chunks() -> None:
    """Hand count: block 16, 2 speculative blocks, chunks of 64 tokens. After the first chunk
    (the admission) each later chunk grows the attention table by 4 blocks and each Mamba
    column by one (GROW). Each of the 9 retires reaches the Mamba policy only: the attention
    table published every full block at allocation, so its next event (the next block
    boundary, 16 tokens past the scheduled ones) lies beyond every processed count."""
    coord = build("hybrid")
    calls = {"retire_slots": 0}
    for p in coord.policies:
        own = p.retire_slots

        def counting(*a, _f=own, **k):  # type: ignore[no-untyped-def]
            calls["retire_slots"] += 1
            return _f(*a, **k)

        p.retire_slots = counting  # type: ignore[method-assign]
    req = Request("long", list(range(640)))
    for end in range(64, 641, 64):
        if req.num_computed_tokens:
            coord.retire("long", req.num_computed_tokens)
        assert coord.allocate(req, end - req.num_computed_tokens, num_draft_tokens=0) is not None
        req.num_computed_tokens = end
        coord.check_invariants()
    assert calls == {"retire_slots": 9}
    view = coord.describe("long")
    assert view is not None
    attention, mamba = view.tables[0], view.tables[1]
    assert len(attention.block_ids) == 40 and attention.num_cached_blocks == 40
    # running slot 39 (640 tokens), 2 scratch blocks after it; slots below the last processed
    # state (576 tokens: slot 35) retired
    assert mamba.running_slot == 39 and len(mamba.block_ids) == 42 and mamba.retired_below == 35


def test_a_retire_past_a_pending_verify_raises() -> None:
    """A retire past a step with drafts whose accept_drafts has not come raises, with nothing
    changed."""
    coord = build("hybrid")
    req = Request("d", list(range(40)))
    assert coord.allocate(req, 40, num_draft_tokens=0) is not None
    req.num_computed_tokens = 40
    coord.retire("d", 40)
    req.append_output_token_ids([5])
    assert coord.allocate(req, 3, num_draft_tokens=2) is not None
    req.num_computed_tokens = 43
    before = state(coord)
    with pytest.raises(InvalidDraftCountError):
        coord.retire("d", 41)
    assert state(coord) == before
